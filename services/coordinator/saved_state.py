"""The coordinator's part of a checkpoint (DESIGN "Checkpoints"), typed and versioned.

`coordinator.json` holds the run's position: after step `step`, the KL coefficient the next step
uses, the data position, the pipeline's counts, and the groups partial rollouts carry into the next
step (`source.py`) without their tensors. Those (each unfinished response's prompt and response
ids, rollout logprobs and the policy version of each token) go to `carried.safetensors` beside it,
as tensors: at 4k-token responses, JSON lists of floats were megabytes of text a step.

Versions: 4 is this layout: 3's, with the step's metrics record (logged once the checkpoint is
complete: a resume that finds it unlogged logs it). 3: a carried response is an episode
(`episodes.py`), with its loss mask, turns, conversation and whether it has ended. 2 (the same without those: single-turn responses) and 1
(every earlier release: carried tensors as JSON lists, and before that
the sync loop's {step, kl_coef, data} and the async pipeline's with counts) is read as it was
written. Anything else is refused with a message naming the file and the version, never misread.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, field, fields
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, NonNegativeInt, ValidationError
from pydantic.dataclasses import dataclass
from safetensors.torch import load_file, save

STATE_FILE = "coordinator.json"
TENSORS_FILE = "carried.safetensors"
STATE_VERSION = 4
READS = (1, 2, 3, 4)
_TENSORS = {"prompt_ids": torch.int64, "response_ids": torch.int64, "logprobs": torch.float32, "versions": torch.int64}
_OPTIONAL = {"own": torch.bool}  # version 3: an episode's loss mask, where it has observations


@dataclass(config=ConfigDict(extra="forbid"))
class PipelineCounts:
    """Run totals, the `pipeline/*` counts of the step records (docs/metrics.md). A sync run keeps
    them too (retries; the others stay 0), so its checkpoints resume in either mode."""

    stale_samples: NonNegativeInt = 0
    dropped_batches: NonNegativeInt = 0  # also what moves the data position past the steps (`batches_used`)
    regenerated_batches: NonNegativeInt = 0
    retries: NonNegativeInt = 0
    refill_batches: NonNegativeInt = 0  # batches beyond one per step (dynamic sampling); they move the data position too
    dropped_groups: NonNegativeInt = 0  # groups dynamic sampling left out (all their samples scored the same)


@dataclass(config=ConfigDict(arbitrary_types_allowed=True, extra="forbid"))
class CarriedResponse:
    """One unfinished response of a carried group, as partial rollouts left it."""

    sample_index: NonNegativeInt
    finish_reason: int
    text: str
    carries: NonNegativeInt  # steps it has been carried into
    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor  # float32 [R]: the rollout's, of each token
    versions: torch.Tensor  # int64 [R]: the policy version that made each token
    full: bool = False  # the model's positions are full: the actor answered no tokens (versions 1-2)
    # Version 3: the episode's own record of where it is (before, derived from the finish reason).
    done: bool | None = None  # it has ended (its group waits for the others)
    own: torch.Tensor | None = None  # bool [R]: the model's tokens (None: all of them, a single turn)
    turn_from: NonNegativeInt = 0  # where its last turn began in the response
    turns: NonNegativeInt = 1
    messages: list[dict[str, str]] = field(default_factory=list)  # multi-turn: the conversation as text
    pending: list[dict[str, str]] = field(default_factory=list)  # the observation its next turn follows
    answered: bool = False
    tool_calls: NonNegativeInt = 0
    tool_errors: NonNegativeInt = 0
    tool_timeouts: NonNegativeInt = 0
    env_error: str = ""
    env_reward: float | None = None


@dataclass(config=ConfigDict(extra="forbid"))
class CarriedGroup:
    """A group partial rollouts carry into the next step: which prompt of which data batch it is
    (checked against the data on resume) and its responses so far."""

    batch: NonNegativeInt
    prompt: NonNegativeInt
    group_id: NonNegativeInt
    prompt_sha: str
    responses: list[CarriedResponse]


@dataclass(config=ConfigDict(extra="forbid"))
class CoordinatorState:
    """The coordinator's part of a checkpoint, the same in both modes."""

    step: NonNegativeInt
    kl_coef: float
    data: dict[str, Any] | None = None  # PromptDataset.state_dict(); None in the checkpoint of step 0
    counts: PipelineCounts = field(default_factory=PipelineCounts)
    carried: list[CarriedGroup] = field(default_factory=list)  # partial rollouts' unfinished groups
    # The step's metrics record (version 4). A checkpoint or snapshot is complete before its step's
    # record is logged; a coordinator killed between the two resumes with the record from here.
    record: dict[str, Any] | None = None

    @property
    def batches_used(self) -> int:
        """Rollout batches of the data the run has consumed: its steps', the dropped ones and the refills."""
        return self.step + self.extra_batches

    @property
    def extra_batches(self) -> int:
        """Batches consumed beyond one per step: batch k + extra_batches is the next step's (one each)."""
        return self.counts.dropped_batches + self.counts.refill_batches


def write_state(directory: Path, state: CoordinatorState, write_bytes) -> None:
    """`state` into `directory`: the carried tensors first, then coordinator.json (`write_bytes(path,
    data)`: an atomic write), which names the tensors file it goes with."""
    # Each its own copy: a group's responses share their prompt's ids, which safetensors refuses.
    tensors = {f"{g}.{r}.{name}": getattr(resp, name).clone()
               for g, group in enumerate(state.carried) for r, resp in enumerate(group.responses)
               for name in [*_TENSORS, *_OPTIONAL] if getattr(resp, name) is not None}
    doc: dict[str, Any] = {"version": STATE_VERSION, "step": state.step, "kl_coef": state.kl_coef,
                           "counts": asdict(state.counts)}
    if state.data is not None:
        doc["data"] = state.data
    if state.record is not None:
        doc["record"] = state.record
    if state.carried:
        write_bytes(directory / TENSORS_FILE, save(tensors))
        doc["carried"] = [{**{k: getattr(g, k) for k in _fields(CarriedGroup) if k != "responses"},
                           "responses": [{k: getattr(r, k) for k in _fields(CarriedResponse)
                                          if k not in _TENSORS and k not in _OPTIONAL}
                                         for r in g.responses]} for g in state.carried]
    write_bytes(directory / STATE_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


def read_state(directory: Path) -> CoordinatorState:
    """The state `write_state` wrote (or an earlier version, `READS`); ValueError naming the file,
    the version or the key for anything else."""
    path = directory / STATE_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read ({exc})") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if version not in READS:
        raise ValueError(f"{path} is of state version {version!r}; this coordinator reads versions "
                         f"{', '.join(map(str, READS))} (a checkpoint of another RoleFleet release: resume it with that one)")
    tensors: dict[str, torch.Tensor] = {}
    if version >= 2 and doc.get("carried"):
        try:
            tensors = load_file(directory / TENSORS_FILE)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{directory / TENSORS_FILE}: cannot be read ({exc})") from None
    return from_document(doc, tensors)


def from_document(doc: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> CoordinatorState:
    """A state from coordinator.json's document; the carried responses' tensors from `tensors`
    (version 2) or from the document's lists (version 1). ValueError naming what is wrong."""
    doc = {k: v for k, v in doc.items() if k != "version"}
    carried = doc.pop("carried", None) or []
    if not isinstance(carried, list):
        raise ValueError("carried: not a list of carried groups")
    try:
        groups = [_group(g, i, tensors) for i, g in enumerate(carried)]
        state = CoordinatorState(**doc, carried=groups)
    except ValidationError as exc:
        raise ValueError(_first_error(exc)) from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"carried: not a list of carried groups ({exc!r})") from None
    if not math.isfinite(state.kl_coef):
        raise ValueError(f"kl_coef: {state.kl_coef!r} is not a finite number")
    return state


def _group(g: dict[str, Any], index: int, tensors: dict[str, torch.Tensor] | None) -> CarriedGroup:
    responses = []
    for r, resp in enumerate(g["responses"]):
        arrays = {name: (tensors[f"{index}.{r}.{name}"] if tensors else torch.tensor(resp[name], dtype=dtype))
                  for name, dtype in _TENSORS.items()}
        arrays.update({name: tensors[key] for name in _OPTIONAL if tensors and (key := f"{index}.{r}.{name}") in tensors})
        responses.append(CarriedResponse(**{k: v for k, v in resp.items() if k not in _TENSORS}, **arrays))
    return CarriedGroup(**{**g, "responses": responses})


def _fields(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or "state"
    return f"{where}: {error['msg']} (got {error.get('input')!r})"
