"""Custom agent loops for tests/rollout/test_agent_loop.py (spec.rollout.agentLoop)."""

from dataclasses import replace

from grpo_rollout.engine import Sample

# The user's turn after the model's, in the tiny vocabulary (word-level: no newlines).
USER_TURN = ["<|im_end|>", "<|im_start|>", "user", "answer", "<|im_end|>", "<|im_start|>", "assistant"]


class SimulatedUser:
    """An environment that isn't a tool: the model answers, a simulated user asks it to answer
    again (mask 0), the model answers a second time."""

    def __init__(self, spec, engine, tokenizer):
        self.engine = engine
        self.user_ids = tokenizer.convert_tokens_to_ids(USER_TURN)

    def generate(self, prompts, params):
        first = self.engine.generate([p.prompt_ids for p in prompts], params)
        out = []
        for p, group in zip(prompts, first):
            again = self.engine.generate([p.prompt_ids + s.token_ids + self.user_ids for s in group],
                                         replace(params, n=1))
            out.append([Sample(s.token_ids + self.user_ids + t.token_ids,
                               s.logprobs + [0.0] * len(self.user_ids) + t.logprobs, t.finish_reason,
                               response_mask=[1] * len(s.token_ids) + [0] * len(self.user_ids) + [1] * len(t.token_ids),
                               agent={"num_turns": 3, "env": "simulated-user"})
                        for s, [t] in zip(group, again)])
        return out


class OneGroupShort:
    """Returns a group too few: the server must refuse it, naming the field."""

    def __init__(self, spec, engine, tokenizer):
        self.engine = engine

    def generate(self, prompts, params):
        return self.engine.generate([p.prompt_ids for p in prompts], params)[:-1]


class Rambler:
    """Appends an environment's 20 tokens (mask 0) and 20 more of its own past the model's answer:
    longer than data.maxResponseLength, which the server must cut."""

    def __init__(self, spec, engine, tokenizer):
        self.engine = engine
        self.word = tokenizer.convert_tokens_to_ids("answer")

    def generate(self, prompts, params):
        return [[Sample(s.token_ids + [self.word] * 40, s.logprobs + [-1.0] * 40, "stop",
                        response_mask=[1] * len(s.token_ids) + [0] * 20 + [1] * 20)
                 for s in group] for group in self.engine.generate([p.prompt_ids for p in prompts], params)]
