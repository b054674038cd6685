"""What the bench scripts share: the arguments bench/h200_run.sh passes every phase (--workdir,
--results, --log-dir, --tiny) and the results format, one JSON object per line, printed after
"RESULT " and appended to --results (bench/RESULTS.md quotes them; tests/integration reads them)."""

from __future__ import annotations

import argparse
import json
import time


def bench_parser(description: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with h200_run.sh's four arguments; a script adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/grpo-bench", help="models, datasets and runs are built here")
    p.add_argument("--results", default=None, help="append each result here (JSON lines)")
    p.add_argument("--log-dir", default="/tmp/grpo-bench", help="server logs go here")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU check of the script in seconds")
    return p


def emit(args, bench: str, **data) -> dict:
    """One result: {"bench", "tiny", "time", **data}, printed and appended to args.results."""
    row = {"bench": bench, "tiny": bool(args.tiny), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **data}
    line = json.dumps(row, default=float)
    print("RESULT " + line, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(line + "\n")
    return row
