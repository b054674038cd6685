"""`grpo run` (local launcher), `grpo report`, `grpo operator`. No torch here; kopf and the
Kubernetes client are imported only when `grpo operator` runs."""

from __future__ import annotations

import argparse
import sys

from grpo_api.contracts import BAD_INPUT_EXIT_CODE


def validate(argv: list[str]) -> int:
    """Check GRPOJob files and list every error with its field path (the operator's checks too)."""
    from grpo_api.commands import validate as validate_spec
    return validate_spec(argv, extra_checks=_operator_errors)


def _operator_errors(job) -> list[str]:
    """What the operator would refuse in a job the spec accepts: the pod templates (a reserved
    env var, a mountPath or volume of the operator's, ...), checked by building the job's pods
    with the default settings, as the operator does before it creates anything. spec.trainer is
    immutable, so finding these after `kubectl apply` means deleting and re-creating the job."""
    from grpo_api.spec import ObjectMeta
    from grpo_operator import manifests
    from grpo_operator.settings import OperatorSettings
    from grpo_operator.templates import TemplateError
    named = job.model_copy(update={"metadata": ObjectMeta(name=job.metadata.name, namespace=job.metadata.namespace,
                                                           uid=job.metadata.uid or "grpo-validate")})
    settings = OperatorSettings()
    errors: list[str] = []
    dependencies = lambda j, s: manifests.build_rollout_dependencies(j, s, rollout_replicas=1)  # noqa: E731
    for build in (manifests.build_trainer_job, manifests.build_rollout_deployment, dependencies):
        try:
            build(named, settings)
        except TemplateError as exc:
            errors.extend(e for e in exc.errors if e not in errors)
    return errors


def run(argv: list[str]) -> int:
    """Run a GRPOJob on this machine: rollout servers and a torchrun trainer."""
    parser = argparse.ArgumentParser(
        prog="grpo run", description="Run a GRPOJob on this machine: rollout servers + a torchrun trainer.")
    parser.add_argument("job", help="GRPOJob YAML, e.g. examples/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set trainer.totalSteps=5")
    parser.add_argument("--metrics", action="store_true",
                        help="serve Prometheus metrics of the trainer and each rollout server on free ports "
                             "(logged, and written to <run>/metrics-targets.json for file_sd)")
    args = parser.parse_args(argv)
    from grpo_api.jobfile import JobError
    from grpo_api.signing import CheckpointKeyError
    from grpo_operator.local import LaunchError, run_job
    try:
        return run_job(args.job, args.overrides, metrics=args.metrics)
    except (JobError, ValueError, OSError, CheckpointKeyError) as exc:   # a bad job, a missing file, an unwritable folder
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _settings_parser(settings_mod) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo operator",
        description="The GRPOJob operator (kopf): reconciles GRPOJobs into trainer Jobs and rollout "
                    "Deployments. Credentials: in-cluster ServiceAccount, else KUBECONFIG. Every option "
                    "can also be set by its environment variable (the Helm chart does). "
                    "`grpo operator check-uninstall` (the chart's pre-delete hook) exits 1 while a GRPOJob "
                    "it serves is unfinished.")
    settings_mod.add_arguments(parser)
    return parser


def report(argv: list[str]) -> int:
    """Plot a run's metrics (PNG) and summarise it."""
    parser = argparse.ArgumentParser(prog="grpo report", description="Plot a run's metrics (PNG) and summarise it.")
    parser.add_argument("run_dir", help="run directory, e.g. outputs/<project>/<experiment>")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    from pathlib import Path
    from grpo_operator.report import write_report
    try:
        written = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    print((written[-1]).read_text(), end="")
    print(f"Wrote {len(written)} files to {written[-1].parent}")
    return 0


def operator(argv: list[str]) -> int:
    """Run the Kubernetes operator that turns GRPOJobs into trainer and rollout pods."""
    from grpo_operator import settings as settings_mod
    if argv[:1] == ["check-uninstall"]:     # the chart's pre-delete hook (grpo_operator.uninstall_check)
        from grpo_operator.uninstall_check import check_uninstall
        try:
            settings = settings_mod.from_arguments(_settings_parser(settings_mod).parse_args(argv[1:]))
        except ValueError as exc:
            print(f"grpo operator check-uninstall: {exc}", file=sys.stderr)
            return BAD_INPUT_EXIT_CODE
        return check_uninstall(settings.namespaces)
    parser = _settings_parser(settings_mod)
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    try:
        settings = settings_mod.from_arguments(args)
    except ValueError as exc:
        print(f"grpo operator: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE

    import asyncio

    import kopf

    from grpo_operator import serving
    from grpo_operator.handlers import register
    from grpo_operator.kube import Kube
    from grpo_operator.metrics import OperatorMetrics
    from grpo_operator.reconciler import Reconciler

    import logging
    kopf.configure(verbose=args.verbose)
    if not args.verbose:  # kopf logs every handler call at INFO: one line per pod status change
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = OperatorMetrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    kube = Kube(field_manager=settings.field_manager, on_response=metrics.api_request)
    reconciler = Reconciler(kube, settings, metrics)
    # kopf serves the resources that exist when it starts: it runs while the GRPOJob CRD does,
    # and starts again when the CRD comes back (serving.py).
    while True:
        serving.wait_until_served(kube, settings.liveness_endpoint, settings.resync_seconds)
        # An asyncio.Event (bound to kopf's loop on first use): kopf waits for a threading.Event
        # in an executor thread, which would keep the process from exiting after SIGTERM.
        crd_gone = asyncio.Event()
        registry = kopf.OperatorRegistry()
        register(registry, reconciler, settings, stop=crd_gone)
        try:
            # standalone: one replica (the chart's Deployment uses the Recreate strategy), so no
            # peering objects and no RBAC for them.
            kopf.run(registry=registry, standalone=True, clusterwide=not settings.namespaces,
                     namespaces=list(settings.namespaces), liveness_endpoint=settings.liveness_endpoint or None,
                     stop_flag=crd_gone)
        except Exception:
            if serving.crd_served(kube):
                raise
            logging.getLogger("grpo.operator").warning("%s; waiting for it", serving.NOT_SERVING)
            continue
        if not crd_gone.is_set():
            return 0  # SIGTERM or SIGINT
