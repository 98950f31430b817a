"""What the critic answers, as the coordinator sees it (clients import this, never the core)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CriticValues:
    values: torch.Tensor  # float32 [sum(response_lengths)]
    model_version: int    # the critic version that computed them: the fence of the Update that uses them

    @staticmethod
    def concat(parts: list[CriticValues]) -> CriticValues:
        """Chunks of one batch, in order; the oldest version is the batch's."""
        return CriticValues(torch.cat([p.values for p in parts]), min(p.model_version for p in parts))
