"""torch.profiler around chosen updates of a trainer role (`<role>.profile_updates`) and chosen
engine calls of the actor's rollout workers (`actor.rollout.profile_generates`): where their time
goes, per worker rank, before anyone optimizes it (docs/operations.md "Profiling")."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from rolefleet.trainer.ranks import Ranks

log = logging.getLogger(__name__)
TABLE_ROWS = 40


@contextlib.contextmanager
def profiled(role: str, number: int, wanted: Sequence[int], out: str, rank: int,
             what: str = "update") -> Iterator[None]:
    """Profile this process's `number`-th `what` (1: its first) when it is one of `wanted`: a Chrome
    trace and a table of the ops by device time (CPU time without a GPU) go to `out`, named
    `<role>-<what><number>-rank<rank>`."""
    if number not in wanted:
        yield
        return
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        yield
        if cuda:
            torch.cuda.synchronize()
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"{role}-{what}{number}-rank{rank}"
    profile.export_chrome_trace(f"{stem}.json")
    table = profile.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                         row_limit=TABLE_ROWS)
    Path(f"{stem}.txt").write_text(table)
    log.info("%s: %s %d profiled on rank %d: %s.json, %s.txt", role, what, number, rank, stem, stem)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 before anything imported it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (tracing, lowering,
    codegen; 0 before anything imported it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return float(sum(utils.compilation_time_metrics.get("_compile.compile_inner", ()))) if utils is not None else 0.0


class NewGraphs:
    """The graphs torch.compile made since the last `take` (a trainer's: its update's and the
    logprob passes' before it), in this process and, from `take_over_ranks`, in all of the role's
    worker processes. A new input shape or mode that no compiled graph covers compiles another,
    seconds on a GPU paid by the call that meets it: logged by the process that made it once the
    first update's compiling is over."""

    def __init__(self, role: str) -> None:
        self.role, self.seen, self.seconds, self.takes = role, compiled_graphs(), compile_seconds(), 0

    def take(self) -> tuple[int, float]:
        """(graphs, seconds compiling) since the last take."""
        now, seconds = compiled_graphs(), compile_seconds()
        new, spent = now - self.seen, seconds - self.seconds
        self.seen, self.seconds = now, seconds
        self.takes += 1
        if new and self.takes > 1:
            log.info("%s: torch.compile made %d graph(s) in %.1f s since the last update (a new shape or mode; "
                     "TORCH_LOGS=recompiles names the guard that failed)", self.role, new, spent)
        return new, spent

    def take_over_ranks(self, ranks: Ranks) -> dict[str, float]:
        """`take` over `ranks` (collective: every rank of the part calls it): {compiled_graphs: summed,
        compile_seconds: the most any rank spent (they compile side by side)}, with the update's
        device memory (`DeviceMemory.take`, the most of any rank). A rank compiles alone when only
        its share of the micro-batches has a new shape (no padding, more tokens past an Inductor
        size heuristic): rank 0's count alone would miss it."""
        graphs, seconds = self.take()
        gathered = ranks.all_gather({"graphs": graphs, "seconds": seconds, **DeviceMemory.take()})
        stats = {"compiled_graphs": sum(int(g["graphs"]) for g in gathered),
                 "compile_seconds": max(float(g["seconds"]) for g in gathered)}
        for key in DeviceMemory.KEYS:
            if key in gathered[0]:
                stats[key] = max(float(g[key]) for g in gathered)
        return stats


class DeviceMemory:
    """An update's GPU memory as PyTorch's allocator counts it: `peak_memory_gib`, the most its
    tensors held at once (from `start`); `memory_gib`, what stays held after it (weights, optimizer
    state, gradients, the engine's kept decode state). The first says how close an update came to
    running out; the second growing from step to step is a leak. Nothing off CUDA."""

    KEYS = ("peak_memory_gib", "memory_gib")

    @staticmethod
    def start() -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    @staticmethod
    def take() -> dict[str, float]:
        if not torch.cuda.is_available():
            return {}
        return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                "memory_gib": torch.cuda.memory_allocated() / 2**30}
