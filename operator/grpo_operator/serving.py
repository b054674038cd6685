"""Whether the operator can serve GRPOJobs at all: the GRPOJob CRD must be installed.

kopf learns which resources exist once, when it starts (its CRD scanning is off: that needs
list and watch on CRDs cluster-wide, which a namespaced install doesn't grant). So the CRD's
presence decides what `grpo operator` does:

- CRD served: kopf runs, and a watchdog polls discovery every `resync_seconds`; when the CRD
  goes (`kubectl delete crd grpojobs.grpo.dev`) it stops kopf, instead of kopf's watch failing
  with a traceback and the process exiting.
- CRD missing (deleted, or not installed yet): /healthz answers 503 and says why, and the
  operator polls until the CRD is served, then starts kopf, which lists every GRPOJob.

Callers: commands.py (the loop around kopf), handlers.py (the watchdog task).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
import time
import urllib.parse

from grpo_api.spec import API_GROUP, API_VERSION, PLURAL

from grpo_operator.kube import Kube, KubeError

log = logging.getLogger("grpo.operator")
CRD_NAME = f"{PLURAL}.{API_GROUP}"
NOT_SERVING = f"the GRPOJob CRD ({CRD_NAME}) is not installed: no GRPOJob is served until it is"


def crd_served(kube: Kube) -> bool:
    """Whether the API server serves GRPOJobs (discovery, which every user may read). Raises
    KubeError when the API server can't be asked."""
    try:
        doc = kube.request("GET", f"/apis/{API_GROUP}/{API_VERSION}")
    except KubeError as exc:
        if exc.status in (403, 404, 503):
            return False
        raise
    return any(r.get("name") == PLURAL for r in (doc or {}).get("resources") or [])


async def watchdog(kube: Kube, interval: float, stop: asyncio.Event) -> None:
    """Sets `stop` (kopf's stop flag) once the CRD is no longer served."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        try:
            served = await loop.run_in_executor(None, crd_served, kube)
        except KubeError:
            continue  # the API server is unreachable: no verdict on the CRD
        if not served:
            log.warning("%s; stopping until it is installed again", NOT_SERVING)
            stop.set()
            return


def wait_until_served(kube: Kube, liveness_endpoint: str, interval: float) -> None:
    """Return once the CRD is served; meanwhile the liveness endpoint answers 503."""
    if _served(kube):
        return
    log.warning("%s; waiting for it", NOT_SERVING)
    server = _not_serving(liveness_endpoint) if liveness_endpoint else None
    try:
        while not _served(kube):
            time.sleep(interval)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    log.info("The GRPOJob CRD is installed: serving GRPOJobs")


def _served(kube: Kube) -> bool:
    try:
        return crd_served(kube)
    except KubeError as exc:
        log.warning("can't reach the API server: %s", exc)
        return False


class _NotServing(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = json.dumps({"serving": False, "reason": NOT_SERVING}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per probe would flood the log
        pass


def _not_serving(endpoint: str) -> http.server.ThreadingHTTPServer:
    """A 503 at the liveness endpoint's address (kopf's own server takes over when kopf runs)."""
    parts = urllib.parse.urlsplit(endpoint)
    server = http.server.ThreadingHTTPServer((parts.hostname or "localhost", parts.port or 80), _NotServing)
    threading.Thread(target=server.serve_forever, name="not-serving", daemon=True).start()
    return server
