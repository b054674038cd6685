"""The node fixture leaves nothing behind, even when its pytest is killed with SIGKILL, and two
runs don't collide: a second node starts beside the session's, runs a pod, is kill -9'ed with
its pytest stand-in, and the next run's clean_stale() removes every trace of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .e2e_helpers import REPO, wait_for
from .node import PREFIX, RUNS, _cgroup_pids, _every_hierarchy, clean_stale

# The first test to use the cluster also pays for starting it, which includes importing new
# images into containerd (~12 min for the two torch images) when the sources changed.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

CHILD = textwrap.dedent("""
    import json, subprocess, sys, time
    sys.path.insert(0, {tests!r})
    from e2e.node import Node
    pause = {pause!r}
    def export(path):
        return subprocess.Popen([{script!r}, "--export", pause, str(path)])
    node = Node(images={{pause: export}}, pause_image=pause).start(timeout=600)
    print(json.dumps({{"name": node.name, "kubeconfig": str(node.kubeconfig)}}), flush=True)
    time.sleep(3600)
""")


def _leftovers(name: str) -> list[str]:
    found = []
    if (RUNS / name).exists():
        found.append(str(RUNS / name))
    if name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        found.append(f"netns {name}")
    found += [str(h / name) for h in _every_hierarchy() if (h / name).exists()]     # v2's unified too
    mounts = Path("/proc/self/mountinfo").read_text()
    if str(RUNS / name) in mounts:
        found.append("mounts under " + str(RUNS / name))
    return found


def _alive(pid: int) -> bool:
    """A killed process whose parent died stays a zombie until PID 1 reaps it, and this machine's
    PID 1 is not an init that reaps promptly: a zombie is dead, only its /proc entry is left."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_run_is_removed_by_the_next_and_runs_do_not_collide(cluster):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(
        tests=str(REPO / "tests"), pause=cluster.images["pause"], script=str(REPO / "scripts" / "build-images.sh"))],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(child.stdout.readline())
    except json.JSONDecodeError:
        child.kill()
        pytest.fail("the second node did not start")
    name = info["name"]
    assert name.startswith(PREFIX) and name != cluster.node.name
    kubectl = [cluster.kubectl_bin, "--kubeconfig", info["kubeconfig"]]
    subprocess.run([*kubectl, "run", "sleeper", f"--image={cluster.images['pause']}", "--restart=Never"],
                   check=True, capture_output=True)
    wait_for("the second node's pod to run", lambda: json.loads(subprocess.run(
        [*kubectl, "get", "pod", "sleeper", "-o", "json"], capture_output=True, text=True).stdout or "{}")
        .get("status", {}).get("phase") == "Running", timeout=300)
    pod_processes = _cgroup_pids(name)
    assert pod_processes

    os.kill(child.pid, signal.SIGKILL)       # no teardown runs: shims and the pod outlive it
    child.wait()
    assert _leftovers(name), "a killed run should have left something for clean_stale to find"
    # The session's own node is alive and untouched by the other run and by its cleanup.
    assert name in clean_stale()
    assert not _leftovers(name), _leftovers(name)
    wait_for("the killed run's pod processes to be gone",
             lambda: not [p for p in pod_processes if _alive(p)], timeout=60)
    node = cluster.get("node", cluster.node.name)
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
