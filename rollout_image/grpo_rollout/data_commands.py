"""`grpo data`: dataset preparation in verl's parquet layout.

  grpo data quickstart --out DIR                  the embedded default's task (train.parquet, test.parquet)
  grpo data colours --out DIR                     the tiny VL model's image task (tiny_vl.py), verl's `images` layout
  grpo data lookup --out DIR                      the multi-turn lookup task (tool_task.py), for builtin://tiny-qwen3-tools
  grpo data gsm8k --input RAW --output DIR        raw GSM8K -> DIR/train.parquet, DIR/test.parquet,
                                                  as verl's examples/data_preprocess/gsm8k.py writes them
"""

from __future__ import annotations

import argparse
import sys


def data(argv: list[str]) -> int:
    """Prepare datasets in verl's parquet layout (GSM8K, the quickstart's task)."""
    parser = argparse.ArgumentParser(prog="grpo data", description="Prepare datasets in verl's parquet layout.")
    sub = parser.add_subparsers(dest="dataset", required=True)
    quick = sub.add_parser("quickstart", help="the quickstart's task: train.parquet and test.parquet")
    quick.add_argument("--out", required=True, help="output folder")
    quick.add_argument("--seed", type=int, default=0)
    lookup = sub.add_parser("lookup", help="the multi-turn lookup task (its `lookup` tool knows the digit)")
    lookup.add_argument("--out", required=True, help="output folder")
    lookup.add_argument("--seed", type=int, default=0)
    colours = sub.add_parser("colours", help="an image task: name the colour of a PNG (for --arch qwen2.5-vl, qwen3-vl)")
    colours.add_argument("--out", required=True, help="output folder")
    colours.add_argument("--seed", type=int, default=0)
    gsm8k = sub.add_parser(
        "gsm8k", help="raw GSM8K (question, answer) into verl's layout, as verl's gsm8k.py preprocessing",
        description="Convert raw GSM8K parquet (the Hugging Face openai/gsm8k files: question, answer) into "
                    "verl's layout: DIR/train.parquet and/or DIR/test.parquet.")
    gsm8k.add_argument("--input", action="append", required=True, metavar="RAW",
                       help="a raw parquet file (split from its name, or --split), SPLIT=FILE, or a folder with "
                            "the hub's train-*.parquet and test-*.parquet; repeat for several")
    gsm8k.add_argument("--output", required=True, metavar="DIR", help="output folder")
    gsm8k.add_argument("--split", choices=("train", "test"), help="the split of a single input file")
    args = parser.parse_args(argv)
    if args.dataset == "quickstart":
        from grpo_rollout.quickstart_data import write_quickstart_dataset
        write_quickstart_dataset(args.out, seed=args.seed)
        print(f"Wrote {args.out}/train.parquet and {args.out}/test.parquet")
    elif args.dataset == "colours":
        from grpo_rollout.tiny_vl import write_colour_dataset
        write_colour_dataset(args.out, seed=args.seed)
        print(f"Wrote {args.out}/train.parquet and {args.out}/test.parquet")
    elif args.dataset == "lookup":
        from grpo_rollout.tool_task import write_dataset
        write_dataset(args.out, seed=args.seed)
        print(f"Wrote {args.out}/train.parquet and {args.out}/test.parquet")
    elif args.dataset == "gsm8k":
        from grpo_rollout.gsm8k_data import GSM8KDataError, write_gsm8k
        try:
            written = write_gsm8k(args.input, args.output, split=args.split)
        except GSM8KDataError as exc:
            print(f"grpo data gsm8k: {exc}", file=sys.stderr)
            return 1
        for name, (path, rows) in written.items():
            print(f"Wrote {path} ({rows} {name} rows)")
    return 0
