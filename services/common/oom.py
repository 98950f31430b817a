"""Out of device memory as a clear, recoverable error: RESOURCE_EXHAUSTED naming the phase that ran
out, the memory in use and the settings that lower what the phase needs.

The failed call's tensors are freed here, not when its exception is garbage some time later: the
exception's traceback holds every frame of the failed forward or backward, and with them the
activations and the autograd graph (138 of 139.8 GiB stayed held on an H200 until this cleared
them). A trainer's gradients are dropped at the start of its next step. Cached blocks go back to
the device, the role stays SERVING and no state changed (an update's first optimizer step had not
begun; one that fails inside Adam is a partial update and blocks the role as before), so a smaller
request succeeds afterwards.
"""

from __future__ import annotations

import gc
import traceback
from typing import Optional

import torch

from rolefleet.common.errors import LimitExceeded

# (role, RPC) -> (phase, the settings that lower its memory)
PHASES: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("actor", "Generate"): ("generate", ("actor.rollout.batch_size", "sampling.max_new_tokens",
                                         "actor.rollout.vllm.gpu_memory_utilization (vllm)")),
    ("actor", "ComputeLogProbs"): ("logprobs", ("actor.max_tokens_per_micro_batch", "actor.logprob_chunk_tokens",
                                                "actor.ref_offload=true")),
    ("actor", "Update"): ("update", ("actor.max_tokens_per_micro_batch", "actor.gradient_checkpointing=true",
                                     "actor.logprob_chunk_tokens", "actor.ref_offload=true",
                                     "more GPUs in devices.actor (FSDP shards the model over them)")),
    ("critic", "ComputeValues"): ("values", ("critic.max_tokens_per_micro_batch",)),
    ("critic", "Update"): ("update", ("critic.max_tokens_per_micro_batch", "critic.gradient_checkpointing=true",
                                      "more GPUs in devices.critic (FSDP shards the model over them)")),
    ("reward", "Score"): ("model", ("reward.model_max_tokens_per_batch", "reward.model_dtype")),
}


class OutOfMemory(LimitExceeded):
    """A call that ran out of device memory; `field` names the role and phase."""


def explain(role: str, method: str, exc: torch.OutOfMemoryError) -> OutOfMemory:
    """The OutOfMemory error a servicer answers for `exc`, after freeing what the failed call held and
    giving cached memory back."""
    _drop_frames(exc)
    gc.collect()  # tensors the frames held through reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    phase, knobs = PHASES.get((role, method), (method, ()))
    lower = f"; lower it with {', '.join(knobs)}" if knobs else ""
    return OutOfMemory(f"{role} {phase}", f"out of device memory{_in_use()}{lower} ({_first_line(exc)})")


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame `exc` (and the exceptions it chains) carries; the
    frames still running (the servicer's own) are left as they are."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _in_use() -> str:
    if not torch.cuda.is_available():
        return ""
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return (f" on cuda:{device}: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, "
            f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB held by tensors after the failed call")


def _first_line(exc: BaseException) -> Optional[str]:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
