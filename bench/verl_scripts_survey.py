"""verl's own FSDP GPU training scripts through `grpo from-verl` + `grpo validate` (issue 43).

    python bench/verl_scripts_survey.py VERL_CHECKOUT VERL_RECIPE_CHECKOUT [--show faithful|refused|all]

Every `*.sh` under VERL/examples/*/ and VERL_RECIPE/*/ that launches a trainer (main_ppo-like: not
SFT, generation or evaluation) and is not Megatron, VeOmni, TorchTitan, NPU/Ascend-only or a
non-vLLM/SGLang rollout is translated as a user would (`grpo from-verl SCRIPT -o job.yaml`, no
environment), then validated (the same steps, in one process). Each is:

- faithful: exit 0, the job validates, and every verl key that maps one-to-one onto a GRPOJob
  field (a `Map` rule without a converter) holds there the value bash passed;
- refused, by the cause the first error names: a policy loss or advantage estimator, an entry
  module (a recipe's own trainer), a feature flag, vision-language, SGLang, other;
- silently wrong: exit 0 but a value differs from what bash passed (must be none).

The counts go to docs/MIGRATING_FROM_VERL.md ("verl's own scripts").
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

from grpo_api.from_verl import RULES, render, translate
from grpo_api.jobfile import JobError, load_job
from grpo_api.verl_command import VerlInputError, read_input

_TRAINER = re.compile(r"-m\s+(verl|recipe)\.[\w.]*(main|trainer)\w*|main_\w+\.py")
_NOT_RL = re.compile(r"sft_trainer|main_generation|main_eval|model_merger")
_OTHER_STACK = re.compile(r"megatron|veomni|torchtitan|trainer\.device=npu|rollout\.name=(hf|trtllm)\b", re.I)


def candidates(verl: Path, recipe: Path) -> list[Path]:
    files = sorted([*((verl, f) for f in verl.glob("examples/*/**/*.sh")), *((recipe, f) for f in recipe.glob("*/**/*.sh"))])
    out = []
    for root, f in files:
        text = f.read_text(errors="replace")
        name = str(f.relative_to(root)).lower()
        if (_TRAINER.search(text) and not _NOT_RL.search(text) and not _OTHER_STACK.search(text)
                and not re.search(r"npu|ascend|sft", name)):
            out.append(f)
    return out


def cause(errors: list[str]) -> str:
    text = errors[0]
    for label, pattern in [("vision-language", r"vision-language|multimodal inputs"), ("entry module", r"runs a trainer of its own"),
                           ("SGLang rollout", r"SGLang"),
                           ("loss/estimator", r"^(algorithm\.adv_estimator|actor_rollout_ref\.actor\.policy_loss)|"
                                              r"with policyLoss"),
                           ("feature flag", r"turns on|is not supported|are not supported|not applied")]:
        if re.search(pattern, text):
            return label
    return "other"


def _direct_mismatches(cfg, job) -> list[str]:
    """Keys mapped one-to-one whose value in the job is not what bash passed (critic.* of a job
    without a critic excepted: verl ignores them without adv_estimator gae, and so does the job)."""
    spec = job.spec.model_dump(by_alias=True)
    out = []
    for rule in RULES:
        if rule.kind != "map" or rule.convert or rule.field.startswith("metadata") or rule.verl not in cfg.flat:
            continue
        if rule.field.startswith("critic.") and job.spec.algorithm.adv_estimator.value != "gae":
            continue
        node = spec
        for part in rule.field.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        value = cfg.flat[rule.verl]
        if node != value and not (isinstance(value, (int, float)) and node == float(value)):
            out.append(f"{rule.verl}={value!r} but {rule.field}={node!r}")
    return out


def survey(scripts: list[Path]) -> dict[str, list[tuple[Path, str]]]:
    """What `grpo from-verl SCRIPT -o job.yaml && grpo validate job.yaml` does, step by step."""
    results: dict[str, list[tuple[Path, str]]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            try:
                cfg, source = read_input(str(script))
            except VerlInputError as exc:
                results["refused: input"].append((script, str(exc)))
                continue
            result = translate(cfg)
            if result.errors:
                results[f"refused: {cause(result.errors)}"].append((script, result.errors[0]))
                continue
            out_file = Path(tmp) / "job.yaml"
            out_file.write_text(render(result, source))
            try:
                job = load_job(out_file)
            except JobError as exc:
                results["silently wrong"].append((script, f"grpo validate: {exc}"))
                continue
            wrong = _direct_mismatches(cfg, job)
            if wrong:
                results["silently wrong"].append((script, "; ".join(wrong)))
            else:
                label = "faithful" + ("" if result.warnings else " (no warning)")
                results[label].append((script, " | ".join(result.warnings)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--show", choices=["faithful", "refused", "all", "none"], default="none")
    args = parser.parse_args()
    scripts = candidates(args.verl, args.recipe)
    results = survey(scripts)
    print(f"{len(scripts)} scripts")
    for label in sorted(results):
        print(f"{len(results[label]):4d}  {label}")
    for label in sorted(results):
        if args.show == "all" or label.startswith(args.show) or label == "silently wrong":
            for script, why in results[label]:
                print(f"[{label}] {script}: {why}")
    return 1 if results.get("silently wrong") else 0


if __name__ == "__main__":
    sys.exit(main())
