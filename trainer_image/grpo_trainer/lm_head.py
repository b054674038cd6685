"""The LM head that can return log-probs and entropies instead of logits (spec.model.useFusedKernels).

`model(...).logits` is a ``[tokens, vocab]`` tensor (151,936 columns for Qwen3) and its gradient
another. `install_fused_head` turns the model's output projection (a plain `nn.Linear`) into a
`FusedLMHead`: an `nn.Linear` still (same parameter, so tied embeddings, state dicts, PEFT's
"all-linear" and the weight sync see no change), which while a `request` is open computes
`fused_linear_logprobs` of the positions asked for instead of the logits.

Why inside the model's forward rather than on its hidden states afterwards: FSDP2 gathers the root
module's parameters (embeddings, norm, head) in its forward hooks, so only there is the head's
weight whole, and the output's backward hooks gather it again for the gradient.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from grpo_trainer.algorithms import fused_linear_logprobs

log = logging.getLogger("grpo.trainer")


@dataclass
class _Request:
    select: torch.Tensor | None   # [b, k] bool: the positions (of the head's input) to score; None: all
    labels: torch.Tensor          # [select.sum()]: each one's next token
    temperature: float
    with_entropy: bool
    entropy_grad: bool


class FusedLMHead(torch.nn.Linear):
    """Without a request, the plain linear layer. With one (`request`), ``forward`` returns
    ``[b, k, 1 or 2]`` float32: the log-prob of each selected position's label (and its entropy),
    0 at positions not selected."""

    _request: _Request | None = None

    @contextlib.contextmanager
    def request(self, select: torch.Tensor | None, labels: torch.Tensor, temperature: float, *,
                with_entropy: bool = False, entropy_grad: bool = False):
        self._request = _Request(select, labels, temperature, with_entropy, entropy_grad)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self._request
        if req is None:
            return super().forward(hidden)
        if req.select is not None and req.select.shape != hidden.shape[:-1]:
            raise ValueError(f"positions to score {tuple(req.select.shape)} do not match the head's input "
                             f"{tuple(hidden.shape[:-1])}")
        # A mask indexes through a host sync (its count); every position needs none.
        scored = hidden.flatten(0, -2) if req.select is None else hidden[req.select]
        logp, entropy = fused_linear_logprobs(scored, self.weight, req.labels,
                                              temperature=req.temperature, with_entropy=req.with_entropy)
        if entropy is not None and not req.entropy_grad:
            entropy = entropy.detach()
        values = logp.unsqueeze(-1) if entropy is None else torch.stack([logp, entropy], dim=-1)
        if req.select is None:
            return values.view(*hidden.shape[:-1], values.shape[-1])
        out = values.new_zeros(*hidden.shape[:-1], values.shape[-1])
        out[req.select] = values
        return out


def install_fused_head(model) -> bool:
    """Make `model`'s output projection a `FusedLMHead` (before FSDP2 and PEFT wrap it): a class
    swap, so the parameter (tied to the input embeddings or not) stays the very same one. A head
    that is not a plain bias-free linear layer is left as it is (the logits path): False."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        log.warning("spec.model.useFusedKernels: the LM head of %s is not a bias-free linear layer; "
                    "log-probs come from its logits", type(model).__name__)
        return False
    head.__class__ = FusedLMHead
    return True


def fused_head(model) -> FusedLMHead | None:
    """`model`'s FusedLMHead, or None (not installed, or the head is wrapped, e.g. by a LoRA adapter)."""
    if hasattr(model, "get_base_model"):   # a PEFT (LoRA) wrapper
        model = model.get_base_model()
    head = model.get_output_embeddings()
    return head if isinstance(head, FusedLMHead) else None
