"""The rollout engine of an actor rank, by backend (`actor.rollout.backend`, chosen in
`rollout.choose_backend`): the one place that knows each engine's constructor."""

from __future__ import annotations

import logging
import os

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.actor.rollout import RolloutEngine
from rolefleet.actor.rollout_hf import HFRolloutEngine
from rolefleet.actor.rollout_vllm import VllmRolloutEngine
from rolefleet.common.config import ActorSection
from rolefleet.common.modeling import compute_dtype
from rolefleet.trainer.workers import local_index

log = logging.getLogger(__name__)


def make_engine(backend: str, cfg: ActorSection, policy: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase,
                device: torch.device, stop_ids: tuple[int, ...], seed: int,
                gpu_ranks: list[int] | None = None) -> RolloutEngine:
    """`policy`: the trainer's model on this rank (None on a rollout rank, or a skeleton whose shards
    the trainer has yet to read: the engine loads its own copy); `gpu_ranks`: the actor ranks whose
    GPUs an engine in processes of its own spans (None: in this process)."""
    log.info("rollout backend: %s", backend)
    if backend == "vllm":
        try:
            gpus = None if gpu_ranks is None else [visible_gpus()[local_index(r)] for r in gpu_ranks]
            return VllmRolloutEngine(policy, tokenizer, cfg, cfg.model_name_or_path, stop_ids, seed, gpus)
        except Exception as exc:  # an installed vLLM that cannot start here (its torch pin, say)
            if cfg.rollout.backend == "vllm" or gpu_ranks is not None:  # the trainers expect vLLM's
                raise
            log.warning("actor.rollout.backend=auto: vLLM is installed but did not start (%s); using hf", exc)
    return HFRolloutEngine(policy, tokenizer, device, cfg, compute_dtype(device, cfg.compute_dtype), stop_ids)


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (the i-th rank on a node drives entry i)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
