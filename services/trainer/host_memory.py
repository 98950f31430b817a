"""Pinned host memory for state that waits off the GPU (`<role>.offload: optimizer`, `actor.ref_offload`).

torch's pinned-memory allocator rounds every allocation up to a power of two, so that freed blocks
can be reused. For AdamW's state of a 7B model that is ruinous: 56.7 GiB of moments in tensors of
272 MB (the MLP's, rounded up to 512 MB) and 2.2 GB (the embeddings' and the LM head's, to 4 GB)
take 107.9 GiB, which with the offloaded reference beside them is more than the 125 GiB host
whose full-parameter run of Qwen2.5-7B's dimensions was killed after loading (one H200,
2026-12-02). `PinnedSlabs` asks the allocator for slabs of one power-of-two size instead and lays
the tensors in them back to back: what is lost is the end of each slab.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

ALIGN = 512  # bytes: every tensor starts at a multiple (DMA and vectorised copies want aligned rows)
MIN_SLAB = 1 << 28


class PinnedSlabs:
    def __init__(self, largest_bytes: int, pin: bool):
        """`largest_bytes`: the largest tensor it will be asked for; `pin`: page-locked memory (a
        CUDA host), else plain host memory (the same layout, for tests on the CPU)."""
        self.slab_bytes = max(MIN_SLAB, 1 << max(0, math.ceil(math.log2(max(1, largest_bytes)))))
        self.pin = pin
        self._slabs: list[torch.Tensor] = []
        self._used = 0  # bytes taken in the last slab

    @property
    def reserved_bytes(self) -> int:
        return len(self._slabs) * self.slab_bytes

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, a view into a slab."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.slab_bytes:
            raise ValueError(f"a tensor of {nbytes} bytes is larger than the slabs ({self.slab_bytes} bytes)")
        start = -(-self._used // ALIGN) * ALIGN
        if not self._slabs or start + nbytes > self.slab_bytes:
            self._slabs.append(torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin))
            start = 0
        self._used = start + nbytes
        return self._slabs[-1][start:start + nbytes].view(dtype).view(shape)


class HostResident:
    """A frozen module (`actor.ref_offload`'s reference) whose weights live in pinned host memory and
    visit a device for a use (`visit`). Nothing goes back at the end of a visit: the module never
    changes, so its host copy stays the truth and the device copy is simply dropped. A visit costs
    one asynchronous host-to-device transfer from pinned memory, where moving the module there and
    back cost two through freshly allocated pageable memory (28 GiB each way at 7B)."""

    def __init__(self, module: torch.nn.Module, pin: bool):
        tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()  # tied ones once
        slabs = PinnedSlabs(max((t.numel() * t.element_size() for t in tensors), default=1), pin=pin)
        self._pairs = []
        for t in tensors:
            host = slabs.empty(t.shape, t.dtype)
            host.copy_(t.detach())
            t.data = host  # the device copy it replaces is freed here
            self._pairs.append((t, host))
        self.host_bytes = slabs.reserved_bytes

    @contextlib.contextmanager
    def visit(self, device: torch.device) -> Iterator[None]:
        """The module's tensors on `device` inside the block (stream-ordered copies: the forwards
        queued after them read them), back on their host copies after it."""
        for t, host in self._pairs:
            t.data = host.to(device, non_blocking=True)
        try:
            yield
        finally:
            for t, host in self._pairs:
                t.data = host
