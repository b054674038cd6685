"""The agent loop (verl's ToolAgentLoop): multi-turn, tool-using generation on the rollout server.

Each sample is a trajectory of token ids. A turn gives the engine the trajectory's ids as they
are and appends exactly the ids it sampled (mask 1, with their behaviour logprobs); when the turn
holds tool calls (Hermes `<tool_call>{json}</tool_call>`), the calls run at once on a
`ToolRunner` and their answers are appended as the ids of the chat template's tool turn, rendered
on their own (mask 0, logprob 0). Nothing the engine sampled is ever decoded and re-encoded
(token-in/token-out: the trainer scores exactly the tokens the engine was given and sampled);
text is decoded only to find the calls and, at the end, for the reward.

A trajectory ends when a model turn has no tool call, at EOS after its answer, at
data.maxResponseLength (a tool turn that doesn't fit is dropped, so a trajectory ends on model
tokens), or at maxAssistantTurns / maxUserTurns (the last call is then not run).

A tool agent's prompt is its row's messages rendered again with the tools' schemas
(`apply_chat_template(messages, tools=...)`, as verl's ToolAgentLoop and TRL's `tools=` do), so
the model reads what it may call; the records keep that prompt, the one the engine was given.

Per row, `extra_info.agent_name` picks the loop ("tool_agent", the default with multiTurn, or
"single_turn_agent": one plain turn), and `extra_info.tools_kwargs[<tool>].create_kwargs` the
environment arguments of each tool (verl's dataset layout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from grpo_api.spec import MultiTurnSpec
from grpo_rollout.engine import Engine, Sample, SamplingParams
from grpo_rollout.shard import Prompt
from grpo_rollout.tools import ToolResult, ToolRunner
from grpo_rollout.tools.hermes import CLOSE, parse_tool_calls

log = logging.getLogger(__name__)

AGENTS = ("tool_agent", "single_turn_agent")
_MARK = "<<grpo-agent-loop-turn-end>>"   # where the model's turn ends in a rendered conversation


@dataclass
class Trajectory:
    prompt_ids: list[int]
    agent: str
    tools_kwargs: dict
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)   # None: the engine was asked for none
    assistant_turns: int = 0
    user_turns: int = 0
    calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None

    def append(self, ids: list[int], logprobs: list[float] | None, mask: int) -> None:
        self.response_ids += ids
        self.logprobs = None if logprobs is None or self.logprobs is None else self.logprobs + logprobs
        self.response_mask += [mask] * len(ids)

    def create_kwargs(self, tool: str) -> dict:
        kwargs = (self.tools_kwargs.get(tool) or {}).get("create_kwargs") or {}
        return kwargs if isinstance(kwargs, dict) else {}

    def sample(self) -> Sample:
        errors = sum(1 for c in self.calls if c["error"])
        return Sample(self.response_ids, self.logprobs, self.finish_reason or "length",
                      response_mask=self.response_mask, prompt_ids=self.prompt_ids,
                      agent={"num_turns": self.assistant_turns + self.user_turns,
                             "assistant_turns": self.assistant_turns, "tool_calls": self.calls,
                             "tool_errors": errors})


def row_agent(prompt: Prompt) -> tuple[str, dict]:
    agent = prompt.extra_info.get("agent_name") or "tool_agent"
    if agent not in AGENTS:
        raise ValueError(f"prompt {prompt.uid}: extra_info.agent_name {agent!r} is not one of {list(AGENTS)}")
    kwargs = prompt.extra_info.get("tools_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"prompt {prompt.uid}: extra_info.tools_kwargs must be an object (tool name -> kwargs)")
    return agent, kwargs


class ToolAgentLoop:
    def __init__(self, spec: MultiTurnSpec, engine: Engine, tokenizer, runner: ToolRunner, max_response_length: int,
                 max_prompt_length: int | None = None):
        self.spec = spec
        self.engine = engine
        self.tokenizer = tokenizer
        self.runner = runner
        self.max_length = max_response_length
        self.max_prompt_length = max_prompt_length
        self.eos = tokenizer.eos_token_id
        self.schemas = [tool.schema for _, tool in sorted(runner.tools.items())]

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Sample]]:
        """`params.n` trajectories per prompt, in prompt order (Engine.generate's contract)."""
        trajectories = []
        for p in prompts:
            agent, kwargs = row_agent(p)
            ids = self.prompt_with_tools(p) if agent == "tool_agent" else p.prompt_ids
            trajectories += [Trajectory(ids, agent, kwargs) for _ in range(params.n)]
        turn = 0
        while active := [t for t in trajectories if t.finish_reason is None]:
            pending = self._model_turn(active, params, turn)
            self._tool_turn(pending)
            turn += 1
        samples = [t.sample() for t in trajectories]
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def prompt_with_tools(self, p: Prompt) -> list[int]:
        """The row's messages rendered with the tools' schemas (a shard without its messages, or a
        job without tools, keeps the trainer's ids). The schemas count towards
        data.maxPromptLength, as in verl's dataset filter."""
        if not p.messages or not self.schemas:
            return p.prompt_ids
        ids = self.tokenizer.apply_chat_template(list(p.messages), tools=self.schemas, add_generation_prompt=True,
                                                 tokenize=True)
        ids = ids if isinstance(ids, list) else list(ids["input_ids"])   # transformers 5: a BatchEncoding
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise ValueError(f"prompt {p.uid}: with the tools' schemas the prompt is {len(ids)} tokens, over "
                             f"data.maxPromptLength={self.max_prompt_length} (the schemas take "
                             f"{len(ids) - len(p.prompt_ids)}; raise data.maxPromptLength)")
        return ids

    def _stop(self, t: Trajectory) -> tuple[str, ...]:
        # One call per turn: end the turn at the call's end (the tool's answer follows at once).
        return (CLOSE,) if t.agent == "tool_agent" and self.spec.max_parallel_calls == 1 else ()

    def _model_turn(self, active: list[Trajectory], params: SamplingParams, turn: int):
        """One engine call per stop-string group; returns the trajectories with calls to run."""
        pending = []
        groups: dict[tuple[str, ...], list[Trajectory]] = {}
        for t in active:
            groups.setdefault(self._stop(t), []).append(t)
        for stop, group in groups.items():
            budget = max(self.max_length - len(t.response_ids) for t in group)
            turn_params = replace(params, n=1, max_tokens=budget, stop=tuple(params.stop) + stop,
                                  seed=None if params.seed is None else params.seed + 7919 * turn)
            outputs = self.engine.generate([t.prompt_ids + t.response_ids for t in group], turn_params)
            for t, [s] in zip(group, outputs):
                room = self.max_length - len(t.response_ids)
                t.append(s.token_ids[:room], None if s.logprobs is None else s.logprobs[:room], 1)
                t.assistant_turns += 1
                if s.finish_reason == "length" or len(s.token_ids) >= room:
                    t.finish_reason = "length"
                    continue
                calls = parse_tool_calls(self.engine.decode(s.token_ids), self.spec.max_parallel_calls) \
                    if t.agent == "tool_agent" else []
                if not calls or self._turns_used_up(t):
                    t.finish_reason = "stop"
                    continue
                pending.append((t, calls))
        return pending

    def _turns_used_up(self, t: Trajectory) -> bool:
        mt = self.spec
        return ((mt.max_assistant_turns is not None and t.assistant_turns >= mt.max_assistant_turns)
                or (mt.max_user_turns is not None and t.user_turns >= mt.max_user_turns))

    def _tool_turn(self, pending) -> None:
        flat = [(call, t.create_kwargs(call.name)) for t, calls in pending for call in calls]
        results = iter(self.runner.run(flat))
        for t, calls in pending:
            answers = [next(results) for _ in calls]
            for call, r in zip(calls, answers):
                t.calls.append({"turn": t.assistant_turns, "name": call.name, "arguments": call.arguments,
                                "error": r.error, "seconds": round(r.seconds, 4)})
            ids = self.tool_turn_ids(answers, t.response_ids[-1] if t.response_ids else None)
            if len(t.response_ids) + len(ids) >= self.max_length:
                t.finish_reason = "length"     # no room for the answer and a model turn after it
                continue
            t.append(ids, [0.0] * len(ids), 0)
            t.user_turns += 1

    def tool_turn_ids(self, results: list[ToolResult], last_sampled: int | None) -> list[int]:
        """The ids of the tool turn as the chat template renders it after a model turn: the end of
        the model's turn, one tool message per result, the next assistant turn's header. Only this
        new text is encoded; the trajectory's ids stay as they are."""
        messages = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _MARK},
                    *({"role": "tool", "content": r.text} for r in results)]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if _MARK not in text:
            raise ValueError("the chat template does not render assistant messages' content: cannot place tool turns")
        ids = self.tokenizer.encode(text.split(_MARK, 1)[1], add_special_tokens=False)
        if ids and last_sampled is not None and last_sampled == self.eos and ids[0] == self.eos:
            ids = ids[1:]     # the model ended its turn itself
        return ids


class CustomAgentLoop:
    """rollout.agentLoop: the user's class, held to Engine.generate's contract.

    The interface (docs/ARCHITECTURE.md, "Custom agent loops"): `Class(spec, engine, tokenizer)`
    is built once per rollout server (spec: the GRPOJobSpec; engine: grpo_rollout.engine.Engine,
    whose `generate(list of token-id lists, SamplingParams)` continues from token ids);
    `generate(prompts, params)` gets the request's `grpo_rollout.shard.Prompt`s and returns, per
    prompt, `params.n` `Sample`s: the response's ids and behaviour logprobs, `response_mask`
    (1 sampled by the model, 0 the environment's tokens, which the trainer masks out of every
    loss), optionally `prompt_ids` (the prompt the engine was given, if not the shard's) and
    `agent` (any JSON-able facts, kept in the records; `num_turns` and `tool_calls` are read,
    default 1 and none). A response longer than data.maxResponseLength is cut to it (finish_reason
    "length"), as verl's agent loops cut theirs to response_length, and the server logs it."""

    def __init__(self, ref: str, spec, engine: Engine):
        from grpo_rollout.loading import load_attribute
        cls = load_attribute(ref, "spec.rollout.agentLoop", what="class")
        if not callable(cls):
            raise ValueError(f"spec.rollout.agentLoop {ref!r}: {cls!r} is not a class")
        self.ref = ref
        self.loop = cls(spec, engine, engine.tokenizer)
        self.max_length = spec.data.max_response_length
        self.truncated = 0       # responses cut to max_length so far

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Sample]]:
        # Always with logprobs, even for an on-policy step that asked for none: the contract gives
        # the user's code lists (it may add its own tokens' to them).
        groups = self.loop.generate(prompts, replace(params, logprobs=True))
        where = f"spec.rollout.agentLoop {self.ref!r}"
        if not isinstance(groups, list) or len(groups) != len(prompts):
            raise ValueError(f"{where}: generate returned {type(groups).__name__} of "
                             f"{len(groups) if isinstance(groups, list) else '?'} groups for {len(prompts)} prompts")
        for p, group in zip(prompts, groups):
            if len(group) != params.n or not all(isinstance(s, Sample) for s in group):
                raise ValueError(f"{where}: prompt {p.uid} got {len(group)} results, not {params.n} Samples")
            for s in group:
                if not ((s.logprobs is None or len(s.token_ids) == len(s.logprobs)) and
                        (s.response_mask is None or len(s.response_mask) == len(s.token_ids))):
                    raise ValueError(f"{where}: prompt {p.uid}: token_ids, logprobs and response_mask "
                                     f"differ in length ({len(s.token_ids)}, "
                                     f"{None if s.logprobs is None else len(s.logprobs)}, "
                                     f"{None if s.response_mask is None else len(s.response_mask)})")
                if s.agent is not None:       # what the records and the trainer's metrics read
                    s.agent.setdefault("num_turns", 1)
                    s.agent.setdefault("tool_calls", [])
                if len(s.token_ids) > self.max_length:
                    self._truncate(s, where)
        return groups

    def _truncate(self, s: Sample, where: str) -> None:
        if not self.truncated:
            log.warning("%s returned a response of %d tokens, more than data.maxResponseLength %d: cut to it "
                        "(finish_reason length), as verl's agent loops do; later ones are cut silently", where,
                        len(s.token_ids), self.max_length)
        self.truncated += 1
        n = self.max_length
        s.token_ids, s.finish_reason = s.token_ids[:n], "length"
        s.logprobs = None if s.logprobs is None else s.logprobs[:n]
        if s.response_mask is not None:
            s.response_mask = s.response_mask[:n]


def build_agent_loop(spec, engine: Engine, sandbox=None) -> ToolAgentLoop | CustomAgentLoop | None:
    """The job's agent loop: rollout.agentLoop's class, the tool agent loop with
    rollout.multiTurn.enable, else None. A loop or tool that can't be loaded is a ValueError
    naming it: the server refuses to start rather than serve without it. sandbox: the `python`
    tool's SandboxClient (None: its programs run in a child process of this server)."""
    from grpo_rollout.tools import load_tools
    if spec.rollout.agent_loop is not None:
        return CustomAgentLoop(spec.rollout.agent_loop, spec, engine)
    mt = spec.rollout.multi_turn
    if not mt.enable:
        return None
    runner = ToolRunner(load_tools(mt, sandbox), timeout_seconds=mt.tool_timeout_seconds,
                        max_response_length=mt.max_tool_response_length, truncate_side=mt.tool_response_truncate_side)
    where = f"sandbox servers {', '.join(sandbox.addresses)}" if sandbox else "child processes of this server"
    log.info("agent loop: tools %s, maxParallelCalls %d%s", sorted(runner.tools), mt.max_parallel_calls,
             f"; python runs on {where}" if "python" in runner.tools else "")
    return ToolAgentLoop(mt, engine, engine.tokenizer, runner, spec.data.max_response_length,
                         spec.data.max_prompt_length)


def reward_extra_info(extra_info: dict, sample: Sample) -> dict:
    """What compute_score's extra_info holds for a multi-turn sample: the row's, plus the
    trajectory's turns and calls (verl passes its tool agent's extra fields the same way)."""
    if sample.agent is None:
        return extra_info
    return {**extra_info, "num_turns": sample.agent["num_turns"], "tool_calls": sample.agent["tool_calls"]}
