"""torch's CPU threads in a role process."""

from __future__ import annotations

import torch

GPU_PROCESS_THREADS = 1


def set_threads(num_threads: int | None) -> None:
    """torch's CPU threads for this role process (`<role>.num_threads`). Unset: torch's default (a
    thread per core) where the role computes on the CPU, and `GPU_PROCESS_THREADS` where it drives a
    GPU. There its CPU tensor work is batch glue (padding, index building, a few hundred thousand
    elements), and a thread per core in every role process of a node makes each small op wait for
    its slowest thread: profiled on two H200s, such ops took 8-12 ms each in the trainer, against
    0.9 ms on a node with fewer processes (torchrun sets one thread per process for the same reason)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    elif torch.cuda.is_available():
        torch.set_num_threads(GPU_PROCESS_THREADS)
