"""Prompt groups: which samples of a batch were generated from the same prompt.

GRPO-style estimators compare a sample with its siblings. The trainer knows the siblings by a
group id per sample (the rollout record's ``uid``; verl's ``index`` array), which may be an int
tensor, a list of strings or a numpy array. ``Groups`` turns any of those into a dense index
``0..G-1`` once, so per-group statistics are vectorised ``index_add_`` calls instead of verl's
Python loop over samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

GroupIds = torch.Tensor | Sequence[Any]
"""One id per sample: a 1-D tensor, or any sequence of hashables (str uids, ints, numpy values)."""


@dataclass(frozen=True, slots=True)
class Groups:
    index: torch.Tensor
    """``[B]`` int64: the dense group number (0..G-1) of each sample."""
    sizes: torch.Tensor
    """``[G]`` int64: the number of samples in each group."""

    @classmethod
    def from_ids(cls, group_ids: GroupIds, batch_size: int, device: torch.device | None = None) -> Groups:
        if isinstance(group_ids, torch.Tensor):
            if group_ids.dim() != 1:
                raise ValueError(f"group_ids must be 1-D, one id per sample (got shape {tuple(group_ids.shape)})")
            _, index = torch.unique(group_ids, return_inverse=True)
            index = index.to(device=device, dtype=torch.long)
        else:
            dense: dict[Any, int] = {}
            index = torch.tensor(
                [dense.setdefault(_hashable(g), len(dense)) for g in group_ids], dtype=torch.long, device=device
            )
        if index.numel() != batch_size:
            raise ValueError(f"group_ids has {index.numel()} entries but the batch has {batch_size} samples")
        num_groups = int(index.max().item()) + 1 if batch_size else 0
        sizes = torch.bincount(index, minlength=num_groups)
        return cls(index=index, sizes=sizes)

    @property
    def num_groups(self) -> int:
        return int(self.sizes.numel())

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[B] -> [G]``: per-group sum."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.index, values)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """``[B] -> [G]``: per-group mean."""
        return self.sum(values) / self.sizes.to(values.dtype)

    def std(self, values: torch.Tensor) -> torch.Tensor:
        """``[B] -> [G]``: per-group std with Bessel's correction (``torch.std``'s default); NaN for lone samples."""
        centered = values - self.mean(values)[self.index]
        return (self.sum(centered * centered) / (self.sizes - 1).to(values.dtype)).sqrt()

    def max(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.index, values, reduce="amax")

    def min(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.num_groups,), torch.inf, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.index, values, reduce="amin")


def _hashable(group_id: Any) -> Any:
    # numpy scalars hash like Python scalars; a 0-d tensor does not (it hashes by identity).
    if isinstance(group_id, torch.Tensor):
        return group_id.item()
    return group_id
