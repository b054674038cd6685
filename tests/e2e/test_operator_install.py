"""`helm install` of the chart with the locally built operator image: the operator runs
in-cluster, as the chart's ServiceAccount, and becomes Ready."""

import pytest

from .conftest import OPERATOR_NAMESPACE

# The first test to use the cluster also pays for starting it, which includes importing new
# images into containerd (~12 min for the two torch images) when the sources changed.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


def test_helm_installed_operator_runs_in_cluster_under_its_service_account(cluster, operator):
    (pod,) = cluster.get("pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator")["items"]
    assert pod["status"]["phase"] == "Running"
    assert all(c["ready"] for c in pod["status"]["containerStatuses"])
    (container,) = pod["spec"]["containers"]
    assert container["image"] == cluster.images["operator"]
    # The chart's ServiceAccount, and RBAC that lets it (and only it) watch GRPOJobs cluster-wide.
    account = pod["spec"]["serviceAccountName"]
    assert account == operator
    can = cluster.kubectl("auth", "can-i", "watch", "grpojobs.grpo.dev", "--all-namespaces",
                          f"--as=system:serviceaccount:{OPERATOR_NAMESPACE}:{account}", check=False)
    assert can.stdout.strip() == "yes", can.stdout + can.stderr
    # It really talks to the apiserver from inside the pod (kopf logs its start-up).
    logs = cluster.kubectl("logs", "-n", OPERATOR_NAMESPACE, pod["metadata"]["name"]).stdout
    assert "Traceback" not in logs, logs[-3000:]
