"""RewardCore: scores samples with the configured rule-based function. No gRPC here."""

from __future__ import annotations

import math
import time
from numbers import Real

import torch

from rolefleet.common import metrics
from rolefleet.common.config import RewardSection
from rolefleet.common.errors import InvalidArgument, LimitExceeded
from rolefleet.common.roles import RoleStatus
from rolefleet.reward.functions import REWARD_FUNCTIONS
from rolefleet.reward.types import ScoreItem

ROLE = "reward"
# float32 carries scores to the coordinator: a larger value would arrive as inf.
_MAX_SCORE = float(torch.finfo(torch.float32).max)


class RewardCore:
    def __init__(self, cfg: RewardSection):
        self.cfg = cfg
        self.fn = REWARD_FUNCTIONS.get(cfg.function)  # the config schema already checked the name
        self.scored = 0

    def score(self, items: list[ScoreItem]) -> torch.Tensor:
        """float32 [len(items)]. One sample the function cannot score (an exception, a non-number,
        NaN or inf) refuses the request, naming the sample: a silent NaN would poison the step's
        advantages, and a made-up score would train on a reward nobody defined."""
        self._check_sizes(items)
        if self.cfg.score_delay_s:  # a stand-in for a slower reward (benchmarks, tests)
            time.sleep(self.cfg.score_delay_s)
        scores = torch.tensor([self._score_one(i, item) for i, item in enumerate(items)], dtype=torch.float32)
        self.scored += len(items)
        metrics.SAMPLES_SCORED.labels(ROLE).inc(len(items))
        return scores

    def _check_sizes(self, items: list[ScoreItem]) -> None:
        if not items:
            raise InvalidArgument("items", "no items to score")
        if len(items) > self.cfg.max_items_per_request:
            raise LimitExceeded("items", f"{len(items)} items exceed reward.max_items_per_request="
                                f"{self.cfg.max_items_per_request}")
        for i, item in enumerate(items):
            if (size := item.size()) > self.cfg.max_item_bytes:
                raise LimitExceeded(f"items[{i}]", f"{size} bytes exceed reward.max_item_bytes="
                                    f"{self.cfg.max_item_bytes}")

    def _score_one(self, index: int, item: ScoreItem) -> float:
        name = self.cfg.function
        try:
            value = self.fn(item.prompt, item.response, item.ground_truth)
        except Exception as exc:  # noqa: BLE001 - the function's failure is this sample's error
            metrics.REWARD_ERRORS.labels(ROLE, name).inc()
            raise InvalidArgument(f"items[{index}]", f"reward function {name!r} raised "
                                  f"{type(exc).__name__}: {exc}") from None
        # bool is a Real too, and a fine 0/1 score; strings, None and tensors are not.
        if not isinstance(value, Real) or not math.isfinite(value) or abs(value) > _MAX_SCORE:
            metrics.REWARD_ERRORS.labels(ROLE, name).inc()
            raise InvalidArgument(f"items[{index}]", f"reward function {name!r} returned {value!r}, "
                                  "not a finite number")
        return float(value)

    def status(self, include_digest: bool = False) -> RoleStatus:
        return RoleStatus(ROLE)  # stateless: nothing to version or hash

    def close(self) -> None:
        pass
