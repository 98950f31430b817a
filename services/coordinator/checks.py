"""What the coordinator checks before a step's results may touch the run: every score, value and
logprob finite. A NaN from one role would flow through the advantages into every weight of the
actor and critic; refusing the step before any update leaves the run as it was after the last one."""

from __future__ import annotations

import torch

from rolefleet.actor.types import LogProbs, Sample
from rolefleet.common.errors import FailedPrecondition


class StepRefused(FailedPrecondition):
    """A step's inputs are unusable; nothing of the step was applied."""


def _non_finite(x: torch.Tensor) -> list[int]:
    return (~torch.isfinite(x)).nonzero().flatten().tolist()


def _samples(samples: list[Sample], rows: list[int], limit: int = 5) -> str:
    named = ", ".join(f"prompt {samples[i].prompt_index} sample {samples[i].sample_index}" for i in rows[:limit])
    return named + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def require_finite(samples: list[Sample], scores: torch.Tensor, values: torch.Tensor, logprobs: LogProbs,
                   reward_function: str) -> None:
    """scores [B] per sample; values and logprobs packed [N] over the samples' response tokens."""
    if bad := _non_finite(scores):
        raise StepRefused(f"reward function {reward_function!r} gave non-finite scores for "
                          f"{_samples(samples, bad)}; the step was refused before any update")
    lengths = [len(s.response_ids) for s in samples]
    row_of = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths))
    for source, tensor in (("critic values", values), ("actor logprobs", logprobs.logprobs),
                           ("reference logprobs", logprobs.ref_logprobs)):
        if tensor is not None and (bad := _non_finite(tensor)):
            rows = sorted({int(row_of[i]) for i in bad})
            raise StepRefused(f"non-finite {source} for {_samples(samples, rows)}; "
                              "the step was refused before any update")
