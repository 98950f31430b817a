"""The rollout-engine interface (DESIGN "Engines"): what the actor asks of any backend.

An engine owns its own copy of the policy weights in its own precision; the trainer owns the fp32
master weights and hands them over after every update (`load_weights`). The recorded logprob of a
sampled token follows the project's convention (docs/algorithms.md): log softmax(logits /
temperature) of the engine's own forward, before top-k / top-p truncation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from rolefleet.actor.types import Sample, SamplingParams


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                 policy_version: int) -> Iterator[list[Sample]]:
        """n samples per prompt, yielded a batch of finished samples at a time."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the trainer's weights (by parameter name) into the engine's own."""

    def sleep(self) -> None:
        """Release caches and compiled buffers (the trainer needs the memory)."""

    def wake(self) -> None:
        """Undo `sleep` before the next `generate`."""

    def reset_cache(self) -> None:
        """Drop any cached prefixes: they were computed with the previous weights."""
