"""Issue 20: two GPUs (the lent `nvidia-h200-x2`), through the project's own code paths. Run by
bench/h200_run.sh (phases link, x2-sync, x2-train); `--tiny` runs each on a CPU (gloo) in
seconds, the local check. One JSON object per result in --results, as h200_bench does.

  link   the practical peak: torch.distributed NCCL broadcast of the weights' size between the
         two GPUs (each process sees only its GPU, as two pods do; and both GPUs visible)
  sync   trainer side on GPU 0 (the publisher's one-buffer layout, CollectiveWeightSender,
         backend nccl) -> a `grpo rollout` server (hf engine) on GPU 1: seconds and GB/s, end to
         end and the broadcasts alone. Greedy outputs after the update equal those of a server
         started from the same weights on disk. Then the abort path:
         - the server SIGKILLed between two buckets: the trainer gives up (seconds), its GPU
           still works, a restarted server is re-synced (new group) and generates correctly;
         - a trainer that hangs between two buckets: a second trainer's update makes the
           server abort the old NCCL group and take the new weights (seconds).
  train  FSDP2 training phase (reference logprobs + policy update, the issue-14 workload) on 1
         GPU, then on 2 ranks (torchrun-style env, one process per GPU): tokens/s per GPU, MFU;
         losses of the first 2 steps and the weight change after 2 steps compared between them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import h200_bench as hb  # noqa: E402
from vllm_check import Client, perturbed, prompt_rows, write_job  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights_nbytes(args) -> int:
    """The rollout weights' size: bf16, the tied LM head once (what the publisher sends)."""
    cfg = hb.TINY if args.tiny else hb.FULL
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * cfg["head_dim"]
    return 2 * (v * h + layers * per_layer + h)


# --- link -------------------------------------------------------------------------------------------

def cmd_link_rank(args) -> None:
    import torch
    import torch.distributed as dist
    cuda = not args.tiny
    if cuda:
        dev = torch.device("cuda", 0 if args.isolated else args.rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=2)
    nbytes = weights_nbytes(args)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for rep in range(args.warmup + args.reps):
        dist.barrier()
        hb.sync(dev)
        t = time.perf_counter()
        dist.broadcast(buf, src=0)
        hb.sync(dev)
        if rep >= args.warmup:
            times.append(time.perf_counter() - t)
    if args.rank == 0:
        best, med = min(times), hb.median(times)
        hb.emit(args, "link", isolated=args.isolated, gbytes=nbytes / 1e9, seconds=times, median_s=med,
                median_gbps=nbytes / med / 1e9, best_gbps=nbytes / best / 1e9)
        hb.log(f"NCCL broadcast {nbytes / 1e9:.2f} GB ({'one GPU visible per process' if args.isolated else 'both visible'}): "
               f"median {med * 1e3:.1f} ms = {nbytes / med / 1e9:.1f} GB/s (best {nbytes / best / 1e9:.1f})")
    dist.destroy_process_group()


def cmd_link(args) -> None:
    if not args.tiny:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        print(topo, flush=True)
        hb.emit(args, "topology", nvidia_smi_topo=topo)
    for isolated in (True, False):
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ)
            if isolated and not args.tiny:
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            argv = [sys.executable, __file__, "link-rank", "--rank", str(rank), "--port", str(port),
                    "--reps", str(args.reps), "--warmup", str(args.warmup), "--results", args.results,
                    "--workdir", args.workdir, "--log-dir", args.log_dir] + (["--isolated"] if isolated else []) \
                + (["--tiny"] if args.tiny else [])
            procs.append(subprocess.Popen(argv, env=env))
        for p in procs:
            if p.wait(240) != 0:
                raise RuntimeError(f"link rank exited {p.returncode}")


# --- sync and abort ---------------------------------------------------------------------------------

def one_buffer(weights: dict, device):
    """The publisher's layout: every tensor a view into one buffer (grpo_trainer.publisher)."""
    from vllm_check import ipc_layout
    buffer, layout = ipc_layout(weights, device)
    import torch
    views = {}
    for placed in layout.tensors:
        dtype = getattr(torch, placed.spec.dtype)
        views[placed.spec.name] = buffer[placed.offset:placed.offset + placed.nbytes].view(dtype).reshape(
            placed.spec.shape)
    return buffer, views


def save_model(src: Path, dst: Path, weights: dict) -> Path:
    """`src`'s config and tokenizer with `weights`: what a server loads directly from disk."""
    from safetensors.torch import save_file
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file({n: t.detach().contiguous().cpu() for n, t in weights.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def cmd_sync(args) -> None:
    import secrets

    import torch
    from transformers import AutoModelForCausalLM

    from grpo_trainer import weight_sync
    from grpo_api.rpc import RolloutClients
    from grpo_trainer.weight_sync import CollectiveWeightSender, WeightSyncError
    dev = hb.device()
    server_gpu = None if args.tiny else 1
    token = secrets.token_hex(16)
    job_path = write_job(args, "job-x2-hf.yaml", **{"spec.rollout.engine": "hf"})
    model_dir = Path(hb.load_bench_job(args).spec.model.path)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    weights_a = {n: t for n, t in hf.state_dict().items() if n != "lm_head.weight" or not hf.config.tie_word_embeddings}
    weights_a = {n: t.to(dev) for n, t in weights_a.items()}
    del hf
    weights_b = perturbed(weights_a, seed=1)
    if args.tiny:   # the tiny model's init is narrow: make B differ visibly
        weights_b = {n: t * 3 for n, t in weights_b.items()}
    buf_a, views_a = one_buffer(weights_a, dev)
    buf_b, views_b = one_buffer(weights_b, dev)
    nbytes = buf_a.numel()
    rows = prompt_rows(args, 8)
    log_path = Path(args.log_dir) / "x2-sync-server.log"

    def start():
        t = time.perf_counter()
        proc, address = hb.start_rollout_server(args, job_path, token, log_path, gpu=server_gpu)
        hb.log(f"hf server on GPU {server_gpu} ready in {time.perf_counter() - t:.1f}s at {address}")
        return proc, address

    def greedy(address, version):
        samples, _, _ = Client(job_path, address, token).generate(rows, n=1, max_tokens=32, temperature=0.0,
                                                                   version=version)
        return [s.response_ids for s in sorted(samples, key=lambda s: s.prompt_index)]

    backend = "gloo" if args.tiny else "nccl"
    bucket_bytes = (16 << 10) if args.tiny else args.bucket_mb << 20
    sender = CollectiveWeightSender(RolloutClients(token), bucket_bytes=bucket_bytes, device=dev, master_addr="127.0.0.1",
                                    backend=backend, timeout_seconds=60)
    proc, address = start()
    result: dict = {"gbytes": nbytes / 1e9, "bucket_mb": args.bucket_mb, "backend": backend}
    try:
        runs = []
        for version in range(1, args.reps + 2):
            views = views_b if version % 2 else views_a
            t = time.perf_counter()
            report = sender.send([address], views.items(), version)
            secs = time.perf_counter() - t
            runs.append({"version": version, "seconds": secs, "transfer_s": report.transfer_seconds})
            hb.log(f"nccl update v{version}: {nbytes / 1e9:.2f} GB in {secs:.3f}s ({nbytes / secs / 1e9:.1f} GB/s); "
                   f"broadcasts {report.transfer_seconds:.3f}s ({nbytes / report.transfer_seconds / 1e9:.1f} GB/s)")
        timed = runs[1:]          # the first forms the group (NCCL communicator set-up)
        med, med_t = hb.median([r["seconds"] for r in timed]), hb.median([r["transfer_s"] for r in timed])
        result.update(runs=runs, median_s=med, median_gbps=nbytes / med / 1e9, median_transfer_s=med_t,
                      median_transfer_gbps=nbytes / med_t / 1e9, first_s=runs[0]["seconds"])
        last = runs[-1]["version"]
        after_update = greedy(address, last)
        held, other = (views_b, views_a) if last % 2 else (views_a, views_b)
        hb.stop_server(proc)

        # The same weights loaded directly from disk by a fresh server.
        direct_dir = save_model(model_dir, Path(args.workdir) / "model-direct", weights_b if last % 2 else weights_a)
        direct_job = write_job(args, "job-x2-direct.yaml", **{"spec.rollout.engine": "hf",
                                                              "spec.model.path": str(direct_dir)})
        t = time.perf_counter()
        proc, address = hb.start_rollout_server(args, direct_job, token, log_path, gpu=server_gpu)
        direct = Client(direct_job, address, token).generate(rows, n=1, max_tokens=32, temperature=0.0, version=0)[0]
        direct = [s.response_ids for s in sorted(direct, key=lambda s: s.prompt_index)]
        result["greedy_equal_to_direct_load"] = after_update == direct
        result["greedy_equal_rows"] = sum(a == b for a, b in zip(after_update, direct))
        hb.log(f"greedy after the nccl update == direct load: {after_update == direct} "
               f"({result['greedy_equal_rows']}/{len(direct)} rows)")
        hb.stop_server(proc)
        hb.emit(args, "x2_sync", **result)

        # Abort 1: the server dies between bucket 2 and 3.
        proc, address = start()
        real = weight_sync._Group.broadcast
        count = {"n": 0}

        def kill_after_two(self, tensor, deadline, check=None):
            count["n"] += 1
            if count["n"] == 3:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            return real(self, tensor, deadline, check)
        weight_sync._Group.broadcast = kill_after_two
        t = time.perf_counter()
        try:
            sender.send([address], held.items(), 100)
            gave_up = None
        except WeightSyncError as exc:
            gave_up = str(exc)
        give_up_s = time.perf_counter() - t
        weight_sync._Group.broadcast = real
        x = torch.ones(1024, 1024, device=dev)
        gpu_ok = bool(torch.isfinite((x @ x).sum()).item())
        hb.log(f"server killed mid-broadcast: trainer gave up after {give_up_s:.2f}s: {gave_up}; trainer GPU ok: {gpu_ok}")
        proc, address = start()      # what the pod's restart or `grpo run` does
        t = time.perf_counter()
        sender.send([address], held.items(), 101)
        resync_s = time.perf_counter() - t
        resynced = greedy(address, 101)
        abort = {"killed_give_up_s": give_up_s, "killed_error": gave_up, "trainer_gpu_ok_after": gpu_ok,
                 "restarted_resync_s": resync_s, "restarted_greedy_equal": resynced == direct}
        hb.log(f"restarted server re-synced in {resync_s:.2f}s; greedy equal to direct load of B: "
               f"{abort['restarted_greedy_equal']}")

        hb.emit(args, "x2_abort", **abort)
        if args.tiny:
            return    # gloo can't abort a pending receive: the takeover below is NCCL's
        # Abort 2: a trainer that hangs between bucket 1 and 2; a second trainer takes over.
        import threading
        release = threading.Event()
        hung = threading.Event()
        count["n"] = 0

        def hang_after_one(self, tensor, deadline, check=None):
            count["n"] += 1
            if count["n"] == 2 and threading.current_thread().name == "hung-trainer":
                hung.set()
                release.wait(300)
                raise RuntimeError("hung trainer released")
            return real(self, tensor, deadline, check)
        first = CollectiveWeightSender(RolloutClients(token), bucket_bytes=bucket_bytes, device=dev, master_addr="127.0.0.1",
                                       backend=backend, timeout_seconds=600)
        weight_sync._Group.broadcast = hang_after_one
        thread = threading.Thread(target=lambda: _swallow(first.send, [address], other.items(), 102),
                                  name="hung-trainer")
        thread.start()
        hung.wait(120)
        t = time.perf_counter()
        sender.send([address], held.items(), 103)
        takeover_s = time.perf_counter() - t
        weight_sync._Group.broadcast = real
        taken = greedy(address, 103)
        release.set()
        thread.join(60)
        first.close()
        hb.log(f"a second trainer took over from a hung one in {takeover_s:.2f}s; greedy equal: {taken == direct}")
        hb.emit(args, "x2_takeover", hung_takeover_s=takeover_s, hung_takeover_greedy_equal=taken == direct)
    finally:
        sender.close()
        hb.stop_server(proc)
        hb.dump_server_log(log_path, 25)


def _swallow(fn, *a):
    try:
        fn(*a)
    except Exception as exc:  # noqa: BLE001 - the hung trainer is expected to fail
        hb.log(f"hung trainer's update ended: {type(exc).__name__}: {str(exc)[:200]}")


# --- FSDP2 on two ranks -----------------------------------------------------------------------------

def cmd_train_rank(args) -> None:
    """One rank (RANK/WORLD_SIZE/MASTER_* in the environment, as torchrun sets them)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig

    from grpo_trainer import actor, batch as batching
    from grpo_trainer.lora import wrapper
    from grpo_trainer.model import build_optimizer, build_policy, build_reference
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = not args.tiny
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    w = hb.workload(args)
    spec = hb.load_bench_job(args, **{"spec.trainer.maxTokensPerGPU": args.max_tokens[0]}).spec
    config = AutoConfig.from_pretrained(spec.model.path)
    peak = hb.matmul_rate(dev)
    model = build_policy(spec.model, dev, compile=args.compile, wrap=wrapper(spec.model))
    ref = build_reference(spec.model, dev, cpu_offload=False, compile=args.compile)
    opt, sched = build_optimizer(model, spec.trainer, total_steps=1000)

    def full_params():
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
                for n, p in model.named_parameters()}
    initial = full_params()
    samples = hb.synthetic_samples(w, config.vocab_size)
    adv = batching.advantages_per_sample(samples, "grpo", norm_adv_by_std=True, gamma=1.0)
    share = batching.rank_share(list(range(len(samples))), rank, world)
    groups = batching.micro_batches(share, samples, max_count=spec.trainer.micro_batch_size_per_gpu,
                                    max_tokens=spec.trainer.max_tokens_per_gpu)
    mbs = [batching.collate(g, samples, adv, 0, dev) for g in groups]
    tokens = sum(samples[i].length for i in share)
    flops = hb.model_flops(config, w["prompt_len"] + w["response_len"])
    rows = []
    for step in range(1, args.steps + 1):
        hb.sync(dev)
        dist.barrier()
        t = time.perf_counter()
        ref_logp = dict(zip(map(id, mbs), actor.compute_logprobs(ref, mbs, spec.rollout.temperature)))
        result = actor.update_policy(model, opt, sched, spec, [mbs], {}, ref_logp, world, dev)
        hb.sync(dev)
        secs = time.perf_counter() - t
        rows.append({"step": step, "seconds": secs, "pg_loss": result.metrics.get("actor/pg_loss"),
                     "kl_loss": result.metrics.get("actor/kl_loss"), "grad_norm": result.metrics.get("actor/grad_norm")})
        if rank == 0:
            hb.log(f"world {world} step {step}: {secs:.2f}s " + json.dumps(rows[-1]))
        if step == 2:
            change = {n: p - initial[n] for n, p in full_params().items()}
            if rank == 0:
                import torch as _t
                _t.save(change, Path(args.workdir) / f"change-world{world}.pt")
    timed = [r["seconds"] for r in rows[1:]]
    secs = hb.median(timed)
    if rank == 0:
        hb.emit(args, "x2_train", world=world, steps=rows, tokens_per_gpu=tokens, median_s=secs,
                tokens_per_s_per_gpu=tokens / secs, mfu=tokens * flops["fwd_per_token"] * 4 / secs / peak,
                peak_tflops=peak / 1e12, micro_batches=len(mbs),
                max_mem_gb=torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None)
    dist.destroy_process_group()


def cmd_train(args) -> None:
    import torch
    for world in (1, 2):
        port = free_port()
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            argv = [sys.executable, __file__, "train-rank", "--steps", str(args.steps), "--results", args.results,
                    "--workdir", args.workdir, "--log-dir", args.log_dir,
                    "--max-tokens", ",".join(map(str, args.max_tokens))] + (["--tiny"] if args.tiny else []) \
                + (["--compile"] if args.compile else [])
            procs.append(subprocess.Popen(argv, env=env))
        for p in procs:
            if p.wait(400) != 0:
                raise RuntimeError(f"train rank exited {p.returncode}")
    one = torch.load(Path(args.workdir) / "change-world1.pt")
    two = torch.load(Path(args.workdir) / "change-world2.pt")
    a = torch.cat([one[n].flatten().double() for n in sorted(one)])
    b = torch.cat([two[n].flatten().double() for n in sorted(one)])
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    rel = float((a - b).norm() / a.norm())
    worst = max(((float((one[n] - two[n]).abs().max()), n) for n in one))
    hb.log(f"weight change after 2 steps, 2 ranks vs 1: cosine {cos:.5f}, relative L2 {rel:.3e}, "
           f"max |diff| {worst[0]:.3e} ({worst[1]}); |change| max {float(a.abs().max()):.3e}")
    hb.emit(args, "x2_train_equivalence", cosine=cos, relative_l2=rel, max_abs_diff=worst[0], max_abs_diff_param=worst[1],
            change_max_abs=float(a.abs().max()), change_norm=float(a.norm()))


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["link", "link-rank", "sync", "train", "train-rank"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--workdir", default="/tmp/grpo-bench")
    p.add_argument("--results", default="/tmp/grpo-bench/results.jsonl")
    p.add_argument("--log-dir", default="/tmp/grpo-bench")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[24576])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--isolated", action="store_true")
    args = p.parse_args(argv)
    {"link": cmd_link, "link-rank": cmd_link_rank, "sync": cmd_sync, "train": cmd_train,
     "train-rank": cmd_train_rank}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
