"""The rollout-engine base (DESIGN "Engines"): what the actor asks of any backend.

An engine owns its own copy of the policy weights in its own precision; the trainer owns the fp32
master weights and hands them over after every update, through the actor's weight transport
(`actor/transport.py`): in place (`load_weights`), or over a link of the engine's own
(`join_weight_transfer`, `receive_weights`). The recorded logprob of a sampled token follows the
project's convention (docs/algorithms.md): log softmax(logits / temperature) of the engine's own
forward, before top-k / top-p truncation.

A new backend is one file: a subclass of `RolloutEngine`, registered in `actor/engines.py`.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import torch

from rolefleet.actor.types import Sample, SamplingParams


class RolloutEngine(ABC):
    @property
    @abstractmethod
    def name(self) -> str:
        """Which engine generates, as status, metrics and logs say it (a fallback shows here)."""

    @abstractmethod
    def generate(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams,
                 policy_version: int) -> Iterator[list[Sample]]:
        """n samples per prompt, yielded a batch of finished samples at a time."""

    @abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the trainer's weights (by parameter name) into the engine's own."""

    def join_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's link for weights that travel to the engine's own processes."""
        raise NotImplementedError(f"{type(self).__name__} takes weights in place only (load_weights)")

    def receive_weights(self, update_info: dict) -> None:
        """Load the weights the trainer sends now over the joined link."""
        raise NotImplementedError(f"{type(self).__name__} takes weights in place only (load_weights)")

    def sleep(self) -> None:  # noqa: B027 - optional: an engine may hold nothing to release
        """Release caches and compiled buffers (the trainer needs the memory)."""

    def wake(self) -> None:  # noqa: B027 - optional, as `sleep`
        """Undo `sleep` before the next `generate`."""

    def take_stats(self) -> dict[str, float]:
        """Figures for the step's record since the last take (an engine may keep none)."""
        return {}

    def reset_cache(self) -> None:  # noqa: B027 - optional: an engine may cache no prefixes
        """Drop any cached prefixes: they were computed with the previous weights."""

    def close(self) -> None:  # noqa: B027 - optional: an engine may start no processes
        """Stop anything the engine started (its own processes)."""


def derived_seed(seed: int, index: int) -> int:
    """The seed of part `index` of a request seeded with `seed` (-1: unseeded stays unseeded):
    parts draw independent streams, and the same request draws the same ones again."""
    return -1 if seed < 0 else (seed * 1_000_003 + index) % 2**62


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def backend_problem(backend: str, has_gpu: bool, installed: bool, workers: int = 1, split: bool = False) -> str | None:
    """Why `actor.rollout.backend` cannot run here, or None. `workers`: the actor's worker processes;
    `split`: some of them only generate (`devices.rollout`)."""
    if backend != "vllm":
        return None
    if workers > 1 and not split:
        # Each worker would need an engine beside its trainer on the same GPU, taking weights in
        # place; vLLM's engines take them over NCCL from a trainer on other GPUs (split placement).
        return (f"vllm runs in an actor of one worker process, or with its rollout GPUs apart from its "
                f"training GPUs; this actor has {workers} workers that each train and generate: set "
                "devices.rollout to some of devices.actor, give the actor one GPU, or set actor.rollout.backend=hf")
    if not installed:
        return ("vllm is not installed in this environment: install it as README.md's GPU install section says, "
                "or set actor.rollout.backend=hf")
    if not has_gpu:
        return "vllm needs a CUDA GPU and the actor has none: give it devices.actor, or set actor.rollout.backend=hf"
    return None


def choose_backend(backend: str, has_gpu: bool, installed: bool, workers: int = 1, split: bool = False) -> str:
    """The engine `actor.rollout.backend` selects: `auto` is vllm where it is installed, a GPU is
    visible and the actor is one process or generates apart from training, else hf. Raises
    ValueError naming the key when `vllm` is asked for and cannot run."""
    if (problem := backend_problem(backend, has_gpu, installed, workers, split)) is not None:
        raise ValueError(f"actor.rollout.backend: {problem}")
    if backend == "auto":
        return "vllm" if backend_problem("vllm", has_gpu, installed, workers, split) is None else "hf"
    return backend
