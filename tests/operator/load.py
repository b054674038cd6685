"""N GRPOJobs created at once against a real control plane, with `grpo operator` running under the
chart's RBAC (issue 22's load check; the figures are in docs/RELIABILITY.md).

    python tests/operator/load.py --jobs 200

Measures, for every job, the time from its create call to its children being present (the
trainer Job, which the operator creates last, after the ConfigMap, Services, NetworkPolicies and
rollout Deployment), the operator's memory (RSS) before, right after and a while after the
burst, its API calls (grpo_operator_api_requests_total) and its errors (reconcile errors, ERROR
lines). Jobs are 1 trainer node and 1 rollout replica; no kubelet runs, so pods stay Pending.

    python tests/operator/load.py --jobs 200 --floor

The same burst without the operator: each client creates its job and then, itself, the writes
the operator makes for it (the Secret, the children, the rollout Deployment, the trainer Job
last, a status patch), one after the other with no reads in between. What the API server and
etcd of this machine take for them is the floor under any operator's latency here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from controlplane.cluster import ControlPlane, retry  # noqa: E402
from operator_helpers import GROUP, PLURAL, VERSION, body, kubectl  # noqa: E402
from operator_process import OPERATOR_NS, REPO, SERVICE_ACCOUNT, OperatorProcess, render_rbac  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric_sum(text: str, name: str, where: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and where in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=20, help="parallel create calls")
    parser.add_argument("--settle", type=float, default=60, help="seconds to watch memory after the burst")
    parser.add_argument("--floor", action="store_true", help="no operator: the clients make the children themselves")
    args = parser.parse_args()
    from kubernetes import client, config, watch

    kubectl_bin = str(Path(sys.executable).parent / "kubectl")
    work = Path(tempfile.mkdtemp(prefix="grpo-load-"))
    with ControlPlane() as cp:
        kubectl(kubectl_bin, cp, "apply", "--server-side", "-f", str(REPO / "crds" / "grpojob.yaml"))
        retry(lambda: kubectl(kubectl_bin, cp, "wait", "--for=condition=Established", "--timeout=60s",
                              "crd/grpojobs.grpo.dev"))
        kubectl(kubectl_bin, cp, "create", "namespace", OPERATOR_NS)
        kubectl(kubectl_bin, cp, "apply", "-f", "-", stdin=render_rbac())
        ns = "load"
        kubectl(kubectl_bin, cp, "create", "namespace", ns)
        retry(lambda: kubectl(kubectl_bin, cp, "-n", ns, "get", "serviceaccount", "default"))
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        if args.floor:
            return floor(args, api, ns)
        op = OperatorProcess(cp.kubeconfig_for_service_account(OPERATOR_NS, SERVICE_ACCOUNT), work,
                             resync_seconds="10").start()
        custom, batch = client.CustomObjectsApi(api), client.BatchV1Api(api)

        seen: dict[str, float] = {}
        ready = threading.Event()

        def watch_trainer_jobs() -> None:
            w = watch.Watch()
            ready.set()
            for event in w.stream(batch.list_namespaced_job, ns, timeout_seconds=600):
                name = event["object"].metadata.name.removesuffix("-trainer")
                seen.setdefault(name, time.monotonic())
                if len(seen) >= args.jobs:
                    w.stop()

        watcher = threading.Thread(target=watch_trainer_jobs, daemon=True)
        watcher.start()
        ready.wait()
        time.sleep(1)
        rss_before = rss_mib(op.proc.pid)
        metrics_before = op.metrics()
        names = [f"job-{i:03d}" for i in range(args.jobs)]
        created: dict[str, float] = {}

        def create(name: str) -> None:
            doc = body(name, ns, **{"storage.uri": "s3://bucket/runs", "storage.secretRef": None,
                                    "trainer.nnodes": 1, "rollout.replicas": 1})
            started = time.monotonic()
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)
            created[name] = started

        burst = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(create, names))
        created_in = time.monotonic() - burst
        deadline = time.monotonic() + 600
        while len(seen) < args.jobs and time.monotonic() < deadline:
            time.sleep(0.2)
        all_in = time.monotonic() - burst
        rss_after = rss_mib(op.proc.pid)
        metrics_after = op.metrics()
        time.sleep(args.settle)
        rss_settled = rss_mib(op.proc.pid)
        metrics_settled = op.metrics()

        latencies = sorted(seen[n] - created[n] for n in names if n in seen)
        missing = [n for n in names if n not in seen]
        calls = metric_sum(metrics_after, "grpo_operator_api_requests_total") - \
            metric_sum(metrics_before, "grpo_operator_api_requests_total")
        failed_calls = sum(metric_sum(metrics_settled, "grpo_operator_api_requests_total", f'code="{c}"')
                           for c in ("0", "409", "429", "500", "503", "504"))
        settle_calls = metric_sum(metrics_settled, "grpo_operator_api_requests_total") - \
            metric_sum(metrics_after, "grpo_operator_api_requests_total")
        errors = metric_sum(metrics_settled, "grpo_operator_reconcile_errors_total")
        error_lines = [ln for ln in op.logs().splitlines() if re.search(r"\bERROR\b|Traceback|reconcile failed", ln)]
        q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
        result = {
            "jobs": args.jobs, "children_present": len(latencies), "missing": missing[:5],
            "create_calls_s": round(created_in, 2), "all_children_s": round(all_in, 2),
            "latency_p50_s": round(q[49], 3), "latency_p99_s": round(q[98], 3), "latency_max_s": round(latencies[-1], 3),
            "operator_rss_mib": {"before": round(rss_before), "after_burst": round(rss_after),
                                 f"after_{args.settle:g}s": round(rss_settled)},
            "operator_api_calls_burst": int(calls), "operator_api_calls_per_s_burst": round(calls / all_in, 1),
            "operator_api_calls_per_s_steady": round(settle_calls / args.settle, 1),
            "api_calls_failed": int(failed_calls), "reconcile_errors": int(errors), "error_log_lines": error_lines[:5],
        }
        print(json.dumps(result, indent=1))
        op.kill()
    return 0 if not missing and not errors and not error_lines else 1


def floor(args, api, ns: str) -> int:
    from kubernetes import client

    from grpo_api.jobfile import parse_job
    from grpo_operator import manifests
    from grpo_operator.kube import Kube
    from grpo_operator.pki import JobTLS
    from grpo_operator.settings import OperatorSettings
    settings = OperatorSettings()
    custom, kube = client.CustomObjectsApi(api), Kube(api)
    tls = JobTLS(ca_cert="ca", cert="cert", key="key")
    latencies: list[float] = []
    writes: list[int] = []            # per job: its create, the operator's writes, the status patch

    def create(name: str) -> None:
        doc = body(name, ns, **{"storage.uri": "s3://bucket/runs", "storage.secretRef": None,
                                "trainer.nnodes": 1, "rollout.replicas": 1})
        started = time.monotonic()
        obj = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)
        job = parse_job(obj)
        # the operator's verbs: create the Secret, apply the children and the Deployment, create
        # the trainer Job, patch the status
        kube.create(manifests.build_rpc_secret(job, settings, token="t", checkpoint_key="k", tls=tls))
        applied = [*manifests.build_children(job, settings, pod_monitor=False), manifests.build_rollout_deployment(job, settings)]
        for child in applied:
            kube.apply(child)
        kube.create(manifests.build_trainer_job(job, settings))
        latencies.append(time.monotonic() - started)
        kube.patch_status(f"{GROUP}/{VERSION}", "GRPOJob", ns, name, {"phase": "Pending"})
        writes.append(len(applied) + 4)

    burst = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(create, [f"job-{i:03d}" for i in range(args.jobs)]))
    total = time.monotonic() - burst
    latencies.sort()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    print(json.dumps({"jobs": args.jobs, "mode": "floor (no operator)", "writes": sum(writes),
                      "all_children_s": round(total, 2), "writes_per_s": round(sum(writes) / total, 1), "latency_p50_s": round(q[49], 3),
                      "latency_p99_s": round(q[98], 3), "latency_max_s": round(latencies[-1], 3)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
