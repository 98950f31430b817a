"""What a run's pods ask a Kubernetes node for besides GPUs, and what its checkpoints take on the
runs volume: the numbers `rolefleet deploy helm-values` writes as each role's `resources.requests`
and as `persistence.size` and `persistence.checkpointSize` (docs/deploy-kubernetes.md).

Host memory of a role's pod, from the planner's model dimensions (app/memory.py):

- each process its own footprint (`PROCESS_BYTES`: Python, torch, the CUDA libraries), the role's
  server and every worker;
- a trainer's worker loads its model on the host in fp32 before moving it to its GPU
  (common/modeling.py), all workers of a pod at once: each counts one model's fp32 bytes;
- what offloading keeps in host memory (the planner's `host` parts: AdamW state, a reference);
- on the CPU, all that the planner counts on a GPU is in host memory instead;
- the reward role: its function and environment worker processes, and its reward models.

These are requests, what the scheduler reserves, and never limits: the estimate counts the large
tensors, not the allocator's slack or the page cache, and a limit under the real peak would kill a
trainer mid-step (the memory-backed /dev/shm counts against it as well).

A trainer pod's per-step snapshots (`checkpoint.snapshot`) are in memory, on the chart's
memory-backed volume, and so count against the pod's memory: its request adds them (a trainer that
restarts in its pod loads its model again beside them), and they size `snapshots.sizeLimit`.

A checkpoint (trainer/checkpoint.py) holds, per trainer role, the trainable parameters' fp32
weights and both AdamW moments (12 bytes a parameter; with LoRA the adapters alone), and small
files beside them; the volume keeps `checkpoint.keep` of them plus the one being written, which is
complete before the oldest is removed.
"""

from __future__ import annotations

import math

from rolefleet.app import memory
from rolefleet.app.memory import GIB, SNAPSHOTS_HELD, ModelDims, trainer_state_bytes
from rolefleet.common.config import ConfigError, RoleFleetConfig

PROCESS_BYTES = 3 * GIB  # one process that imports torch, before any tensor of its own
HELPER_PROCESS_BYTES = GIB // 2  # a reward function or environment worker (no torch model)
CPUS_PER_GPU_WORKER = 2  # one drives the GPU's kernels; one for collation, compiles and NCCL's threads
TRAINER_FILES_BYTES = 64 * 2**20  # hf/ (config, tokenizer), trainer.pt and role.json of one trainer
# The coordinator's copy of a token of a step in flight: ids, masks, logprobs, values, advantages.
COORDINATOR_BYTES_PER_TOKEN = 64
LOG_HEADROOM_BYTES = 10 * GIB  # metrics.jsonl, the journal, TensorBoard events, traces: beside the checkpoints
TRAINERS = ("actor", "critic")


def gib(nbytes: float) -> str:
    """Bytes as a Kubernetes quantity in whole GiB, rounded up."""
    return f"{max(1, math.ceil(nbytes / GIB))}Gi"


# --- pods and workers ---------------------------------------------------------------------------

def pods(cfg: RoleFleetConfig, role: str) -> int:
    """Pods of a trainer role: one per node its devices name, or `<role>.nodes` on the CPU."""
    named = len(cfg.devices.by_node(role))
    return named if named > 1 else (getattr(cfg, role).nodes or 1)


def workers_per_pod(cfg: RoleFleetConfig, role: str) -> int:
    """Worker processes in each pod of a trainer role: its GPUs there, or its CPU workers' share."""
    gpus = len(getattr(cfg.devices, role))
    section = getattr(cfg, role)
    return max(1, (gpus or section.workers or 1) // pods(cfg, role))


def _model_dims(path: str) -> ModelDims | None:
    """The model's dimensions, or None where its config.json cannot be read from here."""
    try:
        return ModelDims.read(path)
    except ConfigError:
        return None


# --- host memory --------------------------------------------------------------------------------

def trainer_memory(cfg: RoleFleetConfig, role: str) -> float | None:
    """Host bytes one pod of a trainer role needs (the largest, when its nodes differ); None when
    its model is not readable here."""
    dims = _model_dims(getattr(cfg, role).model_name_or_path)
    if dims is None:
        return None
    by_node = cfg.devices.by_node(role)
    if not by_node:  # CPU workers: what the planner counts on a GPU is in host memory
        est = _estimate(cfg, role, dims, "cpu")
        return PROCESS_BYTES + workers_per_pod(cfg, role) * (PROCESS_BYTES + est.total + est.host_total)
    return max(_gpu_pod_memory(cfg, role, dims, node, indices) for node, indices in by_node)


def _estimate(cfg: RoleFleetConfig, role: str, dims: ModelDims, gpu: str) -> memory.Estimate:
    return (memory.actor_estimate if role == "actor" else memory.critic_estimate)(cfg, dims, gpu)


def _gpu_pod_memory(cfg: RoleFleetConfig, role: str, dims: ModelDims, node: str | None, indices: list[int]) -> float:
    """Host bytes of the pod of a trainer role on one node: its server, and per GPU a worker that
    loads the model through the host in fp32, what offloading keeps there, and a vLLM engine."""
    total = float(PROCESS_BYTES)
    for index in indices:
        est = _estimate(cfg, role, dims, f"{node}:{index}" if node else str(index))
        total += PROCESS_BYTES + 4 * dims.params + est.host_total
        if "generate" in est.phases:
            total += _engine_bytes(cfg, dims)
    return total


def _engine_bytes(cfg: RoleFleetConfig, dims: ModelDims) -> float:
    """Host memory of the vLLM engine of one generating GPU: its own process and, asleep at level
    1, its share of the bf16 weights it keeps on the host. The hf engine lives in the worker."""
    rollout = cfg.actor.rollout
    if rollout.backend != "vllm":
        return 0.0
    kept = 2 * dims.params / rollout.vllm.tensor_parallel_size if rollout.vllm.sleep_level == 1 else 0.0
    return PROCESS_BYTES + kept


def _reward_helpers(cfg: RoleFleetConfig) -> int:
    """The reward role's worker processes: user functions, and the environment's when it has one."""
    return cfg.reward.user_workers + (cfg.reward.env.workers if cfg.reward.env.enabled else 0)


def _reward_models(cfg: RoleFleetConfig) -> list:
    return [s for s in cfg.reward.scoring_sources() if s.kind == "model"]


def reward_memory(cfg: RoleFleetConfig) -> float | None:
    """Host bytes of a reward pod; None when one of its reward models is not readable here."""
    nbytes = PROCESS_BYTES + _reward_helpers(cfg) * HELPER_PROCESS_BYTES
    models = _reward_models(cfg)
    if not models:
        return nbytes
    if any(_model_dims(s.path) is None for s in models):
        return None
    estimate = memory.reward_estimate(cfg, "0")
    # On GPUs each one loads its copy through the host; on the CPU the models and a batch live there.
    if cfg.devices.reward:
        return nbytes + len(cfg.devices.reward) * (PROCESS_BYTES + sum(p.bytes for p in estimate.held))
    return nbytes + estimate.total


def teacher_memory(cfg: RoleFleetConfig) -> float | None:
    """Host bytes of the teacher's pod: its process, and on the CPU its frozen model in fp32 (on
    GPUs the weights load straight onto them); None when its model is not readable here."""
    dims = _model_dims(cfg.teacher.model_name_or_path)
    if dims is None:
        return None
    return PROCESS_BYTES + (0 if cfg.devices.teacher else dims.params * 4)


def coordinator_memory(cfg: RoleFleetConfig) -> float:
    """Host bytes of the coordinator: its process and the batches of the steps in flight."""
    rows = cfg.train.prompts_per_step * cfg.train.samples_per_prompt
    width = (cfg.data.max_prompt_tokens or memory.ASSUMED_PROMPT_TOKENS) + cfg.sampling.max_new_tokens
    steps = cfg.pipeline.max_staleness + 2  # the one trained, the one generated, and those queued between
    return PROCESS_BYTES + steps * rows * width * COORDINATOR_BYTES_PER_TOKEN


# --- CPUs ---------------------------------------------------------------------------------------

def cpus(cfg: RoleFleetConfig, role: str) -> int:
    """CPU cores a role's pod asks for: one for its server and what its workers keep busy."""
    if role == "coordinator":
        return 1
    if role == "reward":  # a reward model's GPU keeps a core busy too
        return 1 + _reward_helpers(cfg) + (len(cfg.devices.reward) if _reward_models(cfg) else 0)
    if role == "teacher":  # one process: its server and its forwards
        return 2
    per_worker = CPUS_PER_GPU_WORKER if getattr(cfg.devices, role) else 1  # a CPU worker computes on one
    return 1 + per_worker * workers_per_pod(cfg, role)


def requests(cfg: RoleFleetConfig) -> dict[str, dict[str, int | str]]:
    """`resources.requests` of each role of the run: cpu always, memory where its models are
    readable here (elsewhere the chart's default stands)."""
    out: dict[str, dict[str, int | str]] = {}
    for role in cfg.roles():
        if role in TRAINERS:
            nbytes, snapshots = trainer_memory(cfg, role), snapshot_bytes(cfg, role)
            # The snapshot volume is memory the pod is charged for (its files, mapped into the trainer).
            nbytes = None if nbytes is None or snapshots is None else nbytes + snapshots
        else:
            nbytes = {"reward": reward_memory, "teacher": teacher_memory}.get(role, coordinator_memory)(cfg)
        out[role] = {"cpu": cpus(cfg, role)} | ({"memory": gib(nbytes)} if nbytes is not None else {})
    return out


# --- checkpoints --------------------------------------------------------------------------------

def checkpoint_bytes(cfg: RoleFleetConfig) -> float | None:
    """Bytes of one checkpoint of the run (every trainer role's part); None when a trainer's model
    is not readable here, 0 when the run saves none."""
    if not (cfg.checkpoint.periodic or cfg.checkpoint.at_end):
        return 0.0
    total = 0.0
    for role in (r for r in TRAINERS if r in cfg.roles()):
        section = getattr(cfg, role)
        dims = _model_dims(section.model_name_or_path)
        if dims is None:
            return None
        total += trainer_state_bytes(dims, section, role == "critic") + TRAINER_FILES_BYTES
    return total


def snapshot_bytes(cfg: RoleFleetConfig, role: str) -> float | None:
    """Bytes on the snapshot volume of one pod of a trainer role at its fullest: `SNAPSHOTS_HELD` of
    its part of the trainer's state; 0 when the run takes no snapshots, None when its model is not
    readable here. FSDP shards the state over the ranks of every pod, so each pod writes its share; a
    replicated tensor may be written by any one rank, so a pod of a replicating role counts it whole."""
    if not cfg.checkpoint.snapshot.enabled:
        return 0.0
    section = getattr(cfg, role)
    dims = _model_dims(section.model_name_or_path)
    if dims is None:
        return None
    state = trainer_state_bytes(dims, section, role == "critic")
    share = 1 / pods(cfg, role) if section.sharding == "fsdp" else 1.0
    return SNAPSHOTS_HELD * (share * state + TRAINER_FILES_BYTES)


def volume_bytes(checkpoint: float, keep: int) -> float:
    """Bytes the runs volume needs: `keep` checkpoints and the one being written, and the logs."""
    return (keep + 1) * checkpoint + max(LOG_HEADROOM_BYTES, 0.1 * (keep + 1) * checkpoint)
