"""The long tail of responses: what happens to samples cut at the length cap (`train.overlong`) and
which groups carry a learning signal at all (`train.dynamic_sampling`).

Overlong modes take per-sample scores (and what their signature asks of lengths, the cap and which
responses were cut at it) and return (scores, keep): the scores the advantages are computed from,
and which samples the policy's update trains on. A sample not kept still counts in its group's
statistics, as in DAPO's overlong filtering; its tokens get no gradient.

- none:    scores unchanged, every sample kept: a response cut at the cap is trained as if complete.
- filter:  responses cut at the cap (`truncated`) are not trained on: their ending is unknown, and
           training on them as if finished teaches that an unfinished answer scores what it scored.
- penalty: DAPO's soft overlong punishment, added to the score. With L the response length, C the
           cap and W the buffer: 0 for L <= C - W, (C - W - L) / W in the buffer (down to -1 at the
           cap), times `factor`. Continuous, so the penalty grows as the response nears the cap.

Shapes: scores, lengths, truncated [B]; keep [B] bool.
"""

from __future__ import annotations

import torch

from rolefleet.algos.registry import Registry

OVERLONG: Registry = Registry("overlong handling")


@OVERLONG.register("none")
def overlong_none(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scores, torch.ones_like(scores, dtype=torch.bool)


@OVERLONG.register("filter")
def overlong_filter(scores: torch.Tensor, truncated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scores, ~truncated.bool()


@OVERLONG.register("penalty")
def overlong_penalty(scores: torch.Tensor, lengths: torch.Tensor, max_len: int, buffer: int,
                     factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return (scores + factor * soft_overlong_penalty(lengths, max_len, buffer),
            torch.ones_like(scores, dtype=torch.bool))


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """float32 [B] in [-1, 0]: 0 up to `max_len - buffer` tokens, then falling linearly to -1 at
    `max_len` (and -1 past it)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"the overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    over = (lengths.to(torch.float32) - (max_len - buffer)) / buffer
    return -over.clamp(min=0.0, max=1.0)


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor, tolerance: float = 1e-6) -> torch.Tensor:
    """bool [B]: whether each sample's group has scores that differ (max - min > tolerance). A group
    whose samples all score the same has zero group-normalized advantage: it costs a generation and
    an update and teaches nothing (DAPO's dynamic sampling drops it). Groups of one sample never
    differ."""
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    scores = scores.to(torch.float32)
    high = torch.full((len(groups),), -torch.inf).scatter_reduce(0, inverse, scores, "amax")
    low = torch.full((len(groups),), torch.inf).scatter_reduce(0, inverse, scores, "amin")
    return (high - low > tolerance)[inverse]
