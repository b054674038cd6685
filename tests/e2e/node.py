"""One real Kubernetes node that runs pods, for the e2e tests: the control plane of
tests/controlplane plus kube-scheduler, a kubelet, containerd + runc + the CNI bridge (Debian's),
and CoreDNS, all in a network namespace of their own.

The namespace is what keeps runs apart and the host clean: the kubelet's iptables chains, the
CNI bridge, ip_forward and every address live and die with it, so two runs can't collide and
nothing network-side is left behind. A veth pair joins it to the host: the host side is
HOST_IP, the node is NODE_IP (the apiserver, the kubelet, the S3 server listen there), so
kubectl and helm run from the host as a user's would. Pods reach the apiserver through the
`kubernetes` Service's ClusterIP: one DNAT rule stands in for kube-proxy (the operator's other
Services are headless, served by CoreDNS).

What can't live in the namespace is tracked by the run's name, grpo-e2e-<pid>-<hex>: a cgroup
of that name in every v1 hierarchy holds every process (the kubelet's pods under it too, as its
cgroupRoot), and /tmp/grpo-e2e/<name> holds every file and mount. A lock file there, held while
the run lives, tells a later run whether it is stale (a kill -9 leaves one): `clean_stale()`
kills what is in its cgroups, unmounts what is under its directory, and deletes its namespace,
cgroups and directory. See docs in tests/e2e/README.md for the recipe's reasons.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from controlplane.cluster import CONTROLLERS, ControlPlane, ControlPlaneError, _kill_group

RUNS = Path("/tmp/grpo-e2e")
PREFIX = "grpo-e2e-"
CGROUP_ROOT = Path("/sys/fs/cgroup")
POD_SUBNET = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"      # the bridge's address; CoreDNS listens here
BRIDGE = "grpoe2e0"
SERVICE_IP = "10.0.0.1"         # the `kubernetes` Service (tests/controlplane's SERVICE_CIDR)
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def e2e_bin_dir() -> Path:
    from controlplane.cluster import default_bin_dir
    return default_bin_dir()


def node_binaries() -> tuple[str, ...]:
    return ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "coredns")


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and done.returncode:
        raise ControlPlaneError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def _hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies (one per mount under /sys/fs/cgroup)."""
    return sorted(p for p in CGROUP_ROOT.iterdir() if (p / "cgroup.procs").exists() and p.is_dir()
                  and not (p / "cgroup.controllers").exists())


def _every_hierarchy() -> list[Path]:
    """The v1 hierarchies and the v2 one (`unified`, where runc also makes the pods' cgroups):
    what a run must leave empty and remove."""
    return sorted(p for p in CGROUP_ROOT.iterdir() if (p / "cgroup.procs").exists() and p.is_dir())


def _cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for h in _every_hierarchy():
        for procs in (h / name).rglob("cgroup.procs") if (h / name).exists() else ():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
    return pids


def _kill_cgroup(name: str, timeout: float = 30) -> None:
    """SIGKILL every process in the run's cgroups until none is left (a fork may race a kill)."""
    deadline = time.monotonic() + timeout
    while pids := _cgroup_pids(name):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"processes {sorted(pids)} of {name} survive SIGKILL")
        time.sleep(0.2)


def _unmount_under(path: Path) -> None:
    """Unmount everything mounted at or below `path`, deepest first (lazily: a mount a dying
    process still holds goes once it is gone)."""
    prefix = str(path)
    for _ in range(5):
        targets = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            target = line.split()[4].replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                targets.append(target)
        if not targets:
            return
        for target in sorted(targets, key=len, reverse=True):
            _run("umount", "-l", target, check=False)


def _remove_cgroups(name: str) -> None:
    for h in _every_hierarchy():
        root = h / name
        if root.exists():
            for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


def _remove_run(name: str) -> None:
    """Everything a run leaves outside its network namespace, and the namespace itself."""
    _kill_cgroup(name)
    _unmount_under(RUNS / name)
    _remove_cgroups(name)
    _run("ip", "netns", "delete", name, check=False)
    # The CNI plugins' result cache (libcni: /var/lib/cni/results/<network>-<container>-<if>).
    for cached in Path("/var/lib/cni/results").glob(f"{name}-*"):
        with contextlib.suppress(OSError):
            cached.unlink()
    shutil.rmtree(RUNS / name, ignore_errors=True)


def _is_stale(name: str) -> bool:
    lock = RUNS / name / "lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        # A run creates its directory, then its lock: a young directory may be starting.
        with contextlib.suppress(FileNotFoundError):
            if time.time() - (RUNS / name).stat().st_mtime < 60:
                return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def clean_stale() -> list[str]:
    """Removes what earlier runs left (killed before their teardown); a live run is left alone."""
    names = set()
    if RUNS.exists():
        names.update(p.name for p in RUNS.iterdir() if p.name.startswith(PREFIX))
    names.update(line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
                 if line.startswith(PREFIX))
    for h in _every_hierarchy():
        names.update(p.name for p in h.glob(PREFIX + "*"))
    stale = sorted(n for n in names if _is_stale(n))
    for name in stale:
        _remove_run(name)
    return stale


def _preimport_running(cache_dir: Path) -> bool:
    """Whether Node.preimport (scripts/test.sh, in the background) is filling the cached root."""
    try:
        pid = int((cache_dir / "containerd-root.preimport").read_text())
    except (OSError, ValueError):
        return False
    return Path(f"/proc/{pid}").exists()


class Node:
    """A one-node cluster. `start()` brings it up (node Ready, schedulable); `stop()` removes
    every trace. `images` maps each image ref to a function that starts writing its
    docker-archive to a given path (a FIFO) and returns that process; an image containerd already
    has is not imported
    (its content store is cached across runs, see _containerd_root). `pause_image` is one of
    them: the pods' sandbox image."""

    def __init__(self, images: dict[str, Callable[[Path], subprocess.Popen]], pause_image: str,
                 bin_dir: Path | None = None, cache_dir: Path | None = None):
        self.images = images
        self.pause_image = pause_image
        self.bin_dir = Path(bin_dir or e2e_bin_dir())
        self.cache_dir = Path(cache_dir or self.bin_dir.parent / "e2e")
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.dir = RUNS / self.name
        self.procs: dict[str, subprocess.Popen] = {}
        self.cp: ControlPlane | None = None
        self._lock_fd: int | None = None
        self._root_lock_fd: int | None = None
        block = random.Random(secrets.randbits(32)).randrange(1, 16383) * 4      # a /30 in 10.213.0.0/16
        self.host_ip = f"10.213.{block // 256}.{block % 256 + 1}"
        self.ip = f"10.213.{block // 256}.{block % 256 + 2}"
        token = self.name[-4:]
        self.veth_host, self.veth_node = f"ge{os.getpid() % 100000}{token}h", f"ge{token}n"
        # What each child writes before exec, computed here: the child should only make calls.
        self._cgroup_procs = [str(h / self.name / "node" / "cgroup.procs") for h in _hierarchies()]
        self._netns = f"/run/netns/{self.name}"

    # ----- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 180) -> "Node":
        RUNS.mkdir(parents=True, exist_ok=True)
        self.dir.mkdir()
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        deadline = time.monotonic() + timeout
        try:
            self._make_cgroups()
            self._make_network()
            self.cp = ControlPlane(
                self.bin_dir, self.dir / "cp", host=self.ip, preexec=self._enter,
                # PersistentVolumeClaims (the model cache): binding, and the protection
                # finalizers' removal, so a namespace with a claim can be deleted.
                controllers=(*CONTROLLERS, "node-lifecycle-controller", "persistentvolume-binder-controller",
                             "persistentvolume-protection-controller",
                             "persistentvolumeclaim-protection-controller"),
                # kubectl logs/exec: the apiserver dials the kubelet at the node's InternalIP.
                apiserver_args=("--kubelet-preferred-address-types=InternalIP",))
            (self.dir / "cp").mkdir()
            self.cp.start(timeout=max(30.0, deadline - time.monotonic()))
            self.kubeconfig = self.cp.kubeconfig
            self._dnat_kubernetes_service()
            self._start_containerd(deadline)
            self._start_coredns()
            self._start_scheduler()
            self._start_kubelet()
            self._wait_node_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Pods and containers first (so their mounts and sandboxes go the normal way), then
        every process, mount, cgroup and the namespace. Safe to call more than once."""
        kubelet = self.procs.pop("kubelet", None)
        if kubelet:
            _kill_group(kubelet)
        if "containerd" in self.procs:
            with contextlib.suppress(Exception):
                self._remove_containers()
        for proc in reversed(list(self.procs.values())):
            _kill_group(proc, grace=5)
        self.procs.clear()
        if self.cp:
            self.cp.stop(keep_dir=True)
        if self._root_lock_fd is not None:
            os.close(self._root_lock_fd)
            self._root_lock_fd = None
        if self.dir.exists():
            keep = os.environ.get("GRPO_KEEP_E2E_LOGS")      # a folder to copy the logs to
            if keep:
                for logs in ("cp", "pod-logs"):       # the components' logs, the containers' logs
                    with contextlib.suppress(OSError):
                        shutil.copytree(self.dir / logs, Path(keep) / self.name / logs, dirs_exist_ok=True)
            _remove_run(self.name)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- host-side plumbing -------------------------------------------------------------------

    def _make_cgroups(self) -> None:
        for h in _hierarchies():
            (h / self.name / "node").mkdir(parents=True)
            if (h / "cpuset.cpus").exists():   # a v1 cpuset cgroup starts empty: inherit the parent's
                for d in (h / self.name, h / self.name / "node"):
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        (d / f).write_text((d.parent / f).read_text())

    def _enter(self) -> None:
        """Runs in each child before exec: into the run's cgroups and network namespace."""
        for procs in self._cgroup_procs:
            with open(procs, "w") as f:
                f.write("0")
        fd = os.open(self._netns, os.O_RDONLY)
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            os._exit(126)
        os.close(fd)

    def _make_network(self) -> None:
        ns = ("ip", "netns", "exec", self.name)
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_node)
        _run("ip", "link", "set", self.veth_node, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth_host)
        _run("ip", "link", "set", self.veth_host, "up")
        _run(*ns, "ip", "addr", "add", f"{self.ip}/30", "dev", self.veth_node)
        _run(*ns, "ip", "link", "set", self.veth_node, "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        # The bridge exists before CoreDNS binds its address; the CNI plugin adopts it.
        _run(*ns, "ip", "link", "add", BRIDGE, "type", "bridge")
        _run(*ns, "ip", "addr", "add", f"{POD_GATEWAY}/24", "dev", BRIDGE)
        _run(*ns, "ip", "link", "set", BRIDGE, "up")

    def _dnat_kubernetes_service(self) -> None:
        """In-cluster clients (the operator) use https://10.0.0.1:443: send it to the apiserver."""
        for chain in ("PREROUTING", "OUTPUT"):
            _run("ip", "netns", "exec", self.name, "iptables", "-t", "nat", "-A", chain, "-d", SERVICE_IP,
                 "-p", "tcp", "--dport", "443", "-j", "DNAT", "--to-destination", f"{self.ip}:{self.cp.port}")

    def _spawn(self, name: str, args: list[str], binary: str | None = None) -> subprocess.Popen:
        proc = self.cp._spawn(name, args, binary=binary)   # its log, process group, death signal, preexec
        self.procs[name] = self.cp.procs.pop(name)
        return proc

    # ----- containerd ---------------------------------------------------------------------------

    def _containerd_root(self, deadline: float) -> Path:
        """The content store and snapshots are cached across runs (importing the images costs
        minutes); one run at a time uses the cache, a concurrent one gets a private root, except
        while `preimport` (scripts/test.sh, in the background) fills the cache: then wait for it."""
        shared = self.cache_dir / "containerd-root"
        shared.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.cache_dir / "containerd-root.lock", os.O_RDWR | os.O_CREAT, 0o600)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not _preimport_running(self.cache_dir) or time.monotonic() > deadline:
                    os.close(fd)
                    return self.dir / "containerd-root"
                time.sleep(1)
        self._root_lock_fd = fd
        return shared

    def preimport(self, timeout: float = 3600) -> None:
        """Import the images into the cached containerd root, then stop: scripts/test.sh runs this
        in the background while the other tests run, so that tests/e2e's node starts with them in
        place (a node waits for it, `_containerd_root`). containerd alone, without its CRI plugin:
        the node's containerd loads the images the root holds when it starts."""
        RUNS.mkdir(parents=True, exist_ok=True)
        self.dir.mkdir()
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)   # alive for clean_stale
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        marker = self.cache_dir / "containerd-root.preimport"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        root_fd = os.open(self.cache_dir / "containerd-root.lock", os.O_RDWR | os.O_CREAT, 0o600)
        proc = None
        try:
            fcntl.flock(root_fd, fcntl.LOCK_EX)           # another run's node has the cache: after it
            d = self.dir
            self.containerd_sock = d / "ctrd" / "containerd.sock"
            (d / "ctrd").mkdir()
            (self.cache_dir / "containerd-root").mkdir(exist_ok=True)
            (d / "containerd.toml").write_text(f"""version = 2
root = "{self.cache_dir / 'containerd-root'}"
state = "{d / 'ctrd' / 'state'}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{self.containerd_sock}"
[ttrpc]
  address = "{d / 'ctrd' / 'ttrpc.sock'}"
[debug]
  address = "{d / 'ctrd' / 'debug.sock'}"
""")
            with open(d / "containerd.log", "wb") as log:
                proc = subprocess.Popen([shutil.which("containerd"), "--config", str(d / "containerd.toml")],
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 60
            while not self.containerd_sock.exists() or self.ctr("version", check=False).returncode:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ControlPlaneError(f"containerd did not start: {(d / 'containerd.log').read_text()[-2000:]}")
                time.sleep(0.2)
            self._import_images()
        finally:
            if proc is not None:
                _kill_group(proc, grace=10)
            marker.unlink(missing_ok=True)
            os.close(root_fd)
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _start_containerd(self, deadline: float) -> None:
        d = self.dir
        self.containerd_sock = d / "ctrd" / "containerd.sock"
        (d / "ctrd").mkdir()
        (d / "cni-conf").mkdir()
        (d / "cni-conf" / "10-grpo-e2e.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": self.name, "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isDefaultGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(d / "cni-ipam"),
                          "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]]}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}))
        root = self._containerd_root(deadline)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (d / "containerd.toml").write_text(f"""version = 2
root = "{root}"
state = "{d / 'ctrd' / 'state'}"
[grpc]
  address = "{self.containerd_sock}"
[ttrpc]
  address = "{d / 'ctrd' / 'ttrpc.sock'}"
[debug]
  address = "{d / 'ctrd' / 'debug.sock'}"
[{cri}]
  sandbox_image = "{self.pause_image}"
  # root here lacks CAP_SYS_RESOURCE: runc can't lower oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  # Pod network namespaces under our state dir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d / 'cni-conf'}"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d / 'runc'}"
""")
        self._spawn("containerd", ["--config", str(d / "containerd.toml")], binary=shutil.which("containerd"))
        while not self.containerd_sock.exists() or self.ctr("version", check=False).returncode:
            if self.procs["containerd"].poll() is not None or time.monotonic() > deadline:
                raise ControlPlaneError(f"containerd did not start:\n{self.cp.log_tail('containerd')}")
            time.sleep(0.2)
        self._remove_containers()     # a cached root may hold a killed run's containers
        self._import_images()

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return _run("ctr", "--address", str(self.containerd_sock), "--namespace", "k8s.io", *args, check=check,
                    timeout=timeout)

    def _remove_containers(self) -> None:
        for cid in self.ctr("containers", "list", "--quiet").stdout.split():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", cid, check=False)
            for _ in range(50):
                if self.ctr("tasks", "delete", cid, check=False).returncode == 0 or \
                        cid not in self.ctr("tasks", "list", "--quiet").stdout.split():
                    break
                time.sleep(0.1)
            self.ctr("containers", "delete", cid, check=False)

    def _import_images(self) -> None:
        present = set(self.ctr("images", "list", "--quiet").stdout.split())
        for ref, export in self.images.items():
            if ref in present:
                continue
            # Streamed through a FIFO: an image with torch is ~6 GB, not worth writing out.
            fifo = self.dir / "image.fifo"
            os.mkfifo(fifo)
            writer = export(fifo)
            try:
                self.ctr("images", "import", str(fifo), timeout=1800)
                if writer.wait(60):
                    raise ControlPlaneError(f"exporting {ref} failed: exit {writer.returncode}")
            finally:
                if writer.poll() is None:
                    writer.kill()
                    writer.wait()
                fifo.unlink()
        # Images of earlier contents only take space: other tags of ours, and the references by image
        # id (`sha256:...`) that the CRI plugin adds beside every imported image, which kept every
        # earlier image's layers (44 GB after a day of rebuilds). --sync: their content is collected
        # now; containerd's own collection may not run before this node stops.
        listed = [line.split()[:3] for line in self.ctr("images", "list").stdout.splitlines()[1:]]
        current = {digest for ref, _, digest in listed if ref in self.images}
        stale = [ref for ref, _, digest in listed if ref not in self.images and digest not in current
                 and ref.startswith(("localhost/grpo-e2e/", "sha256:"))]
        if stale:
            self.ctr("images", "remove", "--sync", *stale, check=False, timeout=600)

    # ----- node components ----------------------------------------------------------------------

    def _start_coredns(self) -> None:
        (self.dir / "Corefile").write_text(f""".:53 {{
    bind {POD_GATEWAY}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self.kubeconfig} test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
}}
""")
        self._spawn("coredns", ["-conf", str(self.dir / "Corefile")], binary=str(self.bin_dir / "coredns"))

    def _start_scheduler(self) -> None:
        self._spawn("kube-scheduler", [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                                       f"--bind-address={self.ip}", "--secure-port=10259"])

    def _start_kubelet(self) -> None:
        d = self.dir
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # This host has cgroup v1 only (deprecated, still supported with this switch).
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.name}",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "address": self.ip, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": self.ip, "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDNS": [POD_GATEWAY], "clusterDomain": "cluster.local",
            "resolvConf": str(d / "resolv.conf"),
            # A small shared disk and memory: never evict test pods, never collect their images.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "syncFrequency": "5s", "fileCheckFrequency": "5s", "nodeStatusUpdateFrequency": "5s",
            "podLogsDir": str(d / "pod-logs"), "volumePluginDir": str(d / "volume-plugins"),
            "serializeImagePulls": False, "maxPods": 50,
        }
        (d / "resolv.conf").write_text("")   # pods get only CoreDNS; there is no upstream
        (d / "kubelet.json").write_text(json.dumps(config, indent=1))
        self._spawn("kubelet", [
            f"--config={d / 'kubelet.json'}", f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={d / 'kubelet'}", f"--cert-dir={d / 'kubelet-pki'}",
            f"--hostname-override={self.name}", f"--node-ip={self.ip}", "--v=1"])

    def _wait_node_ready(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            for name in ("kubelet", "containerd", "coredns", "kube-scheduler"):
                if self.procs[name].poll() is not None:
                    raise ControlPlaneError(f"{name} exited:\n{self.cp.log_tail(name)}")
            with contextlib.suppress(Exception):
                node = self.cp.request("GET", f"/api/v1/nodes/{self.name}")
                ready = [c for c in node["status"].get("conditions", []) if c["type"] == "Ready"]
                taints = [t for t in node["spec"].get("taints", []) if t["effect"] in ("NoSchedule", "NoExecute")]
                last = json.dumps({"ready": ready, "taints": taints})
                if ready and ready[0]["status"] == "True" and not taints:
                    return
            time.sleep(0.5)
        raise ControlPlaneError(f"node {self.name} not Ready: {last}\n{self.cp.log_tail('kubelet')}")
