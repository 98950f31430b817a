"""Checkpoints of the trainer roles and of the run (DESIGN "Checkpoints").

One checkpoint is a directory `<run>/checkpoints/step-00000012/`:

    actor/            the actor's trainer (below)
    critic/           the critic's, the same way
    coordinator.json  the coordinator's: step, data position, KL coefficient, counts, carried groups
    carried.safetensors  their responses' tensors (partial rollouts only; coordinator/saved_state.py)
    MANIFEST.json     written last, after every role confirmed: a directory without it is incomplete
                      and never loaded

A trainer's directory:

    weights/          model and optimizer state through torch.distributed.checkpoint: one file per
                      training rank (FSDP shards stay shards), loadable onto any number of ranks;
                      the trainable parameters only (with LoRA: the adapters; the frozen base is
                      the role's model_name_or_path, read again at start)
    trainer.pt        LR scheduler, mini-batch generator and torch RNG states
    role.json         model version, last applied step and the ledger's recorded results
    hf/               the model's config.json and tokenizer (with LoRA, peft's adapter_config.json
                      naming the base model): with weights/, what `rolefleet export` turns into a
                      Hugging Face directory

Every file appears atomically: a role writes into `<dir>.partial` and renames it to `<dir>` when all
its ranks are done; the coordinator writes its file and the manifest through a temporary name. A
save interrupted anywhere leaves either no `<dir>` or no manifest, and resume takes the previous one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rolefleet.common.errors import FailedPrecondition, InvalidArgument
from rolefleet.common.role_types import CheckpointInfo
from rolefleet.trainer import snapshot_file
from rolefleet.trainer.snapshot_file import SnapshotBuffers

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds either its old content or all of `data`, whatever happens meanwhile."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def begin(path: Path) -> Path:
    """Before a role writes its directory: a clean `<path>.partial` (a failed attempt's is removed)."""
    work = partial(path)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def commit(path: Path) -> None:
    """After every rank wrote into `<path>.partial`: it becomes `path` in one rename."""
    os.replace(partial(path), path)
    _fsync_dir(path.parent)


def _cpus() -> int:
    """The CPUs this process may run on (a container's cpuset, a `taskset`), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Threads writing one rank's checkpoint files: one thread wrote 0.9 GiB/s on a 2-core machine (four:
# 1.8); the run waits for a checkpoint, so it takes as many as help.
WRITE_THREADS = max(1, min(8, _cpus()))


# --- a trainer's state --------------------------------------------------------------------------

def save_trainer(work: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 generator: torch.Generator, ranks, snapshot: tuple[SnapshotBuffers, Path] | None = None) -> None:
    """SPMD over the training ranks (`ranks`: theirs): weights and optimizer state, each rank its
    shards; the first rank writes trainer.pt. A failure (a full disk) is a role error alike on every
    rank: the save is refused, nothing changed. `snapshot` (buffers, their directory): the state
    copied into the rank's snapshot buffer files (`snapshot_file`), not written with DCP."""
    # the coordinator imports this module and saves no trainer: torch.distributed.checkpoint (0.4 s) not for it
    import torch.distributed.checkpoint as dcp

    try:
        model_state, optim_state = _trainable_state(model, optimizer)
        work.mkdir(parents=True, exist_ok=True)
        if ranks.first:  # small, and what the state dicts do not hold: written now
            torch.save({"scheduler": scheduler.state_dict(), "generator": generator.get_state(),
                        "torch_rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                       work / "trainer.pt")
        state = {"model": model_state, "optim": optim_state}
        if snapshot is not None:
            buffers, directory = snapshot
            buffers.write(state, work / "weights", directory, ranks.rank, ranks.world)
            return
        with _one_process_is_fine():
            writer = dcp.FileSystemWriter(str(work / "weights"), thread_count=WRITE_THREADS)
            dcp.save(state, checkpoint_id=str(work / "weights"), storage_writer=writer, process_group=ranks.group)
    except (Exception, dcp.CheckpointException) as exc:  # dcp's errors derive from BaseException
        raise FailedPrecondition(f"saving the checkpoint to {work} failed: {exc}") from exc


def load_trainer(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 generator: torch.Generator, ranks) -> None:
    """SPMD over the training ranks: the inverse of `save_trainer`, resharded to this group (a
    snapshot: onto the same shards alone). A failure is a role error alike on every rank (the caller
    marks the role broken: the weights may be half loaded)."""
    # the coordinator imports this module and saves no trainer: torch.distributed.checkpoint (0.4 s) not for it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict  # as above

    try:
        model_state, optim_state = _trainable_state(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        if snapshot_file.is_snapshot(path / "weights"):
            snapshot_file.load(state, path / "weights", ranks.rank, ranks.world)
        else:
            with _one_process_is_fine():
                dcp.load(state, checkpoint_id=str(path / "weights"), process_group=ranks.group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_trainable_options())
        extra = torch.load(path / "trainer.pt", weights_only=True)  # tensors and plain values: never code
        scheduler.load_state_dict(extra["scheduler"])
        generator.set_state(extra["generator"])
        torch.set_rng_state(extra["torch_rng"])
        if extra["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["cuda_rng"][:torch.cuda.device_count()])
    except (Exception, dcp.CheckpointException) as exc:
        raise FailedPrecondition(f"loading the checkpoint {path} failed: {exc}") from exc


def _trainable_options():
    """A trainer's state is what it trains: frozen parameters (a LoRA base model) are left out, and
    loading leaves them as they are (not strict: their keys are absent by design; DCP's load still
    refuses a checkpoint that lacks any key asked for)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # as in save_trainer: not for the coordinator

    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts without frozen parameters, under every name of each
    (a tied LM head shares the frozen embeddings' tensor under a second name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # as in save_trainer: not for the coordinator

    model_state, optim_state = get_state_dict(model, optimizer, options=_trainable_options())
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


@contextmanager
def _one_process_is_fine():
    """A role of one process saves and loads without torch.distributed, as meant: no warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_hf_files(work: Path, model_config, tokenizer=None) -> None:
    """What export needs besides the weights: the architecture (and the tokenizer, for the actor)."""
    model_config.save_pretrained(work / "hf")
    if tokenizer is not None:
        tokenizer.save_pretrained(work / "hf")


# --- the run's checkpoints ----------------------------------------------------------------------

def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint under `root` whose manifest was written, by step."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / MANIFEST).is_file():
                try:
                    manifest = json.loads((entry / MANIFEST).read_text())
                except (OSError, ValueError):
                    continue  # unreadable: treated as incomplete
                if manifest.get("step") == int(match.group(1)):
                    found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints, and incomplete ones older than the
    newest complete one (an interrupted save). Returns what was removed."""
    done = complete_checkpoints(root)
    removed = [path for _, path in done[:-keep]] if keep > 0 else []
    newest = done[-1][0] if done else 0
    for entry in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(entry.name.removesuffix(".partial"))
        if match and int(match.group(1)) < newest and not (entry / MANIFEST).is_file() and entry not in removed:
            removed.append(entry)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# --- a trainer role's side of SaveCheckpoint / LoadCheckpoint -----------------------------------
# The core's trainer lock is held by the caller; `ranks` are its training ranks, each of which runs
# the core's SPMD `_save_state(work)` / `_load_state(path)`.

def _role_dir(core, path: str) -> Path:
    """The directory a request names, refused unless under the role's checkpoint root (a server's is
    its run's `checkpoint.dir`): a caller never gets a role to write, replace or load elsewhere."""
    if not path:
        raise InvalidArgument("path", "no checkpoint directory given")
    if "\x00" in path:
        raise InvalidArgument("path", "has a NUL character")
    target = Path(path)
    roots = [Path(r).resolve() for r in (core.checkpoint_root, core.snapshot_root) if r is not None]
    if roots and not any(target.resolve().is_relative_to(root) for root in roots):
        raise InvalidArgument("path", f"{path} is outside the run's checkpoint directory {core.checkpoint_root} "
                              f"(checkpoint.dir) and its snapshot directory {core.snapshot_root} "
                              "(checkpoint.snapshot.dir)")
    return target


def is_snapshot(core, path: str) -> bool:
    """Whether `path` names one of the role's per-step snapshots (no export files; pruned by the role)."""
    root = core.snapshot_root
    return root is not None and Path(path).resolve().is_relative_to(Path(root).resolve())


def prune_snapshots(root: Path, role: str, keep: int) -> None:
    """The role's own snapshots under `root` (`<instance>/step-N/<role>`), all but the newest `keep`
    removed: on a machine of its own (a pod's memory volume) the coordinator's pruning never
    reaches them."""
    done = sorted((int(m.group(1)), d / role) for d in root.glob("*/step-*") if (m := _STEP_DIR.match(d.name))
                  and (d / role / "role.json").is_file())
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):  # the step's directory, once no role's part is left in it
            path.parent.rmdir()


ROLE_KEYS = ("model_version", "last_step")


def read_role_json(path: Path) -> dict | None:
    """The role's record of a checkpoint directory; None unless it is one (a JSON object with its keys)."""
    try:
        saved = json.loads((path / "role.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), int) for k in ROLE_KEYS) \
            or not isinstance(saved.get("results", []), list):
        return None
    return saved


def _missing_parts(path: Path, world: int) -> list[str]:
    """What a trainer checkpoint directory lacks, or why its snapshot's data cannot be read, checked
    before anything is loaded."""
    if snapshot_file.is_snapshot(path / "weights"):
        problem = snapshot_file.problem(path / "weights", world)
        missing = [problem] if problem else []
    else:
        missing = [] if (path / "weights/.metadata").is_file() else ["no weights/.metadata"]
    return missing + ([] if (path / "trainer.pt").is_file() else ["no trainer.pt"])


def save_role(core, step: int, path: str, save_state: Callable[[str], Any],
              write_hf_files: Callable[[Path], None], before_writing: Callable[[], None] = lambda: None,
              on_repeat: Callable[[], None] = lambda: None) -> CheckpointInfo:
    """`core`'s trainer into `path` (`save_state(work)` writes its shards over the training ranks);
    `before_writing()` once it is known to be no repeat, `on_repeat()` when it is one."""
    target = _role_dir(core, path)
    saved = read_role_json(target)
    if saved is not None and saved["last_step"] == step:  # a repeat (the next step may have run since): on disk
        on_repeat()
        return CheckpointInfo(step, saved["model_version"])
    last = core.state.ledger.last_step
    if step != last:
        raise FailedPrecondition(f"a checkpoint of step {step} was asked for; the {core.state.role}'s last "
                                 f"applied step is {last}")
    # Only a checkpoint of this role (of another step) is ever replaced: a request naming a file, the
    # checkpoint root or a step directory must not delete what is there.
    try:
        occupied = target.is_file() or (saved is None and target.is_dir() and any(target.iterdir()))
    except OSError as exc:  # a name too long, a directory we may not read
        raise InvalidArgument("path", f"cannot use {target}: {exc.strerror or exc}") from None
    if occupied:
        raise InvalidArgument("path", f"{target} exists and is not a {core.state.role} checkpoint; nothing "
                              "there is replaced")
    before_writing()
    try:
        work = begin(target)
    except OSError as exc:
        raise InvalidArgument("path", f"cannot write {target}: {exc}") from exc
    try:
        save_state(str(work))
        write_hf_files(work)
        write_json(work / "role.json", core.state.to_json())
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # nothing half written is left behind
        raise
    shutil.rmtree(target, ignore_errors=True)  # a save of another step at the same path
    commit(target)
    return CheckpointInfo(step, core.state.version)


def load_role(core, path: str, load_state: Callable[[str], None]) -> CheckpointInfo:
    """`core`'s trainer from `path` (`load_state(path)` over the training ranks)."""
    source = _role_dir(core, path)
    saved = read_role_json(source)
    if saved is None:
        raise InvalidArgument("path", f"no {core.state.role} checkpoint at {source} (role.json missing or unreadable)")
    if missing := _missing_parts(source, core.training_ranks()):  # refused before the model is touched: the role stays whole
        raise InvalidArgument("path", f"{source} is no complete {core.state.role} checkpoint: {', '.join(missing)}")
    try:
        load_state(str(source))
    except Exception as exc:  # the weights may be half loaded: neither the old state nor the saved one
        core.state.ledger.broken = f"loading the checkpoint {source} failed: {exc}"
        raise FailedPrecondition(core.state.ledger.broken) from exc
    core.state.restore(saved)
    return CheckpointInfo(saved["last_step"], saved["model_version"])
