"""Fixtures of the e2e tests (marker `e2e`): a real one-node cluster that runs the project's own
images, the S3 server its pods write to, and the operator installed by its Helm chart.

Everything is built before pytest by the repo's scripts (./scripts/test.sh runs them):
install-node-packages.sh (containerd, runc, CNI plugins, buildah, ...), build-controlplane.sh
(kubelet, kube-scheduler, CoreDNS with the control plane), build-s3.sh, build-images.sh.
Missing pieces skip the tests, unless GRPO_REQUIRE_E2E is set (CI): then they are errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .e2e_helpers import REPO, S3_BUCKET, S3_KEY, S3_SECRET, Cluster, wait_for
from .node import Node, clean_stale, e2e_bin_dir, node_binaries

NODE_PACKAGE_BINARIES = ("containerd", "ctr", "runc", "buildah", "mmdebstrap", "iptables")


def _missing(msg: str):
    if os.environ.get("GRPO_REQUIRE_E2E"):
        pytest.fail(f"{msg} (GRPO_REQUIRE_E2E is set)", pytrace=False)
    pytest.skip(msg)


def _build_images() -> dict[str, str]:
    missing = [b for b in NODE_PACKAGE_BINARIES if not shutil.which(b)]
    if missing:
        _missing(f"{missing} not installed; run scripts/install-node-packages.sh")
    done = subprocess.run([str(REPO / "scripts" / "build-images.sh")], capture_output=True, text=True, timeout=3600)
    if done.returncode:
        pytest.fail(f"scripts/build-images.sh failed:\n{done.stderr[-5000:]}", pytrace=False)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _exporter(ref: str):
    def export(path: Path) -> subprocess.Popen:
        return subprocess.Popen([str(REPO / "scripts" / "build-images.sh"), "--export", ref, str(path)],
                                stdout=subprocess.DEVNULL)
    return export


# Package scope: one node for all of tests/e2e, torn down as soon as they are done, so it
# doesn't hold memory and CPU through the rest of the suite.
@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        _missing("the e2e node needs root (network namespaces, cgroups, mounts)")
    bins = e2e_bin_dir()
    absent = [b for b in (*node_binaries(), "helm") if not os.access(bins / b, os.X_OK)]
    if absent:
        _missing(f"{absent} not in {bins}; run scripts/build-controlplane.sh")
    # scripts/build-s3.sh's binary (not imported from tests/conftest.py: in a full run, the
    # module named `conftest` may be another folder's).
    s3_binary = bins / "versitygw"
    if not os.access(s3_binary, os.X_OK):
        _missing(f"{s3_binary} not built; run scripts/build-s3.sh")
    kubectl = Path(sys.executable).parent / "kubectl"
    kubectl_bin = str(kubectl) if kubectl.exists() else shutil.which("kubectl")
    images = _build_images()
    clean_stale()
    node = Node(images={ref: _exporter(ref) for ref in images.values()}, pause_image=images["pause"])
    try:
        node.start(timeout=1800)     # a cold containerd cache imports the images (minutes)
        s3_port = 9000
        data = node.dir / "s3"
        (data / "data").mkdir(parents=True)
        (data / "iam").mkdir()
        node._spawn("versitygw", ["--access", S3_KEY, "--secret", S3_SECRET, "--port", f"{node.ip}:{s3_port}",
                                  "--iam-dir", str(data / "iam"), "--quiet", "posix", str(data / "data")],
                    binary=str(s3_binary))
        c = Cluster(node=node, images=images, kubectl_bin=kubectl_bin, helm_bin=str(bins / "helm"),
                    s3_endpoint=f"http://{node.ip}:{s3_port}")

        def bucket():
            import pyarrow.fs as pafs
            fs = pafs.S3FileSystem(access_key=S3_KEY, secret_key=S3_SECRET, region="us-east-1",
                                   endpoint_override=f"{node.ip}:{s3_port}", scheme="http",
                                   allow_bucket_creation=True)
            fs.create_dir(S3_BUCKET)
            return True
        wait_for("the S3 server", lambda: _try(bucket), timeout=60, interval=0.5)
        yield c
    finally:
        node.stop()


def _try(action):
    try:
        return action()
    except OSError:
        return False


OPERATOR_NAMESPACE = "grpo-system"


@pytest.fixture(scope="package")
def operator(cluster):
    """The chart installed with the locally built images, the operator Ready in-cluster. Job
    pods ask for little (one 2-core node runs them all)."""
    def image(name):
        repository, tag = cluster.images[name].rsplit(":", 1)
        return repository, tag
    sets = {}
    for key, name in (("image", "operator"), ("jobDefaults.trainer.image", "trainer"),
                      ("jobDefaults.rollout.image", "rollout")):
        sets[f"{key}.repository"], sets[f"{key}.tag"] = image(name)
    for role in ("trainer", "rollout"):
        sets[f"jobDefaults.{role}.resources.requests.cpu"] = "100m"
        sets[f"jobDefaults.{role}.resources.requests.memory"] = "256Mi"
        sets[f"jobDefaults.{role}.resources.limits.memory"] = "6Gi"
        sets[f"jobDefaults.{role}.terminationGracePeriodSeconds"] = "60"
    sets["jobDefaults.shmSize"] = "1Gi"
    sets["operator.readStorageSecrets"] = "true"
    sets["operator.resyncSeconds"] = "3"
    args = ["install", "grpo", str(REPO / "charts" / "grpo-operator"), "--namespace", OPERATOR_NAMESPACE,
            "--create-namespace"]
    for k, v in sets.items():
        args += ["--set-string" if k.endswith(".tag") else "--set", f"{k}={v}"]
    cluster.helm(*args)
    deployment = cluster.get("deployment", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator")
    (name,) = [d["metadata"]["name"] for d in deployment["items"]]

    def available():
        d = cluster.get("deployment", "-n", OPERATOR_NAMESPACE, name)
        return d["status"].get("availableReplicas") == 1 and d
    wait_for("the operator Deployment to be available", available, timeout=300,
             diagnose=lambda: cluster.kubectl("describe", "pods", "-n", OPERATOR_NAMESPACE, check=False).stdout
             + cluster.kubectl("logs", "-n", OPERATOR_NAMESPACE, f"deploy/{name}", "--tail=50", check=False).stdout)
    return name
