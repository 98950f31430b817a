"""What a snapshot's write costs the work beside it in the same process (docs/benchmarks.md,
"Snapshot writes beside generation"). The actor's hf decode loop is host-bound (a Python loop
launching one CUDA graph per token): here a host-bound stand-in (small tensor operations and Python
bookkeeping) runs alone, then beside a write of a state of `--gib` GiB from a thread: a `dcp.save`
at each `--threads` count of writing threads (how snapshots were written until 2026-12-06, and how
checkpoints are), and the copy into a memory-mapped buffer file that snapshots are now
(`trainer/snapshot_file.py`; its second write, the first allocates the file's pages).

    python benchmarks/write_contention.py --out OUT [--gib 1] [--threads 1 2 4 8] [--dir /dev/shm]

Prints one JSON line per way and writes OUT/write_contention.json: the write's seconds, the
stand-in's median seconds a round beside it, and that over its median alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch


def host_round(n: int = 3000) -> float:
    """Seconds of one round of host-bound work."""
    x = torch.zeros(64)
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
        x[:8].sum()
        [j for j in range(20)]  # the loop's own bookkeeping
    return time.perf_counter() - start


def beside_write(state: dict, directory: Path, threads: int) -> dict:
    """Beside a `dcp.save` of `threads` threads (0: the mapped copy, written once before)."""
    import torch.distributed.checkpoint as dcp

    from rolefleet.trainer.snapshot_file import SnapshotBuffers

    path = Path(tempfile.mkdtemp(dir=directory))
    done, seconds = threading.Event(), []
    buffers = SnapshotBuffers()
    if not threads:
        buffers.write(state, path / "first", path / "buffers", 0, 1)  # the files' pages allocated
        buffers.write(state, path / "second", path / "buffers", 0, 1)

    def write():
        start = time.perf_counter()
        if threads:
            dcp.save(state, checkpoint_id=str(path), no_dist=True,
                     storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads))
        else:
            buffers.write(state, path / "third", path / "buffers", 0, 1)
        seconds.append(time.perf_counter() - start)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    rounds = []
    while not done.is_set():
        rounds.append(host_round())
    writer.join()
    buffers.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"write_s": seconds[0], "round_s": statistics.median(rounds), "rounds": len(rounds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="dcp.save's writing threads; "
                   "0: the mapped copy")
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = 16
    state = {f"w{i}": torch.randn(int(args.gib * 2**30 / 4 / tensors)) for i in range(tensors)}
    alone = statistics.median(host_round() for _ in range(9))
    results = {"gib": args.gib, "round_alone_s": alone, "by_threads": {}}
    for threads in args.threads:
        r = beside_write(state, Path(args.dir or tempfile.gettempdir()), threads)
        r["slowdown"] = r["round_s"] / alone
        results["by_threads"][threads] = r
        print(json.dumps({"way": "mapped copy" if not threads else f"dcp.save, {threads} threads", **r}), flush=True)
    (out / "write_contention.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
