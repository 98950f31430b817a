"""RewardCore: scores samples with the configured rule-based function. No gRPC here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolefleet.common import metrics
from rolefleet.common.config import RewardSection
from rolefleet.common.errors import InvalidArgument
from rolefleet.reward.functions import REWARD_FUNCTIONS

ROLE = "reward"


@dataclass(frozen=True)
class ScoreItem:
    prompt: str
    response: str
    ground_truth: str


class RewardCore:
    def __init__(self, cfg: RewardSection):
        self.fn = REWARD_FUNCTIONS.get(cfg.function)  # the config schema already checked the name
        self.scored = 0

    def score(self, items: list[ScoreItem]) -> torch.Tensor:
        """float32 [len(items)]."""
        if not items:
            raise InvalidArgument("items", "no items to score")
        scores = torch.tensor([self.fn(i.prompt, i.response, i.ground_truth) for i in items], dtype=torch.float32)
        self.scored += len(items)
        metrics.SAMPLES_SCORED.labels(ROLE).inc(len(items))
        return scores

    def close(self) -> None:
        pass
