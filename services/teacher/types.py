"""What the teacher role answers (`TeacherService.ComputeLogProbs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolefleet.common.top_k import TopK


@dataclass(frozen=True)
class TeacherLogProbs:
    logprobs: torch.Tensor     # float32 [N]: log pi_teacher of each sampled token
    top: TopK | None = None    # its k most likely tokens at each position, when asked for (top_k > 0)
