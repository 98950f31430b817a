"""The epoch/mini-batch loop and the optimizer step shared by the policy and value trainers."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from rolefleet.common.batch import SequenceBatch, mini_batches
from rolefleet.common.errors import FailedPrecondition
from rolefleet.trainer.host_memory import PinnedSlabs
from rolefleet.trainer.steps import PartialUpdate

StepFn = Callable[[SequenceBatch, torch.Tensor], dict[str, float]]


def run_epochs(batch: SequenceBatch, epochs: int, num_mini_batches: int, generator: torch.Generator,
               step: StepFn) -> dict[str, float]:
    """Call `step(mini_batch, packed_token_index)` once per mini-batch per epoch (one optimizer step
    each); return each statistic averaged over those steps.

    If the first optimizer step fails nothing has changed (the mini-batch RNG is rewound too) and
    the error propagates as is; a later failure is a PartialUpdate.
    """
    rng_state = generator.get_state()
    totals: dict[str, float] = defaultdict(float)
    steps, planned = 0, epochs * min(num_mini_batches, len(batch))
    try:
        for _ in range(epochs):
            for rows in mini_batches(len(batch), num_mini_batches, generator):
                for name, value in step(batch.select(rows), batch.token_index(rows)).items():
                    totals[name] += value
                steps += 1
    except PartialUpdate:
        raise
    except Exception as exc:
        if steps == 0:
            generator.set_state(rng_state)
            raise
        raise PartialUpdate(f"failed after {steps} of {planned} optimizer steps: {exc}") from exc
    return {name: total / steps for name, total in totals.items()}


class NonFiniteGradient(FailedPrecondition):
    """The loss or its gradient overflowed; the optimizer step was not taken."""


def lr_factor(step: int, warmup: int, decay_steps: int, schedule: str, min_ratio: float) -> float:
    """The learning-rate multiplier after `step` optimizer steps: linear warm-up over `warmup`
    steps, then constant, or linear / cosine decay to `min_ratio` at `decay_steps` (and after)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def make_optimizer(model: torch.nn.Module, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable fp32 master weights (with adapters: theirs alone) and its schedule,
    from a trainer section of the config."""
    if cfg.lr_decay_steps is None:  # the config fills it in from the run's length
        raise ValueError("lr_decay_steps must be set (the config defaults it to the run's optimizer steps)")
    # Fused on CUDA: one kernel per step instead of a dozen multi-tensor passes over the fp32 state.
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = trainable[0].is_cuda
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, cfg.lr_warmup_steps, cfg.lr_decay_steps, cfg.lr_schedule, cfg.min_lr_ratio))
    return optimizer, schedule


def apply_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                    loss: float | torch.Tensor, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    step: Callable[[], None] | None = None) -> float:
    """Clip the accumulated gradients and step (`step`: how, default `optimizer.step`); returns the
    pre-clip gradient norm. `loss` (the step's loss value) only names the failure.

    A non-finite gradient (overflowing ratios, a diverged model) is never applied: the gradients are
    dropped and NonFiniteGradient raised, so the weights and optimizer state stay as they were.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradient(f"non-finite gradient (loss {float(loss):.4g}); the optimizer step was skipped")
    try:
        (step or optimizer.step)()
    except Exception as exc:  # e.g. out of memory inside Adam: some parameters already moved
        raise PartialUpdate(f"the optimizer step failed midway ({exc})") from exc
    if scheduler is not None:
        scheduler.step()
    return grad_norm.item()


class HostOptimizerState:
    """`<role>.offload: optimizer`: the optimizer's state lives in host memory except during its
    step, so the forwards, backwards and generation between steps have that memory (AdamW: 8 bytes
    a parameter). The step (`step`) runs a chunk of parameters at a time: a chunk's state comes to
    the GPU, the optimizer steps those parameters alone (it skips a parameter without a gradient),
    the state goes back and the chunk's gradients are freed, so the step needs the GPU memory of
    one chunk's state, not of all of it. Pinned host buffers (`host_memory.PinnedSlabs`), copied
    asynchronously on the current stream: the cost is two transfers of the state per optimizer step
    over PCIe (docs/memory.md)."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunk_bytes: int = 1 << 30):  # app/memory.py's OFFLOAD_CHUNK
        self.optimizer, self.chunk_bytes = optimizer, chunk_bytes
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # AdamW's moments are the shape and dtype of their parameter (a DTensor's: its global size, a bound).
        self.slabs = PinnedSlabs(max(p.numel() * p.element_size() for p in params), pin=torch.cuda.is_available())
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # pinned buffers, by (parameter id, state key)
        self._moved: dict[tuple[int, str], torch.device] = {}  # what `to_host` moved, and from where

    def step(self) -> None:
        """The optimizer's step over every parameter with a gradient, chunk by chunk."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        try:
            for chunk in _chunks(params, self.chunk_bytes // 8):  # AdamW: two fp32 moments a parameter
                for p in chunk:
                    p.grad = grads.pop(id(p))
                self._to_device(chunk)
                self.optimizer.step()
                self._to_host(chunk)
                for p in chunk:
                    p.grad = None  # applied: its memory goes to the next chunk's state
        finally:
            self.to_host()

    def to_host(self) -> None:
        """Every state tensor into host memory (after a load, which puts it beside the parameters)."""
        self._to_host(list(self.optimizer.state))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device copies may be freed only once they are read

    def _to_device(self, params: list[torch.Tensor]) -> None:
        for param in params:
            state = self.optimizer.state.get(param, {})
            for key, value in state.items():
                if (id(param), key) in self._moved:  # not a step count the optimizer keeps on the CPU
                    state[key] = value.to(self._moved[(id(param), key)], non_blocking=True)

    def _to_host(self, params: list[torch.Tensor]) -> None:
        for param in params:
            state = self.optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    slot = (id(param), key)
                    host = self._host.get(slot)
                    if host is None or host.shape != value.shape or host.dtype != value.dtype:
                        host = self._host[slot] = self.slabs.empty(value.shape, value.dtype)
                    self._moved[slot] = value.device
                    # Stream-ordered: the device block is reused only by work queued after this copy.
                    state[key] = host.copy_(value, non_blocking=True)


def _chunks(params: list[torch.Tensor], elements: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters in groups of about `elements` elements (a larger one alone)."""
    chunks: list[list[torch.Tensor]] = []
    filled = elements
    for p in params:
        if filled + p.numel() > elements:
            chunks.append([])
            filled = 0
        chunks[-1].append(p)
        filled += p.numel()
    return chunks
