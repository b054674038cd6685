"""`grpo ui RUN` (issue 35): a read-only web page over a run's curves and rollouts, on localhost
(on Kubernetes, the chart's optional viewer Deployment, reached with `kubectl port-forward`).
The pages are app.py's, what they read run_view.py's.

Exit codes: 0 stopped (Ctrl-C); 2 bad input (RUN, the options, no tokenizer), one `error: ...` line."""

from __future__ import annotations

import argparse
import sys

BAD_INPUT = 2


def ui(argv: list[str]) -> int:
    """Serve the run's web page (`grpo ui`)."""
    parser = argparse.ArgumentParser(
        prog="grpo ui", description="A read-only web page over a run: its curves (reward, validation, KL, entropy, "
                                    "response length, step time), each step's prompts and groups of responses "
                                    "(tokens shaded by behaviour log-prob), filters, one prompt across steps. S3 "
                                    "credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.")
    parser.add_argument("run", metavar="RUN", help="the run's URI (status.runUri: s3://..., file://...) or folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8265, help="port to listen on (default 8265)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer folder or hub id; default: the run's model (its job.yaml, else its latest "
                             "checkpoint's model)")
    parser.add_argument("--endpoint", default=None, help="S3-compatible endpoint URL (spec.storage.endpoint)")
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


def _app(args: argparse.Namespace):
    from grpo_api.rollout_history import RolloutHistory
    from grpo_api.spec import StorageSpec
    from grpo_api.storage import Storage
    from grpo_trainer.rollouts_export import run_tokenizer
    from grpo_trainer.ui.app import build_app
    from grpo_trainer.ui.run_view import RunView, run_job

    storage = Storage(StorageSpec(endpoint=args.endpoint) if args.endpoint else None)
    history = RolloutHistory(args.run, storage)
    return build_app(RunView(history, run_tokenizer(history, storage, args.tokenizer), run_job(history)))
