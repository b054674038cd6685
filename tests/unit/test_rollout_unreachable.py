"""What the trainer says when no rollout server can generate (issue 48, item 12): it named DNS
("DNS server returned general failure") when a reward server crash-looped. It must name what it
dialled and say that the servers (or the ones they call) are not ready, where to look, and keep
the last error for the record."""

from concurrent import futures

import grpc
import pytest

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.proto import rollout_pb2_grpc as pb_grpc
from grpo_api.records import RunLayout
from grpo_api.storage import Storage
from grpo_trainer.rollout_client import RolloutDispatcher
from grpo_trainer.rollout_servers import Discovery, RolloutServers

# What a rollout server answers when its reward model has no ready pod (server.py maps
# RewardModelUnavailable to UNAVAILABLE with its message; this is the one seen on the node).
REWARD_DOWN = ("reward model rm: no replica scored the batch within 5s (spec.reward.rewardModels[].timeoutSeconds); "
               "last errors: dns:///demo-rm-rm.team-a.svc:50051: UNAVAILABLE DNS resolution failed for "
               "demo-rm-rm.team-a.svc:50051: C-ares status is not ARES_SUCCESS qtype=A name=demo-rm-rm.team-a.svc "
               "is_balancer=0: DNS server returned general failure")


class RewardModelDown(pb_grpc.RolloutServicer):
    def Generate(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, REWARD_DOWN)


class AtEveryVersion:     # the VersionKeeper of a server that needs no new weights here
    def ensure_version(self, worker: str, version: int) -> None:
        pass


@pytest.fixture
def reward_down_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RolloutServicer_to_server(RewardModelDown(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_a_shard_no_server_can_generate_names_the_servers_and_where_to_look(tmp_path, reward_down_server):
    servers = RolloutServers(Discovery(reward_down_server), "token")
    dispatcher = RolloutDispatcher(servers, weights=AtEveryVersion(), layout=RunLayout(f"file://{tmp_path}/run"),
                                   storage=Storage(), timeout=1)
    with pytest.raises(RuntimeError) as err:
        dispatcher.generate(1, "train", {"s0": b"prompts"}, pb.SamplingParams(n=2, max_tokens=2), version=0)
    said = str(err.value)
    assert said.startswith(f"rollout shard s0: no rollout server at {reward_down_server} could generate it for 1s: "
                           "the rollout server pods are not ready, or a server they call (a reward model, the python "
                           "sandbox) is not; on Kubernetes the GRPOJob's ServersFailing condition")
    # The evidence stays, last: it is where the DNS words are.
    assert said.endswith(f"Last error on {reward_down_server}: {REWARD_DOWN}")
    assert "no rollout server reachable" not in said


def test_a_service_name_with_no_ready_pod_is_named_as_such():
    """A headless Service with no ready pod has no address: the name is what the user must look at."""
    where = "dns:///demo-rollout.team-a.svc.invalid:50051"     # .invalid never resolves (RFC 6761)
    servers = RolloutServers(Discovery(where), "token")
    with pytest.raises(RuntimeError, match=rf"^no rollout server is ready at {where} after 0s: the rollout server "
                                           r"pods are not ready, or a server they call"):
        servers.addresses(wait_seconds=0)


class OutOfMemoryThenBroken(pb_grpc.RolloutServicer):
    """vLLM's wake-up on a GPU the trainer still held (H100, 12-07): out of memory once, then
    "invalid argument" on every retry, its allocator left half-mapped."""
    def __init__(self):
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        what = "out of memory at cumem_allocator.cpp:163" if self.calls == 1 else \
            "invalid argument at cumem_allocator.cpp:169"
        context.abort(grpc.StatusCode.INTERNAL, f"Exception: Call to wake_up method failed: CUDA Error: {what}")


def test_a_shard_that_keeps_failing_names_the_first_error_beside_the_last(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RolloutServicer_to_server(OutOfMemoryThenBroken(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        dispatcher = RolloutDispatcher(RolloutServers(Discovery(address), "token"), weights=AtEveryVersion(),
                                       layout=RunLayout(f"file://{tmp_path}/run"), storage=Storage(), timeout=5,
                                       max_attempts=3)
        with pytest.raises(RuntimeError) as err:
            dispatcher.generate(1, "train", {"s0": b"prompts"}, pb.SamplingParams(n=2, max_tokens=2), version=0)
    finally:
        server.stop(grace=None)
    wake = "Exception: Call to wake_up method failed: CUDA Error:"
    assert str(err.value) == (f"rollout shard s0 failed 3 times; first error on {address}: {wake} out of memory at "
                              f"cumem_allocator.cpp:163; last error on {address}: {wake} invalid argument at "
                              f"cumem_allocator.cpp:169")
