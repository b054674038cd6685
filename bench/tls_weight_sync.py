"""The cost of TLS on the gRPC weight path (issue 24), on CPU.

A real `grpo rollout` server (hf engine, CPU) with a random Qwen3 model of a few hundred MB,
and the trainer's `GrpcWeightSender` pushing that model's weights to it over loopback: first in
plaintext, then over TLS with the job's certificate (as the operator and `grpo run` set it up).
Each push is timed end to end (chunks, checksums, the server applying them), several times,
alternating between the two servers; the throughput is the bytes over the median (and best) time.

    python bench/tls_weight_sync.py                 # ~0.4 GB of fp32 weights, 5 pushes per mode

Prints one JSON line per push and a summary line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

READY = "GRPO_ROLLOUT_READY "


def _server(job: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, int]:
    # `grpo rollout`, without needing the package installed (the device image runs from the tree)
    code = "import sys; from grpo_rollout.serve import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--spec", str(job), "--port", "0",
                             "--host", "127.0.0.1", "--metrics-port", "-1", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), env=env, text=True)
    for line in proc.stdout:
        if line.startswith(READY):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, json.loads(line[len(READY):])["port"]
    raise RuntimeError(f"the rollout server did not start: {log.read_text()[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=512, help="weightSync.bucketSizeMb (the default)")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="grpo-tls-bench-"))
    try:
        _bench(tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench(tmp: Path, args) -> None:
    from safetensors.torch import load_file

    from grpo_api.rpc import ClientAuth, RolloutClients
    from grpo_operator.pki import make_job_tls
    from grpo_rollout.tiny import build_tiny_model
    from grpo_trainer.weight_sync import GrpcWeightSender

    model = build_tiny_model(tmp / "model", hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                             head_dim=args.hidden // 16)
    weights = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update(load_file(f))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    reward = tmp / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "bench"},
                                   "spec": {"model": {"path": str(model), "dtype": "float32"},
                                            "data": {"trainFiles": ["file:///unused.parquet"]},
                                            "rollout": {"engine": "hf"},
                                            "reward": {"function": f"{reward}:score", "workers": 1}}}))
    tls = make_job_tls("bench", ["localhost"], ["127.0.0.1"])
    token = "bench-token"
    base = {**os.environ, "GRPO_RPC_TOKEN": token, "OMP_NUM_THREADS": "1"}
    modes = {
        "plaintext": ({}, token),
        "tls": ({"GRPO_TLS_CERT": tls.cert, "GRPO_TLS_KEY": tls.key}, ClientAuth(token, tls.ca_cert.encode(), "localhost")),
    }
    # Both servers up at once, pushes alternating between them: on a shared machine the load
    # drifts, and alternating spreads it over both modes alike.
    servers = {mode: _server(job, {**base, **env}, tmp / f"{mode}.log") for mode, (env, _) in modes.items()}
    senders = {mode: GrpcWeightSender(RolloutClients(auth), bucket_bytes=args.bucket_mb << 20) for mode, (_, auth) in modes.items()}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for version in range(1, args.repeats + 1):
            for mode, sender in senders.items():
                start = time.perf_counter()
                report = sender.send([f"127.0.0.1:{servers[mode][1]}"], weights.items(), version)
                times[mode].append(time.perf_counter() - start)
                print(json.dumps({"mode": mode, "bytes": report.nbytes, "seconds": round(times[mode][-1], 3),
                                  "gb_per_s": round(report.nbytes / times[mode][-1] / 1e9, 3)}), flush=True)
    finally:
        for sender in senders.values():
            sender.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    for mode, ts in times.items():
        median = statistics.median(ts)
        print(json.dumps({"mode": mode, "summary": True, "gb": round(nbytes / 1e9, 3), "pushes": len(ts),
                          "median_s": round(median, 3), "best_s": round(min(ts), 3),
                          "gb_per_s_median": round(nbytes / median / 1e9, 3),
                          "gb_per_s_best": round(nbytes / min(ts) / 1e9, 3)}), flush=True)

if __name__ == "__main__":
    main()
