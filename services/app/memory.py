"""How much GPU memory each role of a run will need, from the model's config.json alone (no weights
are loaded): what `rolefleet plan` prints and what preflight checks before `up` and `serve` start.

Per GPU, a role's estimate is what it holds all the time plus the largest of its phases:

- held: the trainer's fp32 master weights (none with `<role>.offload=params`), its AdamW state (8
  bytes a trainable parameter; in host memory with `<role>.offload`), the reference (unless `actor.ref_offload`), the hf engine's bf16
  copy of the policy and the decode state it keeps (`actor.rollout.keep_decode_state_mb`); all of a
  trainer's parts divided over its workers when sharded (`<role>.sharding: fsdp`);
- generate: the KV cache of one engine call (`actor.rollout.batch_size` rows of prompt + response);
  vLLM instead takes `actor.rollout.vllm.gpu_memory_utilization` of the GPU while it generates;
- update: the gradients (4 bytes a trainable parameter), the activations one micro-batch of
  `max_tokens_per_micro_batch` tokens keeps for its backward (every layer's, or with
  `gradient_checkpointing` each layer's input and one layer's), and the LM head's logits of one
  chunk (`actor.logprob_chunk_tokens`) with their gradient.

A reward model (`reward.sources` of kind `model`) on each GPU of `devices.reward`: its weights in
`reward.model_dtype` and, when it scores, one batch of `reward.model_max_tokens_per_batch` tokens
through a layer (an inference forward keeps no layer's activations past the layer).

Roles that share a GPU (`devices.colocate`) add up. The activation bytes per token and layer are
counted from the tensors a decoder layer saves under bf16 autocast (see `activation_bytes`); the
allocator's own slack is `ALLOCATOR_SLACK`. docs/memory.md has the formulas and how the estimate
compares with measured peaks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from rolefleet.actor.decode_budget import UNMEASURED_BYTES, bucket_rows
from rolefleet.common.config import ConfigError, RoleFleetConfig, split_device
from rolefleet.common.model_paths import cached_config, is_repo_id

GIB = 2**30
ALLOCATOR_SLACK = 1.10  # the caching allocator's fragmentation over the live tensors' bytes
CUDA_CONTEXT = 0.6 * GIB  # per process on a GPU: the CUDA context, cuBLAS/cuDNN workspaces
NEAR = 0.9  # an estimate above this share of the GPU is a warning; above the whole GPU, an error
# With `compile_layers` Inductor fuses the norms, RoPE and the MLP's activation and recomputes the
# cheap ones in the backward: a layer keeps this share of what the eager count says. Measured on
# one H200 at Qwen2-1.5B dimensions (gpu_1x, 32768-token micro-batches; docs/memory.md).
COMPILED_ACTIVATION_SHARE = 0.65
ASSUMED_PROMPT_TOKENS = 512  # the KV cache's prompt part when data.max_prompt_tokens does not bound it
OFFLOAD_CHUNK = 2**30  # the AdamW state `offload: optimizer` brings to the GPU at once (trainer/optim.py)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STATE_BYTES_PER_PARAM = 4 + 8  # a trainer's state: fp32 weights and AdamW's two fp32 moments
# Snapshots of a trainer held: each rank copies its state into one of two memory-mapped files, the
# other holding its newest complete snapshot (`trainer/snapshot_file.py`); nothing else is staged.
SNAPSHOTS_HELD = 2


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool = False  # q, k, v biases
    output_bias: bool = False  # an o_proj bias too (Llama's attention_bias; Qwen2 has none)
    stored_bytes: int = 2  # bytes a parameter in the checkpoint's files (its config's dtype; bf16 unless said)

    @classmethod
    def of_config(cls, config: dict, where: str = "config.json") -> ModelDims:
        """The dimensions of a transformers decoder config (Llama, Qwen2, Mistral and alike)."""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if not isinstance(config.get(k), int)]
        if missing:
            raise ConfigError(f"{where}: cannot estimate memory without {', '.join(missing)}")
        heads = config["num_attention_heads"]
        return cls(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                   tied=bool(config.get("tie_word_embeddings", False)),
                   attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                   output_bias=bool(config.get("attention_bias")) and config.get("model_type") != "qwen2",
                   stored_bytes=DTYPE_BYTES.get(config.get("dtype") or config.get("torch_dtype") or "bfloat16", 2))

    @classmethod
    def read(cls, path: str) -> ModelDims:
        """From a model directory's config.json, or a hub id's cached one."""
        local = Path(path).expanduser()
        file = local / "config.json" if local.is_dir() else (cached_config(path) if is_repo_id(path) else None)
        if file is None or not file.is_file():
            raise ConfigError(f"{path}: no config.json to estimate its memory from")
        return cls.of_config(json.loads(file.read_text(encoding="utf-8")), str(file))

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        """Parameters of the model: embeddings, the head unless tied, and per layer attention
        (q, k, v, o; q/k/v biases where the config has them), the gated MLP and two norms."""
        h, kv = self.hidden, self.kv_dim
        q = self.heads * self.head_dim
        attention = (h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
                     + (h if self.output_bias else 0))
        layer = attention + 3 * h * self.intermediate + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    def activation_bytes(self) -> int:
        """Bytes one token keeps for the backward in one decoder layer under bf16 autocast over fp32
        weights: the fp32 residual stream's two RMSNorms (input and normalised, 8 bytes a channel
        each), the bf16 casts of their outputs into q/k/v and gate/up (5 casts), q/k/v after RoPE and
        the attention output with its inputs (SDPA keeps q, k, v and its output), and the MLP's gate,
        up, activation and product (2 bytes each)."""
        h, kv, i, q = self.hidden, self.kv_dim, self.intermediate, self.heads * self.head_dim
        norms = 2 * 8 * h
        casts = 5 * 2 * h
        attention = 2 * (2 * q + 2 * 2 * kv) + 2 * q  # q, k, v before and after RoPE; the output
        mlp = 4 * 2 * i
        return norms + casts + attention + mlp

    @property
    def scorer_params(self) -> int:
        """Parameters of the sequence-classification model of these dimensions (a reward model): the
        LM head's place taken by a one-output score head."""
        return self.params - (0 if self.tied else self.vocab * self.hidden) + self.hidden

    def inference_bytes(self, dtype_bytes: int) -> int:
        """Bytes a token has live at the peak of one decoder layer's forward without gradients: the
        residual stream, its normalised copy and the layer's output (3 x hidden), q/k/v and the
        attention output, and the MLP's gate, up, activation and product."""
        h, kv, i, q = self.hidden, self.kv_dim, self.intermediate, self.heads * self.head_dim
        return dtype_bytes * (3 * h + 2 * q + 2 * kv + 4 * i)

    def linear_layers(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer, by its transformers name."""
        h, kv, i, q = self.hidden, self.kv_dim, self.intermediate, self.heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def adapter_params(self, rank: int, targets) -> int:
        """Parameters of LoRA adapters of `rank` on `targets` (all-linear, or module names; names
        of no decoder linear layer count nothing): r x (in + out) per adapted layer."""
        layers = self.linear_layers()
        names = layers if targets == "all-linear" else [n for n in targets if n in layers]
        return self.layers * sum(rank * sum(layers[n]) for n in names)

    def adapter_activation_bytes(self, targets) -> int:
        """What adapters add to `activation_bytes`: each adapter on a layer whose input autocast
        casts (q, k, v, gate, up: from the fp32 norm) keeps a bf16 cast of its own."""
        cast_inputs = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        names = cast_inputs if targets == "all-linear" else [n for n in targets if n in cast_inputs]
        return 2 * self.hidden * len(names)

    def layer_input_bytes(self) -> int:
        """What activation checkpointing keeps per token and layer: the layer's fp32 input."""
        return 4 * self.hidden


@dataclass
class Part:
    what: str
    bytes: float


@dataclass
class Estimate:
    """One role's need on one of its GPUs."""
    role: str
    gpu: str
    held: list[Part] = field(default_factory=list)
    phases: dict[str, list[Part]] = field(default_factory=dict)
    host: list[Part] = field(default_factory=list)  # what offloading puts in the node's memory instead
    load: list[Part] = field(default_factory=list)  # the process's host memory while it loads (then freed)

    @property
    def load_total(self) -> float:
        return sum(p.bytes for p in self.load)

    @property
    def host_total(self) -> float:
        return sum(p.bytes for p in self.host)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(x.bytes for x in self.phases[p])) if self.phases else ""

    @property
    def total(self) -> float:
        held = sum(p.bytes for p in self.held)
        peak = max((sum(p.bytes for p in parts) for parts in self.phases.values()), default=0.0)
        return (held + peak) * ALLOCATOR_SLACK + CUDA_CONTEXT


def _trainer_parts(dims: ModelDims, section, workers: int, sharded: bool, prefix: str) -> tuple[list, list, list]:
    """(held, update phase, host memory) of a trainer on one of its GPUs."""
    if _adapters(section):
        return _adapter_parts(dims, section, workers, sharded, prefix)
    share = workers if sharded else 1
    p, offload = dims.params, section.offload
    held = [] if offload == "params" else [Part(f"{prefix} weights (fp32)", 4 * p / share)]
    if offload == "none":
        held.append(Part(f"{prefix} AdamW state (fp32)", 8 * p / share))
    update = [_activations(dims, section, prefix)]
    if offload == "params":  # a layer's gathered bf16 weights and their gradient, two layers at a time
        update.append(Part(f"{prefix} weights and gradients of the layers in flight", 2 * 2 * 2 * _layer_params(dims)))
    else:
        update.append(Part(f"{prefix} gradients (fp32)", 4 * p / share))
    if offload == "optimizer":  # the step brings the state back a chunk at a time (the activations are gone)
        update = max(update, [Part(f"{prefix} gradients and one chunk's AdamW state during the step",
                                   4 * p / share + OFFLOAD_CHUNK)], key=lambda parts: sum(x.bytes for x in parts))
    host = {"none": [], "optimizer": [Part(f"{prefix} AdamW state (pinned)", 8 * p / share)],
            "params": [Part(f"{prefix} weights, gradients and AdamW state", 16 * p / share)]}[offload]
    return held, update, host


def _adapter_parts(dims: ModelDims, section, workers: int, sharded: bool, prefix: str) -> tuple[list, list, list]:
    """`_trainer_parts` with LoRA adapters: the frozen weights in bf16 on one GPU (fp32 shards when
    sharded: FSDP gathers them in bf16), and weights, gradients and AdamW state (16 bytes a
    parameter) for the adapters alone."""
    lora, offload = section.lora, section.offload
    sharded = sharded or offload == "params"
    share = workers if sharded else 1
    adapters = dims.adapter_params(lora.rank, lora.target_modules) / share
    frozen = Part(f"{prefix} frozen weights ({'fp32 shards' if sharded else 'bf16'})",
                  (4 if sharded else 2) * dims.params / share)
    held, host = ([], [frozen]) if offload == "params" else ([frozen], [])
    trained = Part(f"{prefix} LoRA adapters (r={lora.rank}): weights and AdamW state", 12 * adapters)
    (host if offload != "none" else held).append(trained)
    update = [_activations(dims, section, prefix), Part(f"{prefix} adapters' gradients (fp32)", 4 * adapters)]
    if offload == "params":  # a layer's gathered bf16 weights, two layers at a time
        update.append(Part(f"{prefix} weights of the layers in flight", 2 * 2 * _layer_params(dims)))
    return held, update, host


def _adapters(section) -> bool:
    """Whether this trainer section (`actor`, `critic`) trains LoRA adapters."""
    lora = getattr(section, "lora", None)
    return lora is not None and lora.enabled


def _layer_params(dims: ModelDims) -> float:
    return (dims.params - dims.vocab * dims.hidden * (1 if dims.tied else 2)) / dims.layers


def _activations(dims: ModelDims, section, prefix: str) -> Part:
    """What one micro-batch keeps for its backward (activation checkpointing: each layer's input
    and one layer's activations)."""
    tokens = section.max_tokens_per_micro_batch
    per_token = dims.activation_bytes() + (dims.adapter_activation_bytes(section.lora.target_modules)
                                           if _adapters(section) else 0)
    layer = per_token * (COMPILED_ACTIVATION_SHARE if section.compile_layers else 1.0)
    if section.gradient_checkpointing:
        activations = tokens * (dims.layers * dims.layer_input_bytes() + layer)
    else:
        activations = tokens * dims.layers * layer
    return Part(f"{prefix} activations of one micro-batch ({tokens} tokens)", activations)


def _head_chunk(dims: ModelDims, chunk: int) -> Part:
    # fp32 logits of one chunk, their log-softmax and its gradient.
    return Part(f"LM head logits of {chunk} tokens with their gradient", 3 * 4 * chunk * dims.vocab)


def actor_work(cfg: RoleFleetConfig, gpu: str) -> tuple[bool, bool, int]:
    """(trains, generates, training workers) of the actor on `gpu`. Split (`devices.rollout` a
    proper part of `devices.actor`): a rollout GPU holds only its engine, and the trainer and the
    reference are sharded over the other GPUs alone (`actor/placement.py`)."""
    actor = [str(d) for d in cfg.devices.actor]
    rollout = [str(d) for d in cfg.devices.rollout]
    if not 0 < len(rollout) < len(actor):
        return True, True, max(1, len(actor))
    generates = gpu in rollout
    return not generates, generates, len(actor) - len(rollout)


def actor_estimate(cfg: RoleFleetConfig, dims: ModelDims, gpu: str) -> Estimate:
    trains, generates, workers = actor_work(cfg, gpu)
    est = Estimate("actor", gpu)
    trainer_phases = _add_policy_trainer(cfg, dims, est, workers) if trains else {}
    if generates:
        _add_rollout_engine(cfg, dims, est)
    est.phases |= trainer_phases
    return est


def _add_rollout_engine(cfg: RoleFleetConfig, dims: ModelDims, est: Estimate) -> None:
    """The rollout engine on one of the actor's generating GPUs."""
    a, s = cfg.actor, cfg.sampling
    rows = bucket_rows(min(a.rollout.batch_size, cfg.train.prompts_per_step * cfg.train.samples_per_prompt))
    width = (cfg.data.max_prompt_tokens or ASSUMED_PROMPT_TOKENS) + s.max_new_tokens
    if a.rollout.backend == "vllm":
        est.phases["generate"] = [Part("vLLM (gpu_memory_utilization of the GPU)", 0.0)]  # filled by the caller
        return
    est.held.append(Part("rollout engine weights (bf16)", 2 * dims.params))
    kv = 2 * 2 * dims.layers * dims.kv_dim * rows * width
    keep = a.rollout.keep_decode_state_mb
    kept = min(kv, UNMEASURED_BYTES if keep == "auto" else keep * 2**20)  # auto: what its first update keeps
    est.held.append(Part("kept decode state", kept))
    est.phases["generate"] = [Part(f"KV cache of {rows} rows x {width} tokens (bf16)", kv - kept),
                              Part("logits of one decode step", 4 * rows * dims.vocab)]


def _add_policy_trainer(cfg: RoleFleetConfig, dims: ModelDims, est: Estimate, workers: int) -> dict[str, list[Part]]:
    """The policy's trainer and its reference on one of the actor's `workers` training GPUs: adds
    what is held to `est`, returns the trainer's phases."""
    a = cfg.actor
    sharded = a.sharding == "fsdp" and workers > 1
    share = workers if sharded else 1
    # Sharded (over workers, or over one for offload=params), an offloaded reference is FSDP's CPU
    # offload too: its layers visit the GPU one at a time; unsharded, it visits whole.
    ref_layers_only = sharded or a.offload == "params"
    held, update, est.host = _trainer_parts(dims, a, workers, sharded, "policy")
    est.held += held
    own_reference = a.holds_reference
    if own_reference:
        (est.host if a.ref_offload else est.held).append(Part("reference weights (fp32)", 4 * dims.params / share))
    phases = {"update": [*update, _head_chunk(dims, a.logprob_chunk_tokens)]}
    est.load = _load_parts(dims, share, sharded and not _adapters(a), "policy")
    if sharded and _adapters(a):  # adapters go into whole weights: each GPU holds the model until it shards
        phases["load"] = [Part("the whole policy before it is sharded (fp32; LoRA loads whole)",
                               4 * dims.params * (1 - 1 / share))]
    if own_reference and a.ref_offload and not ref_layers_only:
        phases["logprobs"] = [Part("reference visiting the GPU (fp32)", 4 * dims.params / share),
                              _head_chunk(dims, a.logprob_chunk_tokens)]
    return phases


def critic_estimate(cfg: RoleFleetConfig, dims: ModelDims, gpu: str) -> Estimate:
    workers = max(1, len(cfg.devices.critic))
    sharded = cfg.critic.sharding == "fsdp" and workers > 1
    held, update, host = _trainer_parts(dims, cfg.critic, workers, sharded, "value model")
    share, adapters = workers if sharded else 1, _adapters(cfg.critic)
    phases = {"update": update}
    if sharded and adapters:  # as the policy's: whole weights until they are sharded
        phases["load"] = [Part("the whole value model before it is sharded (fp32; LoRA loads whole)",
                               4 * dims.params * (1 - 1 / share))]
    return Estimate("critic", gpu, held=held, phases=phases, host=host,
                    load=_load_parts(dims, share, sharded and not adapters, "value model"))


def _load_parts(dims: ModelDims, share: int, by_shard: bool, prefix: str) -> list[Part]:
    """Host memory a trainer's process holds while it loads (`trainer/loading.py`): sharded, its
    share of the checkpoint's rows, read by slice; whole, the checkpoint's pages as they stream to
    the GPU (the fp32 copy is cast there). A reference of its own is read after the policy, not
    beside it."""
    read = dims.stored_bytes * dims.params / (share if by_shard else 1)
    return [Part(f"{prefix} checkpoint, " + ("this rank's rows" if by_shard else "read whole"), read)]


def reward_estimate(cfg: RoleFleetConfig, gpu: str) -> Estimate:
    """The reward models of `reward.sources` on one of the reward's GPUs (each of its own
    dimensions): every model's weights are held, and one scores at a time (the scorer's lock), so
    the largest batch is the phase."""
    r = cfg.reward
    nbytes = DTYPE_BYTES[r.model_dtype]
    held, score = [], []
    for source in r.scoring_sources():
        if source.kind != "model":
            continue
        dims = ModelDims.read(source.path)
        held.append(Part(f"reward model {source.name!r} weights ({r.model_dtype})", nbytes * dims.scorer_params))
        score.append(Part(f"reward model {source.name!r}: one batch of {r.model_max_tokens_per_batch} tokens "
                          "through a layer", r.model_max_tokens_per_batch * dims.inference_bytes(nbytes)))
    phases = {"score": [max(score, key=lambda p: p.bytes)]} if score else {}
    return Estimate("reward", gpu, held=held, phases=phases)


@dataclass
class GpuPlan:
    gpu: str
    capacity: Optional[float]
    estimates: list[Estimate]

    @property
    def total(self) -> float:
        return sum(e.total for e in self.estimates)

    @property
    def verdict(self) -> str:
        if self.capacity is None:
            return "unknown"
        if self.total > self.capacity:
            return "over"
        return "near" if self.total > NEAR * self.capacity else "fits"


def plan(cfg: RoleFleetConfig, capacity: Optional[float] = None) -> list[GpuPlan]:
    """Every GPU of the run's device map with what its roles will need (`capacity`: the bytes of one
    GPU; None: not known here)."""
    by_gpu: dict[str, list[Estimate]] = {}
    models = {"actor": cfg.actor.model_name_or_path, "critic": cfg.critic.model_name_or_path}
    builders = {"actor": actor_estimate, "critic": critic_estimate,
                "reward": lambda cfg, _dims, gpu: reward_estimate(cfg, gpu)}  # a model of each source
    reward_models = any(s.kind == "model" for s in cfg.reward.scoring_sources())
    roles = ["actor", *(["critic"] if cfg.preset.uses_critic else []), *(["reward"] if reward_models else [])]
    for role in roles:
        devices = getattr(cfg.devices, role)
        if not devices:
            continue  # on the CPU: nothing to plan
        dims = ModelDims.read(models[role]) if role in models else None
        for device in devices:
            node, index = split_device(device)
            gpu = f"{node}:{index}" if node else str(index)
            est = builders[role](cfg, dims, gpu)
            if "generate" in est.phases and cfg.actor.rollout.backend == "vllm" and capacity is not None:
                est.phases["generate"][0].bytes = cfg.actor.rollout.vllm.gpu_memory_utilization * capacity
            by_gpu.setdefault(gpu, []).append(est)
    return [GpuPlan(gpu, capacity, estimates) for gpu, estimates in by_gpu.items()]


def trainable_params(dims: ModelDims, section, value_model: bool) -> int:
    """Parameters a trainer trains and so checkpoints: the model's (a value model's backbone and
    scalar head), or with LoRA its adapters (and a value model's head)."""
    if section.lora.enabled:
        adapters = dims.adapter_params(section.lora.rank, section.lora.target_modules)
        return adapters + (dims.hidden + 1 if value_model else 0)  # the value head trains whole
    return dims.scorer_params + 1 if value_model else dims.params  # scorer_params: the head's weight, not its bias


def trainer_state_bytes(dims: ModelDims, section, value_model: bool) -> float:
    """Bytes of a trainer's weights/ in a checkpoint: fp32 weights and AdamW moments of what it
    trains. A tied LM head is saved under its own name too, with the embeddings' weights again."""
    nbytes = STATE_BYTES_PER_PARAM * trainable_params(dims, section, value_model)
    if dims.tied and not value_model and not section.lora.enabled:
        nbytes += 4 * dims.vocab * dims.hidden
    return nbytes


def snapshot_bytes(cfg: RoleFleetConfig) -> Optional[float]:
    """Memory the run's snapshots (`checkpoint.snapshot`) take where every role runs on one machine
    (`rolefleet up`): each trainer's state, twice in the snapshot directory (its two buffer files);
    None when a trainer's model config is not readable here."""
    total = 0.0
    for role in ("actor", "critic"):
        if role in cfg.roles():
            section = getattr(cfg, role)
            try:
                dims = ModelDims.read(section.model_name_or_path)
            except ConfigError:
                return None
            total += trainer_state_bytes(dims, section, role == "critic")
    return SNAPSHOTS_HELD * total


def gpu_capacity() -> Optional[float]:
    """Bytes of the smallest GPU this process sees (None without CUDA)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return float(min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))


def host_capacity() -> Optional[float]:
    """Bytes of this machine's memory."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # a platform without these names
        return None


def node_host_bytes(plans: list[GpuPlan], roles: list[str] | None = None, loading: bool = False) -> dict[str, float]:
    """Host memory that offloading puts on each node (its name; "" for this machine's GPUs), of
    `roles` (None: every role); `loading`: with what every process holds while it loads (they
    start together)."""
    nodes: dict[str, float] = {}
    for g in plans:
        node = g.gpu.rpartition(":")[0]
        for est in g.estimates:
            if roles is None or est.role in roles:
                nodes[node] = nodes.get(node, 0.0) + est.host_total + (est.load_total if loading else 0.0)
    return nodes


def memory_problems(cfg: RoleFleetConfig, roles: list[str], capacity: Optional[float],
                    host: Optional[float] = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of `roles` on GPUs of `capacity` bytes and, with `host`, on this
    machine's `host` bytes of memory: an estimate over a GPU (or over the host memory) is a problem
    naming the role, the estimate and the settings that lower it; near one, a warning."""
    if capacity is None and host is None:
        return [], []
    try:
        plans = plan(cfg, capacity)
    except ConfigError:
        return [], []  # a model without a readable config.json: check_models says what is wrong with it
    problems, warnings = [], []
    for g in plans:
        mine = [e for e in g.estimates if e.role in roles]
        if not mine or g.verdict in ("fits", "unknown"):
            continue
        for est in mine:
            line = (f"{est.role} on GPU {g.gpu}: an estimated {est.total / GIB:.1f} GiB (GPU total "
                    f"{g.total / GIB:.1f} of {capacity / GIB:.1f} GiB; `rolefleet plan` itemizes it)")
            if g.verdict == "over":
                problems.append(f"{line} will not fit; would help: {'; '.join(settings_that_help(cfg, est))}")
            else:
                warnings.append(f"{line} is near the GPU's memory")
    need = node_host_bytes(plans, roles).get("", 0.0)
    loading = node_host_bytes(plans, roles, loading=True).get("", 0.0)
    if host is not None and need <= NEAR * host < loading:
        # Pages of the checkpoint files, read while the roles start: the kernel can reclaim them.
        warnings.append(f"an estimated {loading / GIB:.1f} GiB of host memory while the roles load (offloaded "
                        f"state and the checkpoints being read; of {host / GIB:.1f} GiB here): start-up may swap")
    if host is not None and need > NEAR * host:
        using = sorted({e.role for g in plans for e in g.estimates if e.role in roles and e.host})
        line = (f"{', '.join(using)}: an estimated {need / GIB:.1f} GiB of host memory for offloaded state "
                f"(of {host / GIB:.1f} GiB here; pinned memory cannot be swapped out)")
        if need > host:
            problems.append(f"{line} will not fit; would help: actor.lora.rank=16, fewer offloaded parts, or more "
                            "GPUs to shard over")
        else:
            warnings.append(f"{line} is near the machine's memory")
    return problems, warnings


def settings_that_help(cfg: RoleFleetConfig, est: Estimate) -> list[str]:
    """Config changes that lower this role's estimate, biggest saving first."""
    role = est.role
    if role == "reward":
        r = cfg.reward
        out = [f"reward.model_max_tokens_per_batch={max(1, r.model_max_tokens_per_batch // 4)} "
               "(one forward's activations scale with it)"] if r.model_max_tokens_per_batch > 2048 else []
        if r.model_dtype == "float32":
            out.append("reward.model_dtype=bfloat16 (half the weights' bytes)")
        return [*out, "a GPU of its own in devices.reward (not shared with a trainer through devices.colocate)"]
    if role == "actor" and "update" not in est.phases:  # a rollout GPU of a split actor: its engine alone
        rollout = cfg.actor.rollout
        if rollout.backend == "vllm":
            return [f"actor.rollout.vllm.gpu_memory_utilization={rollout.vllm.gpu_memory_utilization / 2:g} "
                    "(what vLLM takes of the GPU)"]
        return [f"actor.rollout.batch_size={max(1, rollout.batch_size // 2)} (the KV cache scales with it)"]
    section = getattr(cfg, role)
    out = []
    if not section.gradient_checkpointing:
        out.append(f"{role}.gradient_checkpointing=true (keeps each layer's input, not its activations)")
    if section.max_tokens_per_micro_batch > 4096:
        out.append(f"{role}.max_tokens_per_micro_batch={section.max_tokens_per_micro_batch // 4} "
                   "(activations scale with it)")
    adapters = section.lora.enabled  # their AdamW state is too small to matter
    if section.offload == "none" and not adapters:
        out.append(f"{role}.offload=optimizer (AdamW state in host memory between steps)")
    if not adapters:
        out.append(f"{role}.lora.rank=16 (LoRA: only adapters train; the frozen weights in bf16"
                   f"{', no reference copy' if role == 'actor' else ''})")
    if section.offload != "params":
        out.append(f"{role}.offload=params (weights, gradients and AdamW state in host memory; CPU optimizer step)")
    if role == "actor" and not cfg.actor.ref_offload and cfg.actor.holds_reference:
        out.append("actor.ref_offload=true (the reference in host memory between uses)")
    if len(getattr(cfg.devices, role)) == 1:
        out.append(f"more GPUs in devices.{role} (sharded over them with {role}.sharding=fsdp)")
    return out


def describe(cfg: RoleFleetConfig, plans: list[GpuPlan], host: Optional[float] = None) -> str:
    """The plan as `rolefleet plan` prints it (`host`: this machine's memory, for its GPUs' share)."""
    lines = []
    for g in plans:
        cap = f" of {g.capacity / GIB:.1f} GiB" if g.capacity else ""
        lines.append(f"GPU {g.gpu}: {g.total / GIB:.1f} GiB{cap} ({g.verdict})")
        for est in g.estimates:
            lines.append(f"  {est.role}: {est.total / GIB:.1f} GiB, peak in {est.peak_phase or 'none'}")
            for part in est.held:
                lines.append(f"    held      {part.bytes / GIB:8.2f} GiB  {part.what}")
            for phase, parts in est.phases.items():
                for part in parts:
                    lines.append(f"    {phase:9} {part.bytes / GIB:8.2f} GiB  {part.what}")
            for part in est.host:
                lines.append(f"    host      {part.bytes / GIB:8.2f} GiB  {part.what} (node memory, not the GPU)")
            for part in est.load:
                lines.append(f"    loading   {part.bytes / GIB:8.2f} GiB  {part.what} (node memory while it loads)")
            if g.verdict in ("over", "near"):
                lines += [f"    would help: {s}" for s in settings_that_help(cfg, est)]
    loading = node_host_bytes(plans, loading=True)
    for node, need in node_host_bytes(plans).items():
        if not (need or loading[node]):
            continue
        of = f" of {host / GIB:.1f} GiB here" if host and not node else ""
        lines.append(f"host memory{f' of {node}' if node else ''}: {need / GIB:.1f} GiB{of} for offloaded state, "
                     f"{loading[node] / GIB:.1f} GiB in all while the roles load")
    snapshots = snapshot_bytes(cfg) if cfg.checkpoint.snapshot.enabled else None
    if snapshots:
        lines.append(f"snapshots: {snapshots / GIB:.1f} GiB of memory, two of each trainer's state "
                     f"(checkpoint.snapshot.dir {cfg.checkpoint.snapshot.root(cfg.run)})")
    if not lines:
        lines.append("nothing to plan: no role with GPU work has GPUs (devices.*)")
    # A role's GPUs without work are left out of the plan above; say so rather than let them vanish.
    from rolefleet.app.preflight import idle_gpu_warnings  # import cycle: app/preflight.py imports this module

    return "\n".join([*lines, *(f"warning: {w}" for w in idle_gpu_warnings(cfg, cfg.roles()))])
