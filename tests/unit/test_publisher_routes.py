"""The weight publisher's routing (grpo_trainer.publisher.plan_routes), hand-worked: CUDA IPC only
when every server answered Info from the trainer's own GPU; with a LoRA policy (not merged) the
adapters alone to the servers that take them, the merged weights to the others; a server that
didn't answer Info gets what the others get. On real servers: tests/rollout/test_weight_sync.py
(the publisher sending adapters and, with lora.merge, merged weights) and
tests/integration/test_lora.py (a mixed fleet through a whole run)."""

import pytest

from grpo_trainer.publisher import plan_routes

W = ["a:1", "b:1", "c:1"]
HERE, ELSEWHERE = True, False          # on the trainer's GPU
ADAPTERS, MERGED = True, False         # what the server takes (Info.accepts_lora_adapters)


@pytest.mark.parametrize("adapters_wanted", [False, True])
def test_every_server_on_the_trainers_gpu_is_sent_the_buffer_by_cuda_ipc(adapters_wanted):
    known = {w: (HERE, ADAPTERS) for w in W}
    assert plan_routes(W, known, adapters_wanted=adapters_wanted) == ("ipc", W, [])


def test_one_server_elsewhere_or_silent_sends_whole_weights_to_all():
    elsewhere = {"a:1": (HERE, MERGED), "b:1": (ELSEWHERE, MERGED), "c:1": (HERE, MERGED)}
    assert plan_routes(W, elsewhere, adapters_wanted=False) == ("send", [], W)
    silent = {"a:1": (HERE, MERGED), "b:1": (HERE, MERGED)}          # c:1 didn't answer Info
    assert plan_routes(W, silent, adapters_wanted=False) == ("send", [], W)
    assert plan_routes(W, {}, adapters_wanted=False) == ("send", [], W)


def test_a_lora_policy_goes_as_adapters_to_servers_that_take_them_and_merged_to_the_rest():
    known = {"a:1": (ELSEWHERE, ADAPTERS), "b:1": (ELSEWHERE, MERGED), "c:1": (HERE, ADAPTERS)}
    assert plan_routes(W, known, adapters_wanted=True) == ("send", ["a:1", "c:1"], ["b:1"])
    # a server that didn't answer goes with the adapters (no merged gather on its account)
    assert plan_routes(W, {"b:1": (ELSEWHERE, MERGED)}, adapters_wanted=True) == ("send", ["a:1", "c:1"], ["b:1"])
    assert plan_routes(W, {}, adapters_wanted=True) == ("send", W, [])
    # every server takes only merged weights (vLLM): no adapters sent at all
    assert plan_routes(W, {w: (ELSEWHERE, MERGED) for w in W}, adapters_wanted=True) == ("send", [], W)
