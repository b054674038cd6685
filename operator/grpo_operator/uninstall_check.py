"""`grpo operator check-uninstall`: the chart's pre-delete hook. Uninstalling the operator while
GRPOJobs are unfinished leaves them as they are, with nothing to stop them: a job that then
finishes keeps its rollout pods (and their GPUs) and reads Running for ever. So `helm uninstall`
is refused while any job the operator serves isn't Succeeded or Failed, the way operators with
live custom resources refuse; `helm uninstall --no-hooks` goes ahead anyway."""

from __future__ import annotations

import sys

from grpo_api.spec import Phase
from grpo_operator.kube import Kube, KubeError, path

FINISHED = {Phase.Succeeded.value, Phase.Failed.value}
JOBS = "/apis/grpo.dev/v1alpha1/grpojobs"


def unfinished_jobs(kube: Kube, namespaces: tuple[str, ...]) -> list[str]:
    """`namespace/name (phase)` of every GRPOJob not finished, in `namespaces` (all when empty)."""
    urls = [path("grpo.dev/v1alpha1", "GRPOJob", ns) for ns in namespaces] or [JOBS]
    items = []
    for url in urls:
        reply = kube.request("GET", url)
        items += (reply or {}).get("items", [])
    out = []
    for job in items:
        phase = (job.get("status") or {}).get("phase") or "Pending"
        if phase not in FINISHED:
            out.append(f"{job['metadata']['namespace']}/{job['metadata']['name']} ({phase})")
    return sorted(out)


def check_uninstall(namespaces: tuple[str, ...], kube: Kube | None = None) -> int:
    """0: nothing unfinished (or no GRPOJob CRD); 1: refused, the jobs named; 3: the API failed."""
    kube = kube or Kube()
    try:
        jobs = unfinished_jobs(kube, namespaces)
    except KubeError as exc:
        if exc.status == 404:     # the CRD is gone: no job can be left behind
            return 0
        print(f"grpo operator check-uninstall: can't list GRPOJobs: {exc}", file=sys.stderr)
        return 3
    if not jobs:
        print("no unfinished GRPOJob: the operator can be uninstalled")
        return 0
    print(f"refusing to uninstall the operator: {len(jobs)} GRPOJob(s) not finished: {', '.join(jobs)}. "
          "Without the operator nothing stops them: a job that finishes keeps its rollout pods and their "
          "GPUs. Delete them (kubectl delete gj -n NAMESPACE NAME) or wait until they finish; "
          "`helm uninstall --no-hooks` uninstalls anyway.", file=sys.stderr)
    return 1
