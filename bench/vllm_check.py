"""Issue 19: the production engine for real, through our own server. On the GPU it runs
`grpo rollout` with engine vllm (bench/h200_run.sh phase `vllm-check`, after `build`); with
`--tiny --engine hf` the same checks run on a CPU in seconds (the local check of this script).

1. Generate 32 prompts x n=8 x 512 tokens through the server's gRPC API, behaviour logprobs
   included; engine seconds and wall seconds (reward scoring and the parquet shard included).
2. Those logprobs against the trainer's recomputation (grpo_trainer: FSDP2 policy, bf16 compute,
   actor.compute_logprobs) on the same tokens: mean and max |delta| per response token.
3. UpdateWeights: gRPC (GrpcWeightSender) to new weights B, then CUDA IPC (IpcWeightSender, the
   co-located path) back to A. After each, greedy outputs are teacher-forced through a Hugging
   Face model holding A or B: the share of positions where the server's token is HF's argmax
   says which weights the server really holds (random weights have near-ties, so not 100 %).
4. Throughput 256 x 512 with CUDA graphs (the server above) and eager (a second server).

Prints one RESULT line per check (JSON), as h200_bench does.
"""

from __future__ import annotations

import io
import secrets
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import bench_parser  # noqa: E402
import h200_bench as hb  # noqa: E402


def write_job(args, name: str, **overrides) -> str:
    import yaml
    job = hb.load_bench_job(args, **overrides)
    path = Path(args.workdir) / name
    path.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False))
    return str(path)


class Client:
    """Prompt shards in, samples out, through the real server's Generate."""

    def __init__(self, job_path: str, address: str, token: str):
        from grpo_api.jobfile import load_job
        from grpo_api.records import RunLayout
        from grpo_api.storage import Storage, job_root
        from grpo_trainer.rollout_client import RolloutDispatcher
        from grpo_trainer.rollout_servers import RolloutServers

        class NoWeights:   # this check sets each version itself
            def ensure_version(self, worker, version):
                pass
        self.job = load_job(job_path, [])
        self.storage = Storage(self.job.spec.storage)
        self.dispatcher = RolloutDispatcher(
            RolloutServers(lambda: [address], token), weights=NoWeights(),
            layout=RunLayout(job_root(self.job, local=True)), storage=self.storage, timeout=600)
        self.address, self.calls = address, 0

    def generate(self, rows, *, n: int, max_tokens: int, temperature: float, version: int):
        import pyarrow.parquet as pq

        from grpo_api.proto import rollout_pb2 as pb
        from grpo_trainer import batch as batching
        from grpo_trainer.data import prompt_shard_table
        self.calls += 1
        sink = io.BytesIO()
        pq.write_table(prompt_shard_table(rows, 0), sink)
        sampling = pb.SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=-1)
        t = time.perf_counter()
        [result] = self.dispatcher.generate(self.calls, "check", {"shard-000": sink.getvalue()}, sampling, version)
        wall = time.perf_counter() - t
        samples = batching.samples_from_table(self.storage.read_table(result.reply.rollout_uri))
        return samples, result.reply, wall


def prompt_rows(args, count: int):
    from grpo_api.storage import Storage
    from grpo_trainer.data import load_prompts
    from grpo_trainer.model import load_tokenizer
    job = hb.load_bench_job(args)
    tok = load_tokenizer(job.spec.model)
    return load_prompts(job.spec.data.train_files, job.spec.data, tok, Storage(job.spec.storage)).rows[:count]


def logprob_parity(args, policy, samples, temperature: float) -> dict:
    import torch

    from grpo_trainer import actor, batch as batching
    adv = [torch.zeros(len(s.response_ids)) for s in samples]
    groups = batching.micro_batches(list(range(len(samples))), samples, max_count=len(samples),
                                    max_tokens=16384 if not args.tiny else 256)
    deltas = []
    for g in groups:
        mb = batching.collate(g, samples, adv, 0, hb.device())
        [logp] = actor.compute_logprobs(policy, [mb], temperature)
        for row, i in enumerate(g):
            s = samples[i]
            p, r = len(s.prompt_ids), len(s.response_ids)
            ours = logp[row, p - 1:p - 1 + r].double().cpu()
            deltas.append(ours - torch.tensor(s.behaviour_logprobs, dtype=torch.float64))
    d = torch.cat(deltas)
    return {"tokens": d.numel(), "mean_abs": float(d.abs().mean()), "max_abs": float(d.abs().max()),
            "mean": float(d.mean()), "p99_abs": float(d.abs().quantile(0.99)) if d.numel() < 16_000_000 else None,
            "ratio_mean": float(d.exp().mean()), "ratio_max": float(d.exp().max()), "ratio_min": float(d.exp().min())}


def argmax_agreement(hf_model, samples) -> float:
    """Share of response positions where the sampled (greedy) token is hf_model's argmax."""
    import torch
    hits = total = 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=hf_model.device)
            logits = hf_model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
            hits += int((logits.argmax(-1).cpu() == torch.tensor(s.response_ids)).sum())
            total += len(s.response_ids)
    return hits / total


def perturbed(weights: dict, seed: int) -> dict:
    """Weights B: A plus noise the size of the init (so greedy outputs change)."""
    import torch
    out = {}
    for name, t in weights.items():
        g = torch.Generator(device=t.device).manual_seed(seed)
        if t.dim() > 1:
            out[name] = t + 0.02 * torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)
        else:
            out[name] = t.clone()
    return out


def ipc_layout(weights: dict, device):
    """The trainer's layout (grpo_trainer.publisher): one buffer, one bucket."""
    import torch

    from grpo_api.weights import TensorSpec, plan_buckets
    specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()]
    layout = plan_buckets(specs, 1 << 62)[0]
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    for placed in layout.tensors:
        flat = weights[placed.spec.name].contiguous().view(-1).view(torch.uint8)
        buffer[placed.offset:placed.offset + placed.nbytes].copy_(flat)
    return buffer, layout


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--skip-eager", action="store_true", help="no second (eager) server")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from grpo_trainer.lora import wrapper
    from grpo_trainer.model import build_policy
    from grpo_api.rpc import RolloutClients
    from grpo_trainer.weight_sync import GrpcWeightSender, IpcWeightSender
    dev = hb.device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    w = hb.workload(args)
    token = secrets.token_hex(16)
    base = {"spec.rollout.engine": args.engine, "spec.rollout.gpuMemoryUtilization": args.gpu_memory_utilization}
    job_path = write_job(args, f"job-{args.engine}.yaml", **base)
    log_path = Path(args.log_dir) / f"vllm-check-{args.engine}-server.log"
    t = time.perf_counter()
    proc, address = hb.start_rollout_server(args, job_path, token, log_path)
    hb.log(f"{args.engine} server (graphs) ready in {time.perf_counter() - t:.1f}s at {address}")
    try:
        client = Client(job_path, address, token)
        rows = prompt_rows(args, w["prompts"])
        # 1. the workload, twice (the first warms up)
        gen = []
        for rep in range(2):
            samples, reply, wall = client.generate(rows, n=w["n"], max_tokens=w["response_len"], temperature=1.0,
                                                   version=0)
            lengths = [len(s.response_ids) for s in samples]
            assert len(samples) == w["prompts"] * w["n"], len(samples)
            assert all(len(s.behaviour_logprobs) == len(s.response_ids) for s in samples)
            gen.append({"engine_s": reply.generate_seconds, "wall_s": wall, "tokens": reply.generated_tokens,
                        "mean_len": statistics.fmean(lengths), "min_len": min(lengths)})
            hb.log(f"generate {len(samples)} x <= {w['response_len']}: engine {reply.generate_seconds:.2f}s, "
                   f"wall {wall:.2f}s, {reply.generated_tokens} tokens, mean length {statistics.fmean(lengths):.0f}")
        hb.emit(args, "vllm_generate", engine=args.engine, cuda_graphs=True, runs=gen,
                tokens_per_s=gen[-1]["tokens"] / gen[-1]["engine_s"])
        # 2. logprob parity with the trainer
        hb.init_dist(dev)
        job = client.job
        policy = build_policy(job.spec.model, dev, compile=False, wrap=wrapper(job.spec.model))
        parity = logprob_parity(args, policy, samples, 1.0)
        hb.log(f"logprob |delta| mean {parity['mean_abs']:.2e} max {parity['max_abs']:.2e} "
               f"(ratio {parity['ratio_min']:.3f}..{parity['ratio_max']:.3f})")
        hb.emit(args, "vllm_logprob_parity", engine=args.engine, **parity)
        del policy
        # 3. weight updates
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(job.spec.model.path, dtype=dtype).to(dev).eval()
        weights_a = {n: t.detach().clone() for n, t in hf.state_dict().items()}
        tied = {n for n in weights_a if n == "lm_head.weight" and hf.config.tie_word_embeddings}
        weights_a = {n: t for n, t in weights_a.items() if n not in tied}
        weights_b = perturbed(weights_a, seed=1)
        greedy_rows = rows[:8]

        def greedy(version):
            s, _, _ = client.generate(greedy_rows, n=1, max_tokens=32, temperature=0.0, version=version)
            return s

        def agreement(samples_):
            out = {}
            for label, wts in (("A", weights_a), ("B", weights_b)):
                hf.load_state_dict(wts, strict=False)
                hf.tie_weights()
                out[label] = argmax_agreement(hf, samples_)
            return out
        before = agreement(greedy(0))
        sender = GrpcWeightSender(RolloutClients(token), bucket_bytes=512 << 20)
        t = time.perf_counter()
        report = sender.send([address], list(weights_b.items()), 1)
        grpc_s = time.perf_counter() - t
        after_b = agreement(greedy(1))
        hb.log(f"gRPC update A->B: {grpc_s:.2f}s {report.nbytes / 1e9:.2f} GB ({report.nbytes / 1e9 / grpc_s:.2f} GB/s); "
               f"argmax agreement before {before}, after {after_b}")
        result = {"grpc_s": grpc_s, "gbytes": report.nbytes / 1e9, "grpc_gbps": report.nbytes / 1e9 / grpc_s,
                  "agreement_before": before, "agreement_after_grpc_b": after_b}
        if dev.type == "cuda":
            buffer, layout = ipc_layout(weights_a, dev)
            torch.cuda.synchronize()
            ipc = IpcWeightSender(RolloutClients(token))
            times = []
            for version in (2, 3):   # the first maps the buffer, the second reuses the mapping
                t = time.perf_counter()
                ipc.send([address], buffer, layout, version)
                times.append(time.perf_counter() - t)
            after_a = agreement(greedy(3))
            hb.log(f"CUDA IPC update B->A: {times} s for {layout.nbytes / 1e9:.2f} GB; agreement after {after_a}")
            result.update(ipc_s=times, agreement_after_ipc_a=after_a)
        hb.emit(args, "vllm_weight_update", engine=args.engine, **result)
    finally:
        hb.stop_server(proc)
        hb.dump_server_log(log_path)
    # 4. eager, for the throughput comparison
    if args.engine == "vllm" and not args.skip_eager:
        eager_path = write_job(args, "job-vllm-eager.yaml", **base, **{"spec.rollout.enforceEager": True})
        t = time.perf_counter()
        proc, address = hb.start_rollout_server(args, eager_path, token, log_path)
        hb.log(f"vllm server (eager) ready in {time.perf_counter() - t:.1f}s")
        try:
            client = Client(eager_path, address, token)
            runs = []
            for rep in range(2):
                samples, reply, wall = client.generate(rows, n=w["n"], max_tokens=w["response_len"], temperature=1.0,
                                                       version=0)
                runs.append({"engine_s": reply.generate_seconds, "wall_s": wall, "tokens": reply.generated_tokens})
                hb.log(f"eager generate: engine {reply.generate_seconds:.2f}s wall {wall:.2f}s")
            hb.emit(args, "vllm_generate", engine=args.engine, cuda_graphs=False, runs=runs,
                    tokens_per_s=runs[-1]["tokens"] / runs[-1]["engine_s"])
        finally:
            hb.stop_server(proc)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
