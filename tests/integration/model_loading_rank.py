"""One torchrun rank of tests/integration/test_model_loading.py: build the policy and the
reference as the trainer does, and report (JSON in <out dir>/rank-N.json) the peak host memory
that loading added, what the loaded models compute, and the peak host memory that gathering the
weights for the rollout servers adds (grpo_trainer.publisher, twice: the first fills the cache)."""

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - imported before the baseline: not the model's memory

from grpo_api.jobfile import load_job
from grpo_api.spec import WeightSyncSpec
from grpo_trainer.model import build_policy, build_reference
from grpo_trainer.publisher import WeightPublisher, rollout_tensors


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def peak_since_reset(action) -> int:
    """Bytes the process's peak resident memory rose above its current size while `action` ran
    (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    def status(key: str) -> int:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key))
        return int(line.split()[1]) * 1024
    Path("/proc/self/clear_refs").write_text("5")
    start = status("VmRSS:")
    action()
    return status("VmHWM:") - start


def main() -> None:
    job = load_job(sys.argv[1], [])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dev = torch.device("cpu")
    before = peak_rss_bytes()
    policy = build_policy(job.spec.model, dev)
    after_policy = peak_rss_bytes()
    ref = build_reference(job.spec.model, dev, cpu_offload=False)
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        logits = policy(input_ids=ids).logits
        ref_logits = ref(input_ids=ids).logits
    tied = policy.lm_head.weight is policy.model.embed_tokens.weight
    publisher = WeightPublisher(policy, WeightSyncSpec(backend="grpc"), dtype=torch.float32, device=dev, servers=None)
    largest = max(t.numel() * 4 for _, t in rollout_tensors(policy))
    gathers = [peak_since_reset(publisher.gather) for _ in range(2)]
    Path(sys.argv[2], f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "policy_load_bytes": after_policy - before, "tied": tied,
                      "logits": logits.flatten()[:64].tolist(), "ref_logits": ref_logits.flatten()[:64].tolist(),
                      "dtypes": sorted({str(p.dtype) for p in policy.parameters()}),
                      "gather_peak_bytes": gathers, "weights_bytes": publisher.layout.nbytes, "largest_tensor_bytes": largest}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
