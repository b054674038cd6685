"""A real Kubernetes control plane for tests: etcd + kube-apiserver + kube-controller-manager.

The binaries come from scripts/build-controlplane.sh (``$GRPO_CACHE/bin``). Only the standard
library and the ``openssl`` CLI are used here, so the helper works before the project is installed:

    with ControlPlane() as cp:
        subprocess.run(["kubectl", "--kubeconfig", cp.kubeconfig, "get", "ns"])

``python tests/controlplane/cluster.py`` starts one and keeps it up until Ctrl-C.

There is no kubelet and no scheduler: pods are created (by the Job and ReplicaSet controllers)
but never run. Every process is started in its own process group and is killed on stop(),
at interpreter exit, and (through PR_SET_PDEATHSIG) when the Python process itself dies.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from ports import free_port

SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the first address of SERVICE_CIDR: the `kubernetes` Service
ISSUER = "https://kubernetes.default.svc.cluster.local"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")

# What the tests need from kube-controller-manager: pods for Jobs, ReplicaSets for
# Deployments, EndpointSlices for Services, garbage collection by owner references, the
# `default` ServiceAccount (pods are refused without it), namespace deletion, and the
# kube-root-ca.crt ConfigMap that every pod's service-account volume refers to.
CONTROLLERS = (
    "job-controller",
    "deployment-controller",
    "replicaset-controller",
    "endpointslice-controller",
    "garbage-collector-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "root-ca-certificate-publisher-controller",
    "ttl-after-finished-controller",
)

_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
subjectAltName = DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:{service_ip},IP:{host}
"""
# P-256 keys: generated in milliseconds (RSA would cost seconds on a small machine).
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-noenc"]


def default_bin_dir() -> Path:
    """Where scripts/build-controlplane.sh puts the binaries."""
    cache = os.environ.get("GRPO_CACHE") or str(Path.home() / ".cache" / "grpo-operator")
    return Path(cache) / "bin"


def missing_binaries(bin_dir: Path | None = None) -> list[str]:
    bin_dir = bin_dir or default_bin_dir()
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child should only make the call


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the parent dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ControlPlaneError(RuntimeError):
    pass


class ControlPlane:
    """`host`: the address every component listens on (tests/e2e uses a non-loopback one in a
    network namespace, so that a kubelet and pods can reach the apiserver). `preexec`: runs in
    each child before exec, after the parent-death signal is set (e.g. to enter that namespace).
    `controllers` and `apiserver_args` replace or extend the defaults. `crds`: CRD files installed
    (Established) before the controller manager starts, as on a cluster that has had them for long:
    its garbage collector learns resource types at its start and looks again only every 30 s, so
    the owned children of a kind installed later outlive their owner for up to that long."""

    def __init__(self, bin_dir: Path | None = None, workdir: Path | None = None, *, host: str = "127.0.0.1",
                 preexec=None, controllers: tuple[str, ...] = CONTROLLERS, apiserver_args: tuple[str, ...] = (),
                 crds: tuple[Path, ...] = ()):
        self.bin_dir = Path(bin_dir or default_bin_dir())
        self.crds = crds
        self.host = host
        self._preexec = preexec
        self.controllers = controllers
        self.apiserver_args = apiserver_args
        self._own_workdir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="grpo-controlplane-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = 0
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.ca_file = self.dir / "ca.crt"

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 120) -> "ControlPlane":
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(f"missing {missing} in {self.bin_dir}: run scripts/build-controlplane.sh")
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        try:
            self._make_certs()
            self._start_etcd(deadline)
            self._start_apiserver(deadline)
            self._write_kubeconfig(self.kubeconfig, {"client-certificate": str(self.dir / "admin.crt"),
                                                     "client-key": str(self.dir / "admin.key")})
            self._install_crds(deadline)
            self._start_controller_manager(deadline)
        except BaseException:
            self.stop(keep_dir=True)  # the logs say why; leave them for the reader
            raise
        return self

    def stop(self, keep_dir: bool = False) -> None:
        """Stops everything, newest first (the controller manager before the apiserver before
        etcd, so none logs a storm of connection errors). Safe to call more than once."""
        for name, proc in reversed(list(self.procs.items())):
            _kill_group(proc)
        self.procs.clear()
        atexit.unregister(self.stop)
        if self._own_workdir and not keep_dir and not os.environ.get("GRPO_KEEP_CONTROLPLANE"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- the pieces ----------------------------------------------------------------------

    def _openssl(self, *args: str) -> None:
        r = subprocess.run(["openssl", *args], cwd=self.dir, capture_output=True, text=True)
        if r.returncode:
            raise ControlPlaneError(f"openssl {' '.join(args)}: {r.stderr}")

    def _make_certs(self) -> None:
        """A CA, the apiserver's serving cert, client certs, and the service-account key pair."""
        (self.dir / "openssl.cnf").write_text(_OPENSSL_CNF.format(service_ip=SERVICE_IP, host=self.host))
        cnf = ["-config", "openssl.cnf"]
        self._openssl("req", "-x509", *cnf, "-extensions", "ca", *_EC, "-days", "7",
                      "-subj", "/CN=grpo-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
        for name, subject, ext in [
            ("apiserver", "/CN=kube-apiserver", "server"),
            # system:masters is the group RBAC lets do anything, whatever the cluster's roles.
            ("admin", "/O=system:masters/CN=grpo-admin", "client"),
        ]:
            self._openssl("req", "-new", *cnf, *_EC, "-subj", subject,
                          "-keyout", f"{name}.key", "-out", f"{name}.csr")
            self._openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                          "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "7",
                          "-extfile", "openssl.cnf", "-extensions", ext, "-out", f"{name}.crt")
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key")
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")

    def _spawn(self, name: str, args: list[str], binary: str | None = None) -> subprocess.Popen:
        with open(self.dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [binary or str(self.bin_dir / name), *args], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=self.dir,
                start_new_session=True,  # its own process group: stop() kills it and any child
                preexec_fn=self._child_setup)
        self.procs[name] = proc
        return proc

    def _child_setup(self) -> None:
        _die_with_parent()
        if self._preexec:
            self._preexec()

    def _start_etcd(self, deadline: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://{self.host}:{client}"
        self._spawn("etcd", [
            "--name=default", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://{self.host}:{peer}",
            f"--initial-advertise-peer-urls=http://{self.host}:{peer}",
            f"--initial-cluster=default=http://{self.host}:{peer}",
            "--unsafe-no-fsync",  # test data: durability is not worth the fsync latency
            "--log-level=warn",
        ])
        self._wait("etcd", f"{self.etcd_url}/health", deadline, lambda body: '"health":"true"' in body)

    def _start_apiserver(self, deadline: float) -> None:
        self.port = free_port()
        d = self.dir
        self._spawn("kube-apiserver", [
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.host}", f"--advertise-address={self.host}", f"--secure-port={self.port}",
            # The endpoint reconciler refuses a loopback address for the `kubernetes` Service's
            # endpoints; no pod ever runs here to use them.
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={d / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--allow-privileged=true",
            "--profiling=false",
            *self.apiserver_args,
        ])
        self._wait("kube-apiserver", f"{self.url}/readyz", deadline, lambda body: body.strip() == "ok")

    def _install_crds(self, deadline: float) -> None:
        crd_api = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        names = []
        for path in self.crds:
            for crd in yaml.safe_load_all(Path(path).read_text()):
                if crd:
                    self.request("POST", crd_api, crd)
                    names.append(crd["metadata"]["name"])
        for name in names:
            self._wait("kube-apiserver", f"{self.url}{crd_api}/{name}", deadline,
                       lambda body: any(c["type"] == "Established" and c["status"] == "True"
                                        for c in json.loads(body).get("status", {}).get("conditions") or []))

    def _start_controller_manager(self, deadline: float) -> None:
        port = free_port()
        d = self.dir
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--use-service-account-credentials=false",  # every controller acts as the admin
            f"--controllers={','.join(self.controllers)}",
            f"--service-account-private-key-file={d / 'sa.key'}",
            f"--root-ca-file={d / 'ca.crt'}",
            f"--bind-address={self.host}", f"--secure-port={port}", f"--cert-dir={d / 'kcm-certs'}",
            "--profiling=false",
        ])
        # /healthz is served without authentication; its cert is self-signed.
        self._wait("kube-controller-manager", f"https://{self.host}:{port}/healthz", deadline,
                   lambda body: body.strip() == "ok", verify=False)
        # Healthy isn't working yet: the `default` ServiceAccount appears once the controllers
        # run, and without it no pod can be created in the namespace.
        self._wait("kube-controller-manager", f"{self.url}/api/v1/namespaces/default/serviceaccounts/default",
                   deadline, lambda body: '"name":"default"' in body.replace(" ", ""))

    # ----- HTTP ----------------------------------------------------------------------------

    def _ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        if not verify:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            return ctx
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(self.dir / "admin.crt", self.dir / "admin.key")
        return ctx

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """An admin request to the apiserver; the decoded JSON reply."""
        req = urllib.request.Request(
            self.url + path, method=method, data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self._ssl_context(), timeout=30) as r:
            return json.loads(r.read())

    def _wait(self, name: str, url: str, deadline: float, ready, verify: bool = True) -> None:
        proc = self.procs[name]
        ctx = self._ssl_context(verify) if url.startswith("https") else None
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                    last = r.read().decode(errors="replace")
                    if ready(last):
                        return
            except (OSError, urllib.error.URLError) as e:  # not listening yet, or not ready (5xx)
                last = str(e)
            time.sleep(0.25)
        raise ControlPlaneError(f"{name} not ready at {url} (last: {last[:300]}):\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        log = self.dir / f"{name}.log"
        try:
            return f"(end of {log})\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no {log})"

    # ----- kubeconfigs ---------------------------------------------------------------------

    def _write_kubeconfig(self, path: Path, user: dict) -> Path:
        # JSON is YAML: kubectl and the Python client both read it.
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                      "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "test", "user": user}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }, indent=1))
        return path

    def kubeconfig_for_service_account(self, namespace: str, name: str,
                                       expiration_seconds: int = 3600) -> Path:
        """A kubeconfig that acts as ServiceAccount namespace/name, with a token minted through
        the TokenRequest API (what a pod's projected token is). The account must exist."""
        reply = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                             {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                              "spec": {"expirationSeconds": expiration_seconds}})
        return self._write_kubeconfig(self.dir / f"sa-{namespace}-{name}.kubeconfig",
                                      {"token": reply["status"]["token"]})


def _kill_group(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait)
            # The leader is gone; kill whatever else is left in its group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    with ControlPlane() as cp:
        print(f"export KUBECONFIG={cp.kubeconfig}  # {cp.url}; logs in {cp.dir}; Ctrl-C stops", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    sys.exit(0)


def retry(action, attempts: int = 20, delay: float = 0.5):
    """Run `action` until it stops raising (for API states that settle a moment later)."""
    for attempt in range(attempts):
        try:
            return action()
        except BaseException:  # pytest.fail raises a BaseException subclass
            if attempt == attempts - 1:
                raise
            time.sleep(delay)
