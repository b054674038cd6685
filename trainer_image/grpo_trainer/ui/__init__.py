"""`grpo ui RUN` (issue 35): a read-only web page over a run's curves and rollouts, on localhost
(on Kubernetes, the chart's optional viewer Deployment, reached with `kubectl port-forward`).
The pages are app.py's, what they read run_view.py's.

Exit codes: 0 stopped (Ctrl-C); 2 bad input (RUN, the options, an unreadable --tokenizer), one
`error: ...` line. Without --tokenizer, a run whose model isn't known yet (before its first
checkpoint) or can't be loaded here (a folder on the job's volume) is shown as token ids, with a
warning, rather than refused: the chart's viewer must start from its values alone."""

from __future__ import annotations

import argparse
import sys

from grpo_api.contracts import BAD_INPUT_EXIT_CODE as BAD_INPUT


def ui(argv: list[str]) -> int:
    """Serve the run's web page (`grpo ui`)."""
    from grpo_api.run_argument import add_run_arguments
    parser = argparse.ArgumentParser(
        prog="grpo ui", description="A read-only web page over a run: its curves (reward, validation, KL, entropy, "
                                    "response length, step time), each step's prompts (a VL prompt with its images) "
                                    "and groups of responses (tokens shaded by behaviour log-prob), filters, one "
                                    "prompt across steps. S3 credentials come from "
                                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.")
    add_run_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8265, help="port to listen on (default 8265)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer folder or hub id; default: the run's model (its job.yaml, else its latest "
                             "checkpoint's model; token ids while it can't be loaded)")
    parser.add_argument("--no-text", action="store_true", help="show token ids, no decoding (no tokenizer needed)")
    parser.add_argument("--wait", action="store_true",
                        help="wait for RUN to appear instead of failing (a viewer started with its job)")
    args = parser.parse_args(argv)
    try:
        app = _app(args)
    except (ValueError, OSError) as exc:      # RunNotFound, StorageError, an unreadable tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    import uvicorn
    print(f"Serving {args.run} on http://{args.host}:{args.port}/ (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


WAIT_SECONDS = 30.0
"""--wait: how often a run that isn't there yet is looked for."""


def _app(args: argparse.Namespace):
    from grpo_api.run_argument import open_run
    from grpo_trainer.rollouts_export import run_tokenizer
    from grpo_trainer.ui.app import build_app
    from grpo_trainer.ui.run_view import RunView, run_job
    from grpo_trainer.ui.text import IdsText, RunText

    uri, storage = open_run(args)
    history = _history(uri, storage, args.wait)
    if args.no_text:
        text = IdsText()
    elif args.tokenizer:
        text = run_tokenizer(history, storage, args.tokenizer)
    else:
        text = RunText(lambda: run_tokenizer(history, storage, None), log=lambda line: print(line, file=sys.stderr))
        text.batch_decode([])        # load it now (or say why not), not on the first page
    return build_app(RunView(history, text, run_job(history)))


def _history(uri: str, storage, wait: bool, sleep=None):
    """The run; with --wait, looked for every WAIT_SECONDS until it is there (a job that hasn't
    started writes nothing yet)."""
    import time

    from grpo_api.run_argument import RunNotFound
    from grpo_trainer.rollout_history import RolloutHistory
    while True:
        try:
            return RolloutHistory(uri, storage)
        except RunNotFound as exc:
            if not wait:
                raise
            print(f"waiting for the run: {exc}; looking again in {WAIT_SECONDS:.0f} s", file=sys.stderr, flush=True)
            (sleep or time.sleep)(WAIT_SECONDS)
