"""A trainer's per-step snapshot written by copying its state into a memory-mapped file (DESIGN
"Checkpoints", docs/checkpoints.md "Snapshots").

Each rank of a trainer keeps two files, `<snapshot dir>/<instance>/buffers/<role>/rank-<R>-{0,1}.bin`,
mapped into its memory (page-locked on a GPU) from one snapshot to the next, and writes a snapshot
by copying its weights and optimizer state into the one that does not hold its newest complete
snapshot. The copy off the device is the write: no serialization, no writing thread beside the
rollout engine's host-bound decode loop, no page allocated after the first snapshot. On one H100 a
135M policy's 1.6 GB written with torch.distributed.checkpoint took ~1 s a step, which held every
step up and slowed generation meanwhile (docs/benchmarks.md); a snapshot is now as long as its copy.

The snapshot's directory holds where each tensor lies (`weights/rank-<R>.layout`: the state's
structure, each tensor's offset, shape and dtype, the file and the write's token). A file's header
holds the token of the write it holds: cleared before a write begins and set once its copy is
complete, so a snapshot whose file was overwritten since, or whose write was cut short, is refused
on load, never read half.

What is written where: a DTensor's local shard by its rank, in its own file; a plain tensor
(replicated over the ranks, or the only copy of a trainer of one rank) and every other value by the
first rank. Loading reads the same: the same number of ranks and the same shards, or a clear refusal
(resharding is what checkpoints are for; a lost trainer restarts as it was).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from rolefleet.common.errors import FailedPrecondition

log = logging.getLogger(__name__)

MAGIC = b"RFSNAP01"
HEADER = 64  # magic, the write's token (16 bytes; zeros: none complete), its sequence number, zeros
NO_TOKEN = bytes(16)
DATA_START = mmap.PAGESIZE
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """Where a tensor lies: in rank `rank`'s file at `offset`, as `shape` of `dtype`."""

    rank: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _is_dtensor(value) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def _leaves(state, rank: int):
    """(structure with Slot placeholders, [(slot, local tensor)]) of what `rank` writes. Offsets
    start at DATA_START."""
    placed: list[tuple[Slot, torch.Tensor]] = []
    end = DATA_START

    def place(value):
        nonlocal end
        if isinstance(value, dict):
            return {k: place(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(place(v) for v in value)
        if isinstance(value, torch.Tensor):
            local = value.to_local() if _is_dtensor(value) else value
            owner = rank if _is_dtensor(value) else 0
            if owner != rank:  # another rank writes it
                return Slot(owner, -1, tuple(local.shape), local.dtype)
            slot = Slot(owner, end, tuple(local.shape), local.dtype)
            end += -(-local.numel() * local.element_size() // ALIGN) * ALIGN
            placed.append((slot, local.detach()))
            return slot
        return value

    return place(state), placed, end


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves its error for the next kernel launch's check to report as
    its own (torch exposes no cudaGetLastError): a launch of ours takes it."""
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


class _Mapped:
    """One buffer file mapped into this process (page-locked where a GPU copies into it)."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            self.inode = os.fstat(fd).st_ino
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned, self.closed = False, False
        if torch.cuda.is_available():
            error = int(torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), size, 0))
            self.pinned = not error
            if error:
                _clear_cuda_error()  # (a locked-memory limit, say) the copy works all the same, at pageable speed
                log.warning("page-locking the snapshot buffer %s failed (cudaError %d): snapshots copy off the "
                            "GPU through pageable memory", path, error)

    def current(self) -> bool:
        """Whether the file is still this mapping's (nobody removed or replaced it)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return st.st_ino == self.inode and st.st_size == self.size

    def clear(self) -> None:
        """From now until `complete`, the file holds no snapshot."""
        self.map[8:24] = NO_TOKEN

    def complete(self, token: bytes, sequence: int) -> None:
        self.map[24:32] = sequence.to_bytes(8, "little")
        self.map[:8] = MAGIC
        self.map[8:24] = token

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        del self.bytes
        self.map.close()

    def __del__(self):
        # A trainer dropped without closing (a worker's close): its page-locked range goes back to
        # the driver before the mapping does.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone already
            pass


class SnapshotBuffers:
    """A rank's two buffer files, kept mapped from one snapshot to the next."""

    def __init__(self):
        self.mapped: list[_Mapped | None] = [None, None]
        self.last: int | None = None  # the file of this process's newest complete write

    def write(self, state: dict, weights: Path, buffers: Path, rank: int, world: int) -> None:
        """`state` into one of this rank's files under `buffers`, its layout into `weights`. Returns
        once the copy is complete (the snapshot is then complete on this rank)."""
        structure, placed, size = _leaves(state, rank)
        which, sequence = self._choose(buffers, rank)
        mapped = self._map(buffers / f"rank-{rank}-{which}.bin", which, size)
        mapped.clear()
        for slot, tensor in placed:
            view = mapped.bytes[slot.offset:slot.offset + tensor.numel() * tensor.element_size()]
            view.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=tensor.is_cuda and mapped.pinned)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies above ran on the current stream, after the step's kernels
        token = uuid.uuid4().bytes
        weights.mkdir(parents=True, exist_ok=True)
        layout = {"world": world, "rank": rank, "token": token, "structure": structure,
                  "file": os.path.relpath(mapped.path, weights)}
        (weights / f"rank-{rank}.layout").write_bytes(pickle.dumps(layout))
        mapped.complete(token, sequence)
        self.last = which

    def keep(self, weights: Path, rank: int) -> None:
        """After loading from `weights`: if a snapshot of this rank's files, the next write leaves
        the file it came from alone (it stays the newest complete one until that write is)."""
        if is_snapshot(weights):
            name = Path(_layout(weights, rank)["file"]).name
            if name.startswith(f"rank-{rank}-") and name.endswith(".bin"):
                self.last = int(name[-5])

    def _choose(self, buffers: Path, rank: int) -> tuple[int, int]:
        """(file, sequence number) of the next write: not the file holding this rank's newest
        complete snapshot (the highest sequence number; a fresh process reads them from the headers)."""
        heads = [_read_head(buffers / f"rank-{rank}-{which}.bin") for which in (0, 1)]
        sequence = 1 + max(seq for _, seq in heads)
        if self.last is not None:
            return 1 - self.last, sequence
        if heads[0][0] is None or heads[1][0] is None:  # a file without a complete write goes first
            return (0 if heads[0][0] is None else 1), sequence
        return (0 if heads[0][1] < heads[1][1] else 1), sequence

    def _map(self, path: Path, which: int, size: int) -> _Mapped:
        mapped = self.mapped[which]
        if mapped is not None and mapped.path == path and mapped.current() and mapped.size == size:
            return mapped
        if mapped is not None:
            mapped.close()
            self.mapped[which] = None
        self.mapped[which] = _Mapped(path, size)
        return self.mapped[which]

    def close(self) -> None:
        for mapped in self.mapped:
            if mapped is not None:
                mapped.close()
        self.mapped = [None, None]


def _read_head(path: Path) -> tuple[bytes | None, int]:
    """(token of the complete write the file holds or None, its sequence number; 0 if none)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER)
    except OSError:
        return None, 0
    if len(head) < 32 or head[:8] != MAGIC:
        return None, 0
    return (None if head[8:24] == NO_TOKEN else head[8:24]), int.from_bytes(head[24:32], "little")


def is_snapshot(weights: Path) -> bool:
    """Whether a trainer's `weights` directory is a snapshot's (this module's format)."""
    return (weights / "rank-0.layout").is_file()


def problem(weights: Path, world: int) -> str | None:
    """Why the snapshot in `weights` cannot be loaded as a whole onto `world` ranks, judged from the
    first rank's part before anything is touched; None when it can."""
    try:
        layout = _layout(weights, 0)
        data = (weights / layout["file"])
        if _read_head(data)[0] != layout["token"]:
            return f"its data file {data.name} was overwritten by a later snapshot or its write was cut short"
        if layout["world"] != world:
            return (f"it was written by {layout['world']} ranks; this trainer has {world} (a checkpoint loads onto "
                    "any number)")
    except (OSError, pickle.UnpicklingError, KeyError, EOFError) as exc:
        return f"its layout or data is unreadable ({exc})"
    return None


def _layout(weights: Path, rank: int) -> dict:
    # The role's own snapshot directory, refused outside the run's roots (checkpoint._role_dir); as
    # trusted as the metadata torch.distributed.checkpoint unpickles from a checkpoint.
    return pickle.loads((weights / f"rank-{rank}.layout").read_bytes())


class _Reader:
    """A rank's layout and its data file, mapped read-only (copy on write: never written)."""

    def __init__(self, weights: Path, rank: int):
        self.layout = _layout(weights, rank)
        path = weights / self.layout["file"]
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if self.map[:8] != MAGIC or self.map[8:24] != self.layout["token"]:
            self.map.close()
            raise FailedPrecondition(f"the snapshot's data file {path} was overwritten by a later snapshot "
                                     "or its write was cut short")
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def tensor(self, slot: Slot) -> torch.Tensor:
        n = torch.Size(slot.shape).numel() * torch.empty((), dtype=slot.dtype).element_size()
        return self.bytes[slot.offset:slot.offset + n].view(slot.dtype).view(slot.shape)

    def close(self) -> None:
        del self.bytes
        self.map.close()


def load(state: dict, weights: Path, rank: int, world: int) -> None:
    """`state` (a trainer's live model and optimizer state dicts) filled in place from the snapshot in
    `weights`, as torch.distributed.checkpoint's load would: tensors copied into, other values
    replaced. Refused (FailedPrecondition) for a snapshot of another number of ranks or other shards."""
    readers = {rank: _Reader(weights, rank)}
    try:
        mine = readers[rank].layout
        if mine["world"] != world:
            raise FailedPrecondition(f"the snapshot was written by {mine['world']} ranks; this trainer has {world} "
                                     "(a checkpoint loads onto any number)")
        if rank != 0:
            readers[0] = _Reader(weights, 0)

        def fill(live, saved, first, where: str):
            """`saved`: this rank's structure; `first`: the first rank's, which places what it wrote."""
            for key in (live.keys() if isinstance(live, dict) else range(len(live))):
                if isinstance(live, dict) and key not in saved:
                    raise FailedPrecondition(f"the snapshot has no {where}{key}")
                value, kept, theirs = live[key], saved[key], first[key]
                if isinstance(value, torch.Tensor):
                    target = value.to_local() if _is_dtensor(value) else value
                    slot = theirs if isinstance(kept, Slot) and kept.rank != rank else kept
                    if not isinstance(slot, Slot) or tuple(target.shape) != slot.shape or target.dtype != slot.dtype:
                        raise FailedPrecondition(f"the snapshot's {where}{key} is not this trainer's shard "
                                                 f"({getattr(slot, 'shape', slot)} against {tuple(target.shape)})")
                    target.copy_(readers[slot.rank].tensor(slot))
                elif isinstance(value, (dict, list)) and isinstance(kept, type(value)):
                    fill(value, kept, theirs, f"{where}{key}.")
                else:
                    live[key] = kept

        fill(state, mine["structure"], readers[0].layout["structure"], "")
    finally:
        for reader in readers.values():
            reader.close()
