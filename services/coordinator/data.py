"""Prompt batches for the run: a built-in task or a JSONL file, reshuffled every epoch."""

from __future__ import annotations

import random

from rolefleet.common.config import DataSection
from rolefleet.tasks import PromptRecord, load_jsonl, make_task


class PromptDataset:
    def __init__(self, records: list[PromptRecord], seed: int):
        if not records:
            raise ValueError("the dataset is empty")
        self.records = records
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_config(cls, cfg: DataSection, seed: int) -> PromptDataset:
        records = load_jsonl(cfg.path) if cfg.path else make_task(cfg.task, cfg.size, seed)
        return cls(records, seed)

    def batch(self, step: int, size: int) -> list[PromptRecord]:
        """The prompts of `step` (1-based): a pure function of (seed, step), so a resumed run sees
        the same prompts it would have seen."""
        start = (step - 1) * size
        return [self.records[self._order(epoch)[index]]
                for epoch, index in (divmod(i, len(self.records)) for i in range(start, start + size))]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # a step spans at most two epochs; keep the newest
        return self._orders[epoch]
