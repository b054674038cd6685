"""`grpo from-verl` of verl's multi-turn keys (actor_rollout_ref.rollout.multi_turn.*), of its
GSM8K tool-agent example's command line, and of the tool-agent dataset layout (a top-level
agent_name column, tools_kwargs in extra_info)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_api.from_verl import translate
from grpo_api.spec import DataSpec
from grpo_api.storage import Storage
from grpo_api.verl_command import read_command
from grpo_rollout import tiny
from grpo_trainer.data import load_prompts

# verl's examples/sglang_multiturn/run_qwen2_5_3b_gsm8k_multiturn_vllm_fsdp.sh, with the
# multi_turn block its config (gsm8k_multiturn_grpo.yaml) sets, and the data it trains on.
VERL_GSM8K_TOOL_AGENT = """
python3 -m verl.trainer.main_ppo \\
    actor_rollout_ref.rollout.name=vllm \\
    algorithm.adv_estimator=grpo \\
    data.train_batch_size=32 \\
    data.max_prompt_length=1024 \\
    data.max_response_length=1024 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    data.return_raw_chat=True \\
    actor_rollout_ref.model.path="Qwen/Qwen2.5-3B-Instruct" \\
    actor_rollout_ref.actor.optim.lr=1e-6 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\
    actor_rollout_ref.rollout.n=8 \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 \\
    data.train_files=/data/gsm8k/train.parquet \\
    data.val_files=/data/gsm8k/test.parquet \\
    trainer.total_epochs=15 \\
    actor_rollout_ref.rollout.mode=async \\
    actor_rollout_ref.rollout.multi_turn.enable=true \\
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \\
    actor_rollout_ref.rollout.multi_turn.format=hermes \\
    actor_rollout_ref.rollout.multi_turn.tool_config_path=/verl/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml
"""


def test_verls_gsm8k_tool_agent_example_translates():
    t = translate(read_command(VERL_GSM8K_TOOL_AGENT))
    assert t.errors == [], t.errors
    assert t.doc["spec"]["rollout"]["multiTurn"] == {
        "enable": True, "maxAssistantTurns": 5, "format": "hermes",
        "toolConfigPath": "/verl/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"}
    mt = t.job.spec.rollout.multi_turn
    assert (mt.max_parallel_calls, mt.max_tool_response_length, mt.tool_response_truncate_side) == (1, 256, "middle")
    assert not any("multi_turn" in w for w in t.warnings), t.warnings


@pytest.mark.parametrize("override, expected", [
    ("max_user_turns=2 actor_rollout_ref.rollout.multi_turn.max_parallel_calls=4",
     {"maxUserTurns": 2, "maxParallelCalls": 4}),
    ("max_tool_response_length=1024 actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
     {"maxToolResponseLength": 1024, "toolResponseTruncateSide": "left"}),
    ("max_assistant_turns=null", {"maxAssistantTurns": None}),   # null: no limit but the length, as in verl
])
def test_multi_turn_keys(override, expected):
    base = VERL_GSM8K_TOOL_AGENT.replace("    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \\\n", "")
    t = translate(read_command(base.rstrip() + f" actor_rollout_ref.rollout.multi_turn.{override}"))
    assert t.errors == [], t.errors
    got = {k: v for k, v in t.doc["spec"]["rollout"]["multiTurn"].items()
           if k not in ("enable", "format", "toolConfigPath")}
    assert got == expected


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=/cfg/interaction.yaml",
     "interactions (simulated users) are not supported"),
    ("actor_rollout_ref.rollout.multi_turn.format=gpt-oss", "'gpt-oss'"),
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path=/cfg/agent_loops.yaml",
     "port the loop to spec.rollout.agentLoop"),
])
def test_what_we_do_not_have_is_an_error(override, message):
    t = translate(read_command(VERL_GSM8K_TOOL_AGENT.rstrip() + " " + override))
    assert any(message in e for e in t.errors), t.errors


def test_verl_agent_loop_workers_are_not_a_setting_here():
    t = translate(read_command(VERL_GSM8K_TOOL_AGENT.rstrip() + " actor_rollout_ref.rollout.agent.num_workers=8"))
    assert t.errors == [], t.errors
    assert any("agent.num_workers" in w and "runs in each rollout server" in w for w in t.warnings), t.warnings


def test_enable_without_a_tool_names_the_field():
    cmd = VERL_GSM8K_TOOL_AGENT.replace(
        "    actor_rollout_ref.rollout.multi_turn.tool_config_path=/verl/examples/sglang_multiturn/config/"
        "tool_config/gsm8k_tool_config.yaml\n", "")
    t = translate(read_command(cmd))
    assert any("rollout.multiTurn.tools" in e and "needs at least one tool" in e for e in t.errors), t.errors


def test_the_tool_agent_dataset_layout_reaches_the_agent_loop(tmp_path):
    """verl's gsm8k_tool_agent_loop.py rows: agent_name beside the prompt, tools_kwargs in
    extra_info. Both reach the prompt shard's extra_info, where the agent loop reads them."""
    rows = [{"data_source": "openai/gsm8k", "agent_name": "tool_agent",
             "prompt": [{"role": "user", "content": "copy the digit 3"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "3"},
             "extra_info": {"index": 0, "need_tools_kwargs": True,
                            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "3"}}}}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    spec = DataSpec(train_files=[str(path)], max_prompt_length=64)
    dataset = load_prompts([f"file://{path}"], spec, tiny.build_tokenizer(), Storage())
    extra = json.loads(dataset.rows[0].extra_info)
    assert extra["agent_name"] == "tool_agent"
    assert extra["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "3"}}}


# The tools block as Qwen3's template writes one: every tool adds its name to a system turn.
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}{{- t.function.name + ' ' }}"
                  "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + tiny.CHAT_TEMPLATE)
SCHEMAS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def test_filter_overlong_prompts_measures_a_tool_agents_prompt_with_the_tools(tmp_path):
    """As verl's dataset does, a tool agent's prompt is measured with the tools' schemas (those the
    rollout servers report): a row that fits alone but not with the tools is filtered
    (filterOverlongPrompts) or refused naming the row; a single_turn_agent row is measured alone."""
    from grpo_trainer.data import DataError
    tok = tiny.build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "copy the digit 3"}]
    alone = len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    with_tools = len(tok.apply_chat_template(messages, tools=SCHEMAS, add_generation_prompt=True,
                                             tokenize=True)["input_ids"])
    assert with_tools > alone
    rows = [{"data_source": "openai/gsm8k", "prompt": messages, "reward_model": {"ground_truth": "3"},
             "extra_info": {"index": i, **({"agent_name": agent} if agent else {})}}
            for i, agent in enumerate([None, "single_turn_agent", "tool_agent"])]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    uri = f"file://{path}"

    fits_alone = DataSpec(train_files=[str(path)], max_prompt_length=with_tools - 1, filter_overlong_prompts=True)
    dataset = load_prompts([uri], fits_alone, tok, Storage(), tool_schemas=SCHEMAS)
    assert dataset.filtered == 2 and [json.loads(r.extra_info)["index"] for r in dataset.rows] == [1]
    assert len(dataset.rows[0].prompt_ids) == alone
    assert load_prompts([uri], fits_alone, tok, Storage()).filtered == 0     # without tools, as before
    assert load_prompts([uri], fits_alone.model_copy(update={"max_prompt_length": with_tools}), tok, Storage(),
                        tool_schemas=SCHEMAS).filtered == 0
    refused = fits_alone.model_copy(update={"filter_overlong_prompts": False, "truncation": "left"})
    with pytest.raises(DataError, match=rf"row 0 has a {with_tools}-token prompt with the tools' schemas"):
        load_prompts([uri], refused, tok, Storage(), tool_schemas=SCHEMAS)
