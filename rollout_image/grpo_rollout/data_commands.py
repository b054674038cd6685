"""`grpo data`: dataset preparation in verl's parquet layout.

  grpo data quickstart --out DIR    the embedded default's task (train.parquet, test.parquet)
"""

from __future__ import annotations

import argparse


def data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo data", description="Prepare datasets in verl's parquet layout.")
    sub = parser.add_subparsers(dest="dataset", required=True)
    quick = sub.add_parser("quickstart", help="the quickstart's task: train.parquet and test.parquet")
    quick.add_argument("--out", required=True, help="output folder")
    quick.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dataset == "quickstart":
        from grpo_rollout.quickstart_data import write_quickstart_dataset
        write_quickstart_dataset(args.out, seed=args.seed)
        print(f"Wrote {args.out}/train.parquet and {args.out}/test.parquet")
    return 0
