"""The few Kubernetes API calls the operator makes, over the official client's connection and
credentials (in-cluster ServiceAccount, else KUBECONFIG), on plain JSON dicts: the manifests are
dicts, and typed models would only convert back and forth.

Children are applied with server-side apply (`fieldManager=grpo-operator`, forced): applying the
same manifest twice changes nothing, so a restarted operator can apply everything again. Errors
are `KubeError` with the HTTP status; `transient` says whether trying again may help.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

log = logging.getLogger("grpo.operator")

# (apiVersion, kind) -> plural, for every kind the operator touches.
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("batch/v1", "Job"): "jobs",
    ("apps/v1", "Deployment"): "deployments",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
    ("kueue.x-k8s.io/v1beta2", "Workload"): "workloads",
    ("grpo.dev/v1alpha1", "GRPOJob"): "grpojobs",
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def gone(self) -> bool:
        """The object, or its namespace, is going away: nothing to reconcile any more."""
        return self.status == 404 or (self.status == 403 and "is being terminated" in self.message)

    @property
    def transient(self) -> bool:
        """Server trouble, throttling, conflicts and lost connections may pass; 4xx won't."""
        return self.status in (0, 409, 429) or self.status >= 500


def path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    out = f"{prefix}/namespaces/{quote(namespace)}/{PLURALS[(api_version, kind)]}"
    if name:
        out += "/" + quote(name)
    if sub:
        out += "/" + sub
    return out


def load_api_client():
    """The official client's ApiClient: in-cluster config in a pod, else KUBECONFIG/~/.kube."""
    from kubernetes import client, config
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()


class Kube:
    def __init__(self, api_client=None, *, field_manager: str = "grpo-operator", timeout: float = 30.0,
                 on_response: Callable[[str, int], None] | None = None):
        self.api = api_client or load_api_client()
        self.field_manager = field_manager
        self.timeout = timeout
        self.on_response = on_response
        """Called with (verb, HTTP status) after every call: the operator counts them."""

    # -- transport ------------------------------------------------------------------------

    def request(self, method: str, url_path: str, *, body: Any = None, query: dict | None = None,
                content_type: str = "application/json", raw: bool = False) -> Any:
        """One API call; the decoded reply (its bytes with `raw`), None for 404 on GET. Raises KubeError."""
        if query:
            url_path += "?" + urlencode(query)
        headers = {"Accept": "*/*" if raw else "application/json", "Content-Type": content_type}
        try:
            method, url, headers, body, _ = self.api.param_serialize(
                method=method, resource_path=url_path, header_params=headers, body=body,
                auth_settings=["BearerToken"])
            resp = self.api.call_api(method, url, headers, body, _request_timeout=self.timeout)
            data = resp.read()
        except Exception as exc:  # noqa: BLE001 - urllib3/ssl errors: the connection, not the request
            if isinstance(exc, KubeError):
                raise
            if self.on_response:
                self.on_response(method, 0)
            raise KubeError(0, "ConnectionError", str(exc)) from exc
        status = resp.status
        if self.on_response:
            self.on_response(method, status)
        if method == "GET" and status == 404:
            return None
        if status >= 300:
            try:
                doc = json.loads(data)
                reason, message = doc.get("reason", ""), doc.get("message", "")
            except ValueError:
                reason, message = "", data[:300].decode(errors="replace")
            raise KubeError(status, reason, message)
        if raw:
            return data
        return json.loads(data) if data else {}

    # -- objects --------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", path(api_version, kind, namespace, name))

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))}
        return self.request("GET", path(api_version, kind, namespace), query=query)["items"]

    def pod_log(self, namespace: str, name: str, *, previous: bool = False,
                limit_bytes: int = 16 << 20) -> bytes | None:
        """A pod's container log: its last 100,000 lines, `limit_bytes` at most (`previous`: the
        container's before its last restart); None when the pod is gone."""
        query = {"tailLines": "100000", "limitBytes": str(limit_bytes), **({"previous": "true"} if previous else {})}
        return self.request("GET", path("v1", "Pod", namespace, name, "log"), query=query, raw=True)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates the object or makes the operator's fields equal to obj's."""
        m = obj["metadata"]
        return self.request("PATCH", path(obj["apiVersion"], obj["kind"], m["namespace"], m["name"]), body=obj,
                            query={"fieldManager": self.field_manager, "force": "true"},
                            content_type="application/apply-patch+yaml")

    def create(self, obj: dict[str, Any]) -> bool:
        """Create obj; False when it exists already (a restarted operator created it before)."""
        m = obj["metadata"]
        try:
            self.request("POST", path(obj["apiVersion"], obj["kind"], m["namespace"]), body=obj,
                         query={"fieldManager": self.field_manager})
            return True
        except KubeError as exc:
            if exc.status == 409 and exc.reason == "AlreadyExists":
                return False
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *,
               propagation: str = "Background") -> bool:
        """Delete; False when it is gone already."""
        try:
            self.request("DELETE", path(api_version, kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation})
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any],
                    sub: str | None = None) -> None:
        """A JSON merge patch (RFC 7386): the given fields set, null ones removed."""
        self.request("PATCH", path(api_version, kind, namespace, name, sub), body=body,
                     query={"fieldManager": self.field_manager}, content_type="application/merge-patch+json")

    def add_owner_reference(self, api_version: str, kind: str, namespace: str, name: str,
                            owner: dict[str, Any]) -> None:
        """Add an owner reference; the object's other owners stay. A strategic merge patch (built-in
        kinds only) merges ownerReferences by uid, so doing it twice changes nothing."""
        self.request("PATCH", path(api_version, kind, namespace, name),
                     body={"metadata": {"ownerReferences": [owner]}},
                     query={"fieldManager": self.field_manager},
                     content_type="application/strategic-merge-patch+json")

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Set the status subresource's fields (the caller nulls the ones to remove)."""
        self.merge_patch(api_version, kind, namespace, name, {"status": status}, sub="status")

    def has_api(self, group_version: str) -> bool:
        """Whether the API group/version is served (discovery; every user may read it)."""
        try:
            return self.request("GET", f"/apis/{group_version}") is not None
        except KubeError as exc:
            if exc.status in (403, 404, 503):
                return False
            raise

    def post_event(self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str,
                   component: str = "grpo-operator") -> None:
        """A core/v1 Event about `involved` (what `kubectl describe` and `kubectl get events` show)."""
        m = involved["metadata"]
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{m['name']}.", "namespace": m["namespace"]},
            "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"],
                               "name": m["name"], "namespace": m["namespace"], "uid": m["uid"]},
            "type": type_, "reason": reason, "message": message[:1024],
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "source": {"component": component}, "reportingComponent": component,
        }
        self.request("POST", path("v1", "Event", m["namespace"]), body=event)
