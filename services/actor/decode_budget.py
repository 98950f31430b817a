"""The hf decode loop's batch shapes (`bucket_rows`), and how much of their state stays between
calls: each shape's KV cache, buffers and captured CUDA graphs (`actor.rollout.keep_decode_state_mb`).

A shape built again costs a warm-up step and a graph capture, and the capture empties PyTorch's
cache (`torch.cuda.graph` does), so the trainer's next update pays cudaMalloc for its blocks again.
A fixed budget smaller than a run's working set (its turns' training shapes and its evaluation's)
rebuilt every shape at every step: on one H100 the tool task's generate phase took 2.6 s a step once
a 2 GiB budget was enforced, 1.2 s before, when nothing was ever evicted (docs/benchmarks.md, "The
decode state's budget"). A budget that is never enforced fails the other way: an agent's endpoint
calls come in every batch size, and a run kept all of them until it ran out of memory.

`auto` keeps what fits. Everything this process holds besides the kept state, plus what the next
phase adds (the colocated trainer's update, or a shape about to be built), must stay within
`HEADROOM` of the memory the process could hold: what the device has free and what PyTorch's
allocator already reserved. An update's addition is measured: the most any update so far grew the
allocated memory above what it started from. Until one has been seen (and on the CPU, where there
is no device to ask) the budget is `UNMEASURED_BYTES`.
"""

from __future__ import annotations

import torch

COMPACT_FLOOR = 8    # fewer rows decode no faster (the step is bound by reading weights and launches)
HEADROOM = 0.9                    # of what the process could hold: fragmentation, other processes' growth
UNMEASURED_BYTES = 2048 * 2**20   # before a colocated update has been measured; the CPU


def bucket_rows(n: int) -> int:
    """The rows a call of `n` sequences decodes as (decode.py): the first of 8, 12, 16, 24, 32, 48,
    64, 96, ... (powers of two and one and a half times them) that holds them."""
    rows = COMPACT_FLOOR
    while rows < n:
        rows = rows * 3 // 2 if rows & (rows - 1) == 0 else rows * 4 // 3
    return rows


def kept_budget(usable: int, others: int, reserve: int, headroom: float = HEADROOM) -> int:
    """Bytes of decode state that fit beside `others` bytes already held and `reserve` bytes still
    to come, within `headroom` of `usable`; 0: none."""
    return max(0, int(headroom * usable) - others - reserve)


class DeviceRoom:
    """The allocator's and the device's figures the budget reads (a stand-in replaces it in tests)."""

    def __init__(self, device: torch.device):
        self.device = device

    def usable(self) -> int:
        """What this process could hold: the device's free memory and its allocator's reserve."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def start_peak(self) -> None:
        # The process's one peak counter, also what the update's `actor/peak_memory_gib` reads
        # (`trainer/profiling.DeviceMemory`, reset as the update begins): reset again after the
        # engine's trim, both then count the update's own peak, not the state given back before it.
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


class DecodeBudget:
    """The kept state's budget: `fixed_bytes` as configured, or (None: `auto`) what the device has
    room for, read from `room` (None: no device to ask)."""

    def __init__(self, fixed_bytes: int | None, room: DeviceRoom | None):
        self.fixed = fixed_bytes
        self.room = room
        self.update_growth: int | None = None  # the most a colocated update grew allocated memory by
        self._update_start: int | None = None

    def for_call(self, held: int, reserve: int = 0) -> int:
        """During a call, while `held` bytes are kept: before building a shape of about `reserve`
        bytes, or (0) after it."""
        if self.fixed is not None:
            return self.fixed
        if self.room is None:
            return UNMEASURED_BYTES
        return kept_budget(self.room.usable(), max(0, self.room.allocated() - held), reserve)

    def for_update(self, held: int) -> int:
        """Before a colocated trainer's update, while `held` bytes are kept."""
        if self.fixed is not None:
            return self.fixed
        if self.room is None or self.update_growth is None:
            return min(self.for_call(held), UNMEASURED_BYTES)
        return kept_budget(self.room.usable(), max(0, self.room.allocated() - held), self.update_growth)

    def update_starts(self) -> None:
        """The kept state is trimmed and the update follows: its growth is measured from here."""
        if self.fixed is None and self.room is not None:
            self.room.start_peak()
            self._update_start = self.room.allocated()

    def update_done(self) -> None:
        if self._update_start is not None:
            growth = max(0, self.room.peak() - self._update_start)
            self.update_growth = max(self.update_growth or 0, growth)
            self._update_start = None
