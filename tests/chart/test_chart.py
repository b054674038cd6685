"""The Helm chart: lint, render (defaults and every option), values schema, RBAC, dashboards, and
on the real control plane `helm install` and server-side dry runs of everything it renders."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from chart_helpers import ALL_VALUES, CHART, REPO, find, render, run
from controlplane.cluster import retry

VARIANTS = {"defaults": [], "all-options": ["-f", str(ALL_VALUES)]}


# --- static ------------------------------------------------------------------------------------

def test_chart_crd_is_the_generated_crd():
    assert (CHART / "crds" / "grpojob.yaml").read_text() == (REPO / "crds" / "grpojob.yaml").read_text(), \
        "copy crds/grpojob.yaml to charts/grpo-operator/crds/ (the chart installs the generated CRD)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_passes_strict(helm, variant):
    out = run(helm, "lint", "--strict", str(CHART), *VARIANTS[variant]).stdout
    assert "0 chart(s) failed" in out


def test_defaults_render_the_operator(helm):
    docs = render(helm)
    assert sorted({d["kind"] for d in docs}) == [
        "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "Job", "Service", "ServiceAccount"]
    (deploy,) = find(docs, "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "grpo-grpo-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/grpo-operator/operator:0.1.0"
    assert "command" not in c                                   # the image's ENTRYPOINT is `grpo operator`
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    (svc,) = find(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    (binding,) = find(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "grpo-grpo-operator", "namespace": "grpo-system"}]


def test_uninstall_is_checked_by_a_pre_delete_hook_of_the_operator_image(helm):
    """The hook (issue 36) runs `grpo operator check-uninstall` (tests/operator/test_operator_admin.py
    runs that command under the chart's RBAC) as the operator's ServiceAccount, scoped like it."""
    (job,) = find(render(helm, "--set", "watchNamespaces={team-a,team-b}"), "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["serviceAccountName"] == "grpo-grpo-operator" and pod["restartPolicy"] == "Never"
    assert c["image"] == "ghcr.io/grpo-operator/operator:0.1.0" and c["args"] == ["check-uninstall"]
    assert {e["name"]: e["value"] for e in c["env"]} == {"GRPO_OPERATOR_NAMESPACES": "team-a,team-b"}
    assert find(render(helm, "--set", "uninstallCheck.enabled=false"), "Job") == []


def test_the_uninstall_hook_pod_is_not_the_operators_and_says_why_it_refused(helm):
    """Issue 48: NOTES.txt's `kubectl logs deployment/<operator>` must find the operator's pod
    only, and a refusal (Helm shows "BackoffLimitExceeded") is the hook pod's termination message."""
    docs = render(helm)
    (job,) = find(docs, "Job")
    (operator,) = find(docs, "Deployment")
    hook_labels = job["spec"]["template"]["metadata"]["labels"]
    assert not operator["spec"]["selector"]["matchLabels"].items() <= hook_labels.items()
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_viewer_starts_from_the_charts_values_alone(helm):
    """Issue 48: the jobs' trainer image (jobDefaults.trainer.image) unless viewer.image names one,
    a writable /cache for a model in object storage (the image's XDG_CACHE_HOME, on a read-only
    root), and --wait for a job that hasn't written its run yet."""
    base = ["--set", "viewer.enabled=true", "--set", "viewer.runUri=s3://runs/team-a/foo/0f3a"]

    def viewer(*extra):
        (deploy,) = find(render(helm, *base, *extra), "Deployment", "grpo-grpo-operator-viewer")
        return deploy["spec"]["template"]["spec"]

    pod = viewer("--set", "jobDefaults.trainer.image.repository=registry.local/trainer",
                 "--set", "jobDefaults.trainer.image.tag=fix-1")
    (c,) = pod["containers"]
    assert c["image"] == "registry.local/trainer:fix-1" and "--wait" in c["args"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/cache"]] and "emptyDir" in volumes[mounts["/tmp"]]
    (c,) = viewer("--set", "jobDefaults.trainer.image.tag=fix-1", "--set", "viewer.image.repository=my/viewer")["containers"]
    assert c["image"] == "my/viewer:0.1.0"


def test_the_viewer_serves_one_run_read_only_when_enabled(helm):
    """viewer.enabled (issue 35): `grpo ui` on viewer.runUri in the trainer image, the storage
    credentials from the named Secret, no API token, and a Service selecting the viewer only."""
    assert not [d for d in render(helm) if "viewer" in d["metadata"]["name"]]
    docs = render(helm, "--set", "viewer.enabled=true", "--set", "viewer.runUri=s3://runs/team-a/foo/0f3a",
                  "--set", "viewer.storageCredentialsSecret=run-reader", "--set", "viewer.endpoint=http://minio:9000")
    (deploy,) = find(docs, "Deployment", "grpo-grpo-operator-viewer")
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/grpo-operator/trainer:0.1.0"
    assert c["command"] + c["args"] == ["grpo", "ui", "s3://runs/team-a/foo/0f3a", "--host=0.0.0.0", "--port=8265",
                                        "--wait", "--endpoint=http://minio:9000"]
    assert c["envFrom"] == [{"secretRef": {"name": "run-reader"}}]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    (svc,) = find(docs, "Service", "grpo-grpo-operator-viewer")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8265, "targetPort": "http", "protocol": "TCP"}]
    # The operator's Deployment and metrics Service must not select the viewer's pod, nor it theirs.
    (operator,) = find(docs, "Deployment", "grpo-grpo-operator")
    assert not operator["spec"]["selector"]["matchLabels"].items() <= labels.items()
    out = run(helm, "template", "grpo", str(CHART), "--set", "viewer.enabled=true", check=False)
    assert out.returncode != 0 and "viewer.runUri is required" in out.stderr, out.stderr
    assert "0 chart(s) failed" in run(helm, "lint", "--strict", str(CHART), "--set", "viewer.enabled=true",
                                      "--set", "viewer.runUri=s3://runs/x").stdout


def _env(docs) -> dict[str, str]:
    (deploy,) = find(docs, "Deployment")
    return {e["name"]: e["value"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_environment_is_valid_operator_settings(helm, variant):
    from grpo_operator.settings import ENV_PREFIX, OperatorSettings
    env = _env(render(helm, *VARIANTS[variant]))
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in OperatorSettings.__dataclass_fields__}
    ours = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    assert set(ours) <= fields, f"unknown settings: {set(ours) - fields}"
    settings = OperatorSettings.from_env(ours)
    if variant == "defaults":
        assert settings.namespaces == () and settings.trainer_image == "ghcr.io/grpo-operator/trainer:0.1.0"
        assert settings.rollout_image == "ghcr.io/grpo-operator/rollout:0.1.0"
        assert settings.colocated_image == ""             # the rollout image (it carries the trainer too)
        assert settings.pod_monitor == "auto" and settings.network_policy is True
        assert settings.liveness_endpoint == "http://0.0.0.0:8081/healthz" and settings.metrics_port == 8080
    else:
        assert settings.namespaces == ("team-a", "team-b")
        assert settings.trainer_image == "registry.example.com/grpo/trainer:0.1.0"
        assert settings.colocated_image == "registry.example.com/grpo/colocated:0.1.0"
        assert settings.trainer_resources == {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "128Gi"}}
        assert settings.image_pull_secrets == ("regcred",) and settings.run_as_user == 2000
        assert settings.trainer_termination_grace_seconds == 3600 and settings.gpu_resource == "amd.com/gpu"
        assert settings.pod_monitor == "false"            # the chart-level PodMonitor replaces per-job ones
        assert settings.pod_monitor_labels == {"release": "kube-prometheus-stack"}
        assert settings.read_storage_secrets is True and settings.network_policy is False
        assert settings.metrics_namespace == "monitoring" and settings.resync_seconds == 5


def test_every_option_renders(helm):
    docs = render(helm, "-f", str(ALL_VALUES))
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in find(docs, "RoleBinding")) == ["team-a", "team-b"]
    (deploy,) = find(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.example.com/grpo/operator:0.1.0" and c["args"] == ["--verbose"]
    assert c["envFrom"] == [{"secretRef": {"name": "grpo-progress-reader"}}]
    assert {"name": "TZ", "value": "UTC"} in c["env"]
    assert pod["priorityClassName"] == "system-cluster-critical" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"} and pod["tolerations"] and pod["affinity"]
    assert {p["containerPort"] for p in c["ports"]} == {9080, 9081}
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    (pm,) = find(docs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "grpojob",
                                                     "app.kubernetes.io/managed-by": "grpo-operator"}
    dashboards = find(docs, "ConfigMap")
    assert {d["metadata"]["namespace"] for d in dashboards} == {"monitoring"}
    assert all(d["metadata"]["annotations"] == {"grafana_folder": "GRPO"} for d in dashboards)


def test_pod_monitor_scrapes_colocated_servers_on_every_trainer_pod(helm):
    """The chart's PodMonitor, over a colocated 2-node job's trainer pods and a separate job's
    trainer and rollout pods (as the operator builds them): trainer rank 0's `metrics` on node 0
    only, each server's own port (`metrics-<i>`) on every node, no other port."""
    import copy

    from grpo_api.jobfile import parse_job
    from grpo_operator import manifests
    from grpo_operator.settings import OperatorSettings
    from prometheus_helpers import pod_monitor_targets

    def job(name, **rollout):
        return parse_job({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob",
                          "metadata": {"name": name, "namespace": "team-a", "uid": "0b1c2d3e-0000-4000-8000-000000000001"},
                          "spec": {"model": {"path": "Qwen/Qwen3-8B"}, "storage": {"uri": "s3://runs/team-a"},
                                   "data": {"trainFiles": ["s3://data/train.parquet"], "trainBatchSize": 128},
                                   "rollout": {"engine": "vllm", "tensorParallelSize": 2, **rollout},
                                   "trainer": {"nnodes": 2, "nprocPerNode": 4, "miniBatchSize": 32}}})

    settings = OperatorSettings(colocated_image="reg/colocated:1")
    pods = {}
    for name, j in (("co", job("co", placement="colocated", replicas=4)), ("sep", job("sep"))):
        template = manifests.build_trainer_job(j, settings)["spec"]["template"]
        for node in (0, 1):
            pods[f"{name}-trainer-{node}"] = pod = copy.deepcopy(template)
            pod["metadata"]["labels"][manifests.COMPLETION_INDEX_LABEL] = str(node)
    pods["sep-rollout"] = manifests.build_rollout_deployment(job("sep"), settings)["spec"]["template"]
    (pm,) = find(render(helm, "--set", "metrics.podMonitor.enabled=true"), "PodMonitor")
    assert pod_monitor_targets(pm, pods) == {
        ("co-trainer-0", "metrics"), ("co-trainer-0", "metrics-0"), ("co-trainer-0", "metrics-1"),
        ("co-trainer-1", "metrics-0"), ("co-trainer-1", "metrics-1"),
        ("sep-trainer-0", "metrics"), ("sep-rollout", "metrics")}


def _rules(role) -> dict[tuple[str, str], list[str]]:
    return {(group, res): r["verbs"] for r in role["rules"] for group in r["apiGroups"] for res in r["resources"]}


# The operator's calls (grpo_operator/kube.py, reconciler.py, kopf's watches and events): the
# RBAC must be exactly this, so a new call is a deliberate change here and in the chart.
LEAST_PRIVILEGE = {
    ("grpo.dev", "grpojobs"): ["get", "list", "watch", "delete"],
    ("grpo.dev", "grpojobs/status"): ["patch"],
    ("grpo.dev", "grpojobs/finalizers"): ["update"],
    ("", "configmaps"): ["get", "create", "patch"],
    ("", "services"): ["create", "patch"],
    ("", "secrets"): ["create"],
    ("", "pods"): ["list", "watch", "patch", "delete"],
    ("", "pods/log"): ["get"],                # the reward and sandbox pods' logs, kept in the run
    ("", "events"): ["create"],
    ("batch", "jobs"): ["get", "list", "watch", "create", "delete"],
    ("apps", "deployments"): ["get", "create", "patch", "delete"],
    ("networking.k8s.io", "networkpolicies"): ["create", "patch"],
    ("scheduling.x-k8s.io", "podgroups"): ["create", "patch"],
    ("kueue.x-k8s.io", "workloads"): ["list"],
    ("monitoring.coreos.com", "podmonitors"): ["create", "patch"],
}


def test_rbac_is_least_privilege(helm):
    (role,) = find(render(helm), "ClusterRole")
    assert _rules(role) == LEAST_PRIVILEGE
    all_roles = find(render(helm, "-f", str(ALL_VALUES)), "Role")
    expected = {k: v for k, v in LEAST_PRIVILEGE.items()
                if k not in (("networking.k8s.io", "networkpolicies"), ("monitoring.coreos.com", "podmonitors"))}
    expected[("", "secrets")] = ["create", "get"]          # operator.readStorageSecrets
    assert all(_rules(r) == expected for r in all_roles)


@pytest.mark.parametrize("setting, message", [
    ("watchNamespaces=team-a", "/watchNamespaces"),
    ("bogus=1", "'bogus' not allowed"),
    ("jobDefaults.runAsUser=0", "/jobDefaults/runAsUser"),
    ("jobDefaults.podMonitor=sometimes", "/jobDefaults/podMonitor"),
    ("metrics.port=0", "/metrics/port"),
    ("operator.resyncSeconds=0", "/operator/resyncSeconds"),
    ("image.repository=", "/image/repository"),
    ("viewer.runUri=/data/run", "/viewer/runUri"),
])
def test_values_schema_refuses_bad_values(helm, setting, message):
    out = run(helm, "template", "grpo", str(CHART), "--set", setting, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


# --- dashboards --------------------------------------------------------------------------------

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))


def test_dashboards_are_configmaps_of_the_json_files(helm):
    maps = {d["metadata"]["name"]: d for d in find(render(helm), "ConfigMap")}
    assert len(maps) == len(DASHBOARDS) == 3
    for path in DASHBOARDS:
        cm = maps[f"grpo-grpo-operator-dashboard-{path.stem}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_well_formed(path):
    board = json.loads(path.read_text())
    assert board["title"].startswith("GRPO / ") and board["uid"] == f"grpo-{path.stem}"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "job"} <= variables.keys()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
        for target in panel["targets"]:
            assert "$namespace" in target["expr"] or path.stem == "operator", (panel["title"], target["expr"])


def exported_series() -> set[str]:
    """Every series name the code exports, from the metric definitions themselves."""
    from grpo_operator.metrics import OperatorMetrics
    from grpo_rollout.metrics import RolloutMetrics
    from grpo_trainer.metrics import PROMETHEUS_KEYS, prometheus_name

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    names = {prometheus_name(key) for key in PROMETHEUS_KEYS}       # the trainer's gauges
    for registry in (OperatorMetrics().registry, RolloutMetrics("job", "ns", "worker").registry):
        for family in registry.collect():
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def test_every_dashboard_metric_is_exported_by_the_code():
    exported = exported_series()
    used: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        exprs += [v["definition"] for v in board["templating"]["list"] if v.get("definition")]
        for expr in exprs:
            for name in re.findall(r"\bgrpo_[a-z0-9_]+", expr):
                used.setdefault(name, set()).add(path.name)
    missing = {name: sorted(files) for name, files in used.items() if name not in exported}
    assert not missing, f"dashboards use metrics the code doesn't export: {missing}"
    # And the dashboards cover what docs/ARCHITECTURE.md §7 lists.
    for needed in ("grpo_trainer_critic_score_mean", "grpo_trainer_val_score", "grpo_trainer_actor_kl_loss",
                   "grpo_trainer_actor_entropy", "grpo_trainer_actor_pg_clipfrac", "grpo_trainer_response_length_mean",
                   "grpo_trainer_actor_grad_norm", "grpo_trainer_perf_throughput", "grpo_trainer_perf_mfu",
                   "grpo_trainer_timing_s_update_actor", "grpo_rollout_generated_tokens_total",
                   "grpo_rollout_requests_in_flight", "grpo_rollout_policy_version",
                   "grpo_rollout_weight_sync_seconds_bucket", "grpo_rollout_weight_sync_bytes_total",
                   "grpo_rollout_reward_errors_total", "grpo_operator_jobs",
                   "grpo_operator_reconcile_duration_seconds_bucket", "grpo_operator_reconcile_errors_total",
                   "grpo_operator_trainer_restarts_total"):
        assert needed in used, needed


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def leaves(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key not in ("resources", "labels"):
                yield from leaves(value, path + ".")
            else:
                yield path

    undocumented = [p for p in leaves(values) if f"`{p}`" not in readme]
    assert not undocumented, f"charts/grpo-operator/README.md lacks {undocumented}"
    for command in ("helm install", "kube-prometheus-stack", "grafana_dashboard"):
        assert command in readme


# --- on the real control plane -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(control_plane, kubectl_bin):
    kubeconfig = str(control_plane.kubeconfig)

    def kubectl(*args, stdin=None, check=True):
        return run(kubectl_bin, "--kubeconfig", kubeconfig, *args, stdin=stdin, check=check)

    # the monitoring CRDs are there from the control plane's start (controlplane.conftest.CRDS)
    for ns in ("team-a", "team-b", "monitoring"):
        kubectl("create", "namespace", ns)
    return kubeconfig, kubectl


@pytest.mark.controlplane
def test_helm_install_creates_the_crd_the_operator_and_its_rbac(helm, cluster):
    kubeconfig, kubectl = cluster
    out = run(helm, "--kubeconfig", kubeconfig, "install", "grpo", str(CHART), "--namespace", "grpo-system",
              "--create-namespace").stdout
    assert "kubectl -n <namespace> get gj -w" in out                 # NOTES.txt
    # kubectl wait errors out (instead of waiting) while a new CRD's status.conditions is still null.
    retry(lambda: kubectl("wait", "--for=condition=Established", "crd/grpojobs.grpo.dev", "--timeout=60s"))
    deploy = json.loads(kubectl("-n", "grpo-system", "get", "deployment", "grpo-grpo-operator", "-o", "json").stdout)
    assert deploy["spec"]["strategy"]["type"] == "Recreate" and deploy["spec"]["replicas"] == 1
    kubectl("-n", "grpo-system", "get", "serviceaccount/grpo-grpo-operator", "service/grpo-grpo-operator-metrics",
            "configmap/grpo-grpo-operator-dashboard-training")
    kubectl("get", "clusterrole/grpo-grpo-operator", "clusterrolebinding/grpo-grpo-operator")

    sa = "system:serviceaccount:grpo-system:grpo-grpo-operator"

    def can(verb, resource, ns="team-a"):
        resource, _, sub = resource.partition("/")
        extra = [f"--subresource={sub}"] if sub else []
        r = kubectl("auth", "can-i", verb, resource, *extra, "-n", ns, "--as", sa, check=False)
        return r.stdout.strip() == "yes"

    for verb, resource in [("watch", "grpojobs.grpo.dev"), ("patch", "grpojobs.grpo.dev/status"),
                           ("create", "jobs.batch"), ("delete", "jobs.batch"), ("patch", "deployments.apps"),
                           ("create", "secrets"), ("list", "pods"), ("create", "events"),
                           ("delete", "pods"), ("patch", "pods"),   # a failed attempt's kept pods
                           ("patch", "networkpolicies.networking.k8s.io"), ("create", "podmonitors.monitoring.coreos.com")]:
        assert can(verb, resource), f"the operator can't {verb} {resource}"
    for verb, resource in [("get", "secrets"), ("list", "secrets"), ("create", "pods"), ("create", "pods/exec"),
                           ("update", "grpojobs.grpo.dev"), ("patch", "grpojobs.grpo.dev"), ("patch", "jobs.batch"),
                           ("delete", "configmaps"), ("get", "nodes"), ("create", "clusterroles.rbac.authorization.k8s.io"),
                           ("list", "customresourcedefinitions.apiextensions.k8s.io")]:
        assert not can(verb, resource), f"the operator may {verb} {resource}: more than it needs"


@pytest.mark.controlplane
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_manifest_passes_server_side_validation(helm, cluster, variant):
    """kubeconform would need schemas from the internet; the real API server validates instead."""
    kubeconfig, kubectl = cluster
    rendered = run(helm, "template", "dry", str(CHART), "--namespace", "grpo-system", "--include-crds",
                   *VARIANTS[variant]).stdout
    kubectl("create", "namespace", "grpo-system", check=False)
    out = kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
    assert "(server dry run)" in out.stdout
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    if variant == "all-options":
        assert {"ServiceMonitor", "PodMonitor", "Role", "RoleBinding"} <= kinds
