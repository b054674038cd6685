"""Colocated placement (issue 46, verl's hybrid engine): the spec's rules, the CRD's CEL rules,
the pod's supervisor stopped while its servers load."""

import signal
import subprocess
import sys

import pytest
import yaml

from grpo_api.contracts import STOPPED_EXIT_CODE
from grpo_api.crd import build_crd
from grpo_api.jobfile import JobError, parse_job
from polling import wait_until

BASE = {"model": {"path": "Qwen/Qwen3-1.7B"}, "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 16},
        "trainer": {"miniBatchSize": 8, "microBatchSizePerGPU": 1}}


def job(rollout=None, trainer=None):
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "demo"},
            "spec": {**BASE, "rollout": rollout or {}, "trainer": {**BASE["trainer"], **(trainer or {})}}}


def errors_of(doc):
    with pytest.raises(JobError) as info:
        parse_job(doc)
    return info.value.errors


def test_separate_stays_the_default_and_replicas_are_free():
    spec = parse_job(job({"replicas": 3})).spec
    assert spec.rollout.placement == "separate" and not spec.colocated and spec.rollout.replicas == 3


def test_colocated_replicas_are_the_trainer_gpus_over_tensor_parallel():
    # the seed's verl command: 4 GPUs per node, tensor parallel 2 -> 2 servers on each trainer pod
    spec = parse_job(job({"placement": "colocated", "tensorParallelSize": 2, "replicas": 4},
                         {"nnodes": 2, "nprocPerNode": 4})).spec
    assert spec.colocated and spec.servers_per_node == 2 and spec.rollout.replicas == 4


@pytest.mark.parametrize("rollout, trainer, field, reason", [
    ({"placement": "colocated"}, {"nprocPerNode": 4}, "spec.rollout.replicas",
     "must be nnodes x nprocPerNode / tensorParallelSize = 4 with placement colocated"),
    ({"placement": "colocated", "replicas": 3, "tensorParallelSize": 2}, {"nnodes": 2, "nprocPerNode": 4},
     "spec.rollout.replicas", "= 4 with placement colocated (the trainer pods run the servers on their own GPUs; "
     "set it to 4) (got 3)"),
    ({"placement": "colocated", "tensorParallelSize": 3}, {"nprocPerNode": 4}, "spec.rollout.tensorParallelSize",
     "must divide trainer.nprocPerNode with placement colocated"),
    # offload frees the GPUs for engines that share them, between the phases
    ({}, {"paramOffload": True}, "spec.trainer.paramOffload", "need rollout.placement colocated and "
     "rollout.maxStaleness 0 (else nothing shares the GPUs, or generation overlaps the update)"),
    ({"placement": "colocated", "maxStaleness": 1}, {"optimizerOffload": True}, "spec.trainer.paramOffload",
     "need rollout.placement colocated and rollout.maxStaleness 0"),
])
def test_colocated_refuses_what_it_cannot_place(rollout, trainer, field, reason):
    errors = errors_of(job(rollout, trainer))
    assert any(e.startswith(field + ":") and reason in e for e in errors), errors
    # tensorParallelSize not dividing is reported once, not again as a replicas error
    assert len(errors) == 1, errors


def test_offload_with_colocated_synchronous_engines():
    spec = parse_job(job({"placement": "colocated"}, {"paramOffload": True, "optimizerOffload": True})).spec
    assert spec.trainer.param_offload and spec.trainer.optimizer_offload


def test_placement_is_an_enum_named_in_the_error():
    errors = errors_of(job({"placement": "hybrid"}))
    assert any(e.startswith("spec.rollout.placement:") and "colocated" in e for e in errors), errors


def test_crd_carries_the_colocated_rules():
    version = build_crd()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    placement = spec["properties"]["rollout"]["properties"]["placement"]
    assert placement["enum"] == ["separate", "colocated"] and placement["default"] == "separate"
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    replicas = next(rule for message, rule in rules.items() if message.startswith("rollout.replicas must be nnodes"))
    assert ("self.rollout.replicas == self.trainer.nnodes * (self.trainer.nprocPerNode / "
            "self.rollout.tensorParallelSize)") in replicas
    assert any("self.trainer.nprocPerNode % self.rollout.tensorParallelSize == 0" in r for r in rules.values())


STOPPED_WHILE_LOADING = """
import pathlib, sys, time
from grpo_trainer import colocate

def start(self, timeout):           # the servers load (vLLM: minutes)
    pathlib.Path(sys.argv[2]).touch()
    time.sleep(600)

colocate.ColocatedServers.start = start
colocate.ColocatedServers.stop = lambda self, grace=10.0: None
sys.exit(colocate.run(["--spec", sys.argv[1], "--ports", "50051", "--torchrun"], lambda args: 0))
"""


def test_a_sigterm_while_the_colocated_servers_load_is_a_stop(tmp_path):
    """Issue 48: a trainer pod deleted while its colocated servers load exits STOPPED_EXIT_CODE (the
    trainer Job's pod failure policy replaces it without using a restart), as it does once torchrun
    runs its workers; it used to die of the SIGTERM (143: a restart used)."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job({"placement": "colocated"}, {"nprocPerNode": 1})))
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_WHILE_LOADING, str(spec), str(started)],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: started.exists() or proc.poll() is not None, 60, what="the servers' start")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == STOPPED_EXIT_CODE, err[-3000:]
    assert err.strip().splitlines()[-1] == "trainer stopped by SIGTERM", err[-3000:]


def test_each_colocated_server_serves_metrics_on_its_own_port(monkeypatch):
    """`--metrics-ports`: server i is started with the i-th, as `grpo rollout` reads its flags, so
    Prometheus finds each server of the pod on its own declared port."""
    from grpo_rollout.serve import _parser
    from grpo_trainer import colocate

    started = []

    class ReadyServer:             # a `grpo rollout` that is ready at once
        def __init__(self, argv, **_):
            started.append(argv)
            self.stdout, self.returncode = iter([colocate.ROLLOUT_READY_PREFIX + "{}\n"]), None

        def poll(self):
            return None

    monkeypatch.setattr(colocate.subprocess, "Popen", ReadyServer)
    servers = colocate.ColocatedServers("job.yaml", [50051, 50052], tensor_parallel_size=1, gpus=False, node_rank=1,
                                        extra_args=["--grace=3"], metrics_ports=[9091, 9092])
    servers.start(timeout=60)
    parsed = [_parser().parse_args(argv[argv.index("rollout") + 1:]) for argv in started]
    assert [(a.port, a.metrics_port, a.worker_id, a.grace) for a in parsed] == [
        (50051, 9091, "trainer-1-rollout-0", 3.0), (50052, 9092, "trainer-1-rollout-1", 3.0)]


def test_metrics_ports_must_name_one_port_per_server(tmp_path):
    from grpo_trainer import colocate
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job({"placement": "colocated"}, {"nprocPerNode": 1})))
    with pytest.raises(SystemExit, match="--metrics-ports names 2 ports for 1 servers"):
        colocate.run(["--spec", str(spec), "--ports", "50051", "--metrics-ports", "9091,9092", "--torchrun"],
                     lambda args: 0)
