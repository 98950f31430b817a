"""The epoch/mini-batch loop shared by the policy and value trainers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from rolefleet.common.batch import SequenceBatch, mini_batches

StepFn = Callable[[SequenceBatch, torch.Tensor], dict[str, float]]


def run_epochs(batch: SequenceBatch, epochs: int, num_mini_batches: int, generator: torch.Generator,
               step: StepFn) -> dict[str, float]:
    """Call `step(mini_batch, packed_token_index)` once per mini-batch per epoch (one optimizer step
    each); return each statistic averaged over those steps."""
    totals: dict[str, float] = defaultdict(float)
    steps = 0
    for _ in range(epochs):
        for rows in mini_batches(len(batch), num_mini_batches, generator):
            for name, value in step(batch.select(rows), batch.token_index(rows)).items():
                totals[name] += value
            steps += 1
    return {name: total / steps for name, total in totals.items()}


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                   max_grad_norm: float) -> float:
    """Backward, clip, step; returns the pre-clip gradient norm."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return grad_norm.item()
