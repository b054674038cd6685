"""Issue 34 item 4: where `grpo rollout` loses ~0.8 s against the same vLLM engine used directly
(4.9-5.1 s against 4.1 s for 256 x 512 in earlier calls, taken in different calls and settings).
In one call, on the bench model (`build` first), the issue-14 workload (32 prompts x n=8, 512
new tokens, temperature 1):

1. `grpo rollout` (vllm, 35 % of the GPU, as vllm_check's server), Generate three times over gRPC
   (the first warms up): the engine seconds the worker measures around `Engine.generate`, and the
   CPU seconds of every thread of the server and its engine-core process during each timed call
   (from /proc: which thread, in which process, burns what);
2. the server stopped, the same engine class (`VLLMEngine`, the server's arguments) built in this
   process and `generate` called on the same prompt ids three times, with the same thread count.

    python bench/server_gen_profile.py --workdir /tmp/grpo-bench --results OUT.jsonl [--tiny --engine hf]
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import bench_parser  # noqa: E402
import h200_bench as hb  # noqa: E402
from vllm_check import Client, prompt_rows, write_job  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def thread_cpu(pid: int) -> dict[tuple[int, str, int, str], float]:
    """{(process, process name, thread, thread name): CPU seconds so far} for pid's whole tree."""
    out = {}
    for p in _tree(pid):
        try:
            pname = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[(p, pname, int(task.name), name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def busiest(before: dict, after: dict, top: int = 10) -> list[dict]:
    used = [(after[k] - before.get(k, 0.0), k) for k in after]
    used.sort(reverse=True)
    return [{"process": f"{k[1]}({k[0]})", "thread": f"{k[3]}({k[2]})", "cpu_s": round(s, 2)} for s, k in used[:top]
            if s > 0.005]


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    args = p.parse_args(argv)

    w = hb.workload(args)
    token = secrets.token_hex(16)
    job_path = write_job(args, f"job-profile-{args.engine}.yaml", **{
        "spec.rollout.engine": args.engine, "spec.rollout.gpuMemoryUtilization": args.gpu_memory_utilization})
    log_path = Path(args.log_dir) / f"server-gen-profile-{args.engine}.log"
    t = time.perf_counter()
    proc, address = hb.start_rollout_server(args, job_path, token, log_path)
    hb.log(f"server ready in {time.perf_counter() - t:.1f}s")
    rows = prompt_rows(args, w["prompts"])
    runs = []
    try:
        client = Client(job_path, address, token)
        for rep in range(3):
            before = thread_cpu(proc.pid)
            _, reply, wall = client.generate(rows, n=w["n"], max_tokens=w["response_len"], temperature=1.0, version=0)
            runs.append({"engine_s": round(reply.generate_seconds, 3), "wall_s": round(wall, 3),
                         "tokens": reply.generated_tokens, "busiest": busiest(before, thread_cpu(proc.pid))})
            hb.log(f"server generate {rep}: engine {reply.generate_seconds:.3f}s wall {wall:.3f}s; "
                   f"busiest {runs[-1]['busiest'][:4]}")
    finally:
        proc.terminate()
        proc.wait(60)
    hb.emit(args, "server_gen_profile", where="grpo rollout", engine=args.engine, runs=runs)

    from grpo_api.jobfile import load_job
    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.serve import build_engine
    spec = load_job(job_path).spec
    engine = build_engine(spec, spec.model, device="cuda" if not args.tiny else "cpu")
    prompts, direct = [r.prompt_ids for r in rows], []
    try:
        for rep in range(3):
            before = thread_cpu(os.getpid())
            t = time.perf_counter()
            groups = engine.generate(prompts, SamplingParams(n=w["n"], max_tokens=w["response_len"], temperature=1.0))
            seconds = time.perf_counter() - t
            direct.append({"engine_s": round(seconds, 3), "tokens": sum(len(s.token_ids) for g in groups for s in g),
                           "busiest": busiest(before, thread_cpu(os.getpid()))})
            hb.log(f"direct generate {rep}: {seconds:.3f}s; busiest {direct[-1]['busiest'][:4]}")
    finally:
        engine.close()
    hb.emit(args, "server_gen_profile", where="engine in this process", engine=args.engine, runs=direct)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
