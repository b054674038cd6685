"""DAPO's overlong reward shaping (verl's DAPORewardManager): responses that run into the last
`buffer_len` tokens before `max_response_length` lose reward linearly, up to `penalty_factor` at
the limit. Shorter responses are untouched."""

from __future__ import annotations


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """The (non-positive) amount added to the reward."""
    if buffer_len <= 0:
        raise ValueError(f"spec.reward.overlongBuffer.len must be > 0 when enabled (got {buffer_len})")
    expected = max_response_length - buffer_len
    exceed = response_length - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)
