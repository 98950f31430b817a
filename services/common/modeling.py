"""Model loading and the forward passes every training engine shares.

Models load with `from_pretrained` from `model_name_or_path`, exactly as real checkpoints do; the
tiny demo and test models are saved directories that take the same path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
from pathlib import Path

import torch
import torch.utils.checkpoint
from huggingface_hub import snapshot_download
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import MIN_TEMPERATURE, MIN_WIRE_TEMPERATURE
from rolefleet.common.errors import InvalidArgument
from rolefleet.common.model_paths import model_problem
from rolefleet.common.packed_attention import document_block_mask, flex_for, use_packed_attention

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    """The process's device: the GPU it was given (a worker of a group: its rank's, set by the group
    before the core is built; otherwise the first of CUDA_VISIBLE_DEVICES) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_model_path(path: str) -> str:
    """The same rule as the config check (`model_paths.model_problem`): a local model directory, or
    a hub id that can be loaded; anything else fails here with a plain message."""
    if (problem := model_problem(path)) is not None:
        raise FileNotFoundError(problem)
    return path


def model_source(path: str) -> Path | None:
    """The local directory of a model: `path` itself, or a hub id's snapshot with its config and
    safetensors weights: the cached one, else downloaded (unless HF_HUB_OFFLINE); None where
    neither is possible (from_pretrained's own lookup is left)."""
    if Path(path).is_dir():
        return Path(path)
    wanted = ["*.json", "*.safetensors"]
    try:
        return Path(snapshot_download(path, allow_patterns=wanted, local_files_only=True))
    except Exception:  # noqa: BLE001 - not an id, or not (wholly) in the cache
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None
    try:
        return Path(snapshot_download(path, allow_patterns=wanted))
    except Exception:  # noqa: BLE001 - unreachable, or no such repository: from_pretrained will say which
        return None


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(check_model_path(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_pretrained(auto_class, path: str, device: torch.device, dtype: torch.dtype = torch.float32,
                    trust_remote_code: bool = False) -> PreTrainedModel:
    """The whole model on `device` in `dtype` (fp32: master weights; forwards run under bf16
    autocast on CUDA, see `compute_dtype`). On a GPU the checkpoint's tensors go to it one at a
    time, cast there: the host never holds an fp32 copy, only the file's pages as they are read."""
    placement = {"device_map": {"": device}} if device.type == "cuda" else {}
    model = auto_class.from_pretrained(check_model_path(path), dtype=dtype, trust_remote_code=trust_remote_code,
                                       **placement)
    return disable_dropout(model).to(device)


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    return load_pretrained(AutoModelForCausalLM, path, device, dtype, trust_remote_code)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """RL updates run without dropout: with it, the first on-policy ratio would be noise instead of
    exactly 1, and old/new logprobs (computed in eval mode) would not be comparable."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    if config is not None:
        # Attention implementations read their dropout rate from the config, not from a module.
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    return model


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature). logits [N, V], tokens [N] -> [N]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over the trainable parameters, in name order; equal digests mean equal weights."""
    h = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        if param.requires_grad:
            h.update(name.encode())
            full = param.full_tensor() if isinstance(param, DTensor) else param  # sharded: gathered on every rank
            h.update(full.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def require_temperature(temperature: float, field: str = "temperature") -> float:
    """Logits are divided by it: finite and at least MIN_TEMPERATURE (docs/config.md says why)."""
    if not (math.isfinite(temperature) and temperature >= MIN_WIRE_TEMPERATURE):
        raise InvalidArgument(field, f"must be finite and >= {MIN_TEMPERATURE}, got {temperature}")
    return float(temperature)


def release_memory() -> None:
    """Give cached GPU memory back after a role drops its models (ordered shutdown)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.debug("released model memory in pid %d", os.getpid())


# --- training-engine forwards ----------------------------------------------------------------------

def compute_dtype(device: torch.device, setting: str) -> torch.dtype | None:
    """The autocast dtype of forwards and backwards: bf16 on CUDA for `auto` (the fp32 master
    weights and optimizer state stay fp32); None (plain fp32) on the CPU, where bf16 is slow."""
    if setting == "float32" or (setting == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def split_lm(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone returning hidden states, LM head) of a causal LM, so logits can be computed a chunk
    of tokens at a time. Models that post-process logits (soft-capping, scaling) are refused rather
    than given different logprobs than their own forward."""
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap",
                "lm_head_multiplier", "output_multiplier"):
        if getattr(model.config, key, None) not in (None, 1.0):
            raise NotImplementedError(f"{model.config.model_type}: {key} is not supported by the chunked LM head")
    return model.base_model, model.get_output_embeddings()


def response_hidden(backbone: torch.nn.Module, batch: SequenceBatch, device: torch.device,
                    packed: bool = False, attention: str = "sdpa") -> torch.Tensor:
    """Hidden states [N, H] at the positions that predict each packed response token; `packed`:
    the sequences as one row without padding (`SequenceBatch.packed_inputs`), their attention by
    `attention` (`packed_attention.resolve`: sdpa's dense block-diagonal mask, flex, or auto: by size)."""
    if packed:
        input_ids, position_ids = batch.packed_inputs()
        inputs = {"input_ids": input_ids.to(device), "position_ids": position_ids.to(device), "use_cache": False}
        lengths = batch.prompt_lengths + batch.response_lengths
        if flex_for(attention, int(lengths.sum())):
            use_packed_attention(backbone)
            out = backbone(**inputs, attention_mask=document_block_mask(lengths, device))
        else:
            out = backbone(**inputs)
        return out.last_hidden_state[0, batch.packed_response_positions().to(device)]
    input_ids, attention_mask = batch.model_inputs()
    out = backbone(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    rows, cols = batch.response_positions()
    return out.last_hidden_state[rows.to(device), cols.to(device)]


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                  chunk_tokens: int, with_entropy: bool, entropy_grad: bool = True,
                  compile: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (optionally) the entropy of softmax(head(hidden) / temperature), fp32 [N].

    The head runs `chunk_tokens` rows at a time, so no [N, V] fp32 logits tensor ever exists for a
    whole batch (151k-vocabulary models: 0.6 MB per token). With gradients on, each chunk is
    checkpointed: its logits are freed after the forward and recomputed in the backward.
    `entropy_grad=False`: the entropy is for a metric, not a loss, and is computed without a graph.
    `compile` (`compile_layers`): the maths on each chunk's logits runs compiled. Eager, it makes
    several passes over [chunk, V] (an fp32 copy of the logits, a log-softmax per loss and per
    entropy, the entropy's products); as one graph it reads the bf16 logits in one or two
    reductions, and its backward writes the logits' gradient in one pass, for any chunk length.
    """
    if not with_entropy:
        entropy = "none"
    elif entropy_grad or not torch.is_grad_enabled():
        entropy = "grad"
    else:
        entropy = "metric"
    stats = compiled(token_stats) if compile else token_stats
    metric: dict[int, torch.Tensor] = {}  # chunk -> its metric entropy, from the chunk's first forward

    def chunk(h: torch.Tensor, t: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Eager, the backward's recomputation of a chunk skips the metric's [chunk, V] passes (no_grad
        # saved nothing for it); compiled, the metric rides on the pass that reads the logits anyway,
        # and each recomputation is the same graph as the forward it repeats.
        wanted = "none" if entropy == "metric" and i in metric and not compile else entropy
        token, ent = stats(head(h), t, temperature, wanted)
        if entropy == "metric":
            metric.setdefault(i, ent)
        return token, ent if entropy == "grad" else token.new_zeros(())

    tokens, entropies = [], []
    for i, start in enumerate(range(0, hidden.shape[0], chunk_tokens)):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            token, ent = torch.utils.checkpoint.checkpoint(chunk, h, t, i, use_reentrant=False)
        else:
            token, ent = chunk(h, t, i)
        tokens.append(token)
        entropies.append(metric.get(i, ent))
    return torch.cat(tokens), torch.cat(entropies) if with_entropy else None


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From one chunk's logits [n, V]: log p(target) (targets [n], or [n, m]: m tokens a position,
    their logprobs [n, m]) and, unless `entropy` is "none", the entropy of softmax(logits /
    temperature), fp32 [n]; "metric": the entropy without a graph."""
    x = logits.float()
    if temperature != 1.0:  # a full [chunk, V] pass: skipped at the usual training temperature
        x = x / temperature
    if targets.dim() == 1:
        # Fused log-softmax + gather: its backward writes softmax - onehot in one pass, where
        # log_softmax(...).gather(...) would allocate and scatter a dense [chunk, V] gradient.
        token = -torch.nn.functional.cross_entropy(x, targets, reduction="none")
    else:  # several tokens a position (a teacher's top k beside the sampled one): one normaliser
        token = x.gather(1, targets) - torch.logsumexp(x, dim=-1, keepdim=True)
    if entropy == "none":
        return token, None
    with torch.no_grad() if entropy == "metric" else contextlib.nullcontext():
        return token, _entropy(x)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    # Not algos.entropy_from_logits: its guards for -inf logits cost more passes over [chunk, V],
    # and a linear head's logits are finite.
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@functools.cache
def compiled(fn):
    """`torch.compile(fn)`, made on first use: only runs with `compile_layers` pay for importing
    the compiler (about a second of every role process's start). The first dimension of every
    tensor argument (rows: tokens of a chunk, sequences of a decode batch) is compiled
    shape-generic from the first call. Left to dynamo, the first graph would be specialized and the
    first new row count (a ragged last chunk, a smaller decode batch) would recompile it mid-run,
    at seconds of that call on a GPU."""
    graph = torch.compile(fn)

    @functools.wraps(fn)
    def rows_dynamic(*args, **kwargs):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return graph(*args, **kwargs)

    return rows_dynamic


def lm_logprobs(model: PreTrainedModel, batch: SequenceBatch, device: torch.device, temperature: float,
                chunk_tokens: int, with_entropy: bool, packed: bool = False, entropy_grad: bool = True,
                compile: bool = False, attention: str = "sdpa",
                also: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed logprobs [N] (and entropy [N]) of the batch's response tokens under a causal LM: its
    backbone once, then its head a chunk of tokens at a time (`head_logprobs`). `also` (int64
    [N, k]): k more tokens at each response position, whose logprobs come after the sampled one's
    ([N, 1 + k])."""
    backbone, head = split_lm(model)
    hidden = response_hidden(backbone, batch, device, packed, attention)
    targets = batch.response_ids.to(device)
    if also is not None:
        targets = torch.cat([targets[:, None], also.to(device)], dim=1)
    return head_logprobs(hidden, head, targets, temperature, chunk_tokens, with_entropy, entropy_grad, compile)


@torch.no_grad()
def lm_top_k(model: PreTrainedModel, batch: SequenceBatch, device: torch.device, temperature: float,
             chunk_tokens: int, k: int, packed: bool = False,
             attention: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `lm_logprobs` without gradients, and with each response position's k most likely tokens:
    (log p of the sampled tokens [N], the k's logprobs [N, k] in falling order, their ids [N, k]
    int64), all of softmax(head(hidden) / temperature), the head a chunk of tokens at a time."""
    backbone, head = split_lm(model)
    hidden = response_hidden(backbone, batch, device, packed, attention)
    targets = batch.response_ids.to(device)
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        x = head(hidden[start:start + chunk_tokens]).float()
        logp = torch.log_softmax(x / temperature if temperature != 1.0 else x, dim=-1)
        top = logp.topk(k, dim=-1)
        sampled = logp.gather(1, targets[start:start + chunk_tokens, None].to(logp.device))[:, 0]
        parts.append((sampled, top.values, top.indices))
    return tuple(torch.cat(p) for p in zip(*parts)) if parts else \
        (hidden.new_zeros(0), hidden.new_zeros(0, k), targets.new_zeros(0, k))


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in the backward (transformers renamed the switch in v5.2x)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the class transformers names as never split (`_no_split_modules`)."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    # By the class's ancestry: FSDP2 swaps a sharded module's class for a subclass (FSDP<name>).
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise NotImplementedError(f"{type(model).__name__} names no decoder layer class")
    return layers


def compile_decoder_layers(model: torch.nn.Module, hooks_outside: bool = False) -> int:
    """torch.compile every decoder layer in place (regional compilation: the layers share one
    compiled graph, so the compile costs one layer's time, not the model's). `hooks_outside`: only
    the layer's own forward is compiled, so the hooks around it (FSDP's gathers) stay eager.
    Returns how many were compiled."""
    layers = decoder_layers(model)
    # Variants per layer: grad on/off, train/eval, policy/reference/critic weights. Past the limit
    # dynamo would quietly run the layer eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Micro-batch widths change every step: one shape-generic graph.
    kwargs = {"dynamic": True, "options": layer_compile_options()}
    for layer in layers:
        if hooks_outside:
            layer.forward = torch.compile(layer.forward, **kwargs)
        else:
            layer.compile(**kwargs)
    return len(layers)


def layer_compile_options() -> dict[str, bool]:
    """Inductor options for the decoder layers. Inductor fuses the norm's two backward reductions
    (over tokens, over channels) only past a size (tokens x hidden >= 5 Mi elements), a decision it
    guards on: the first micro-batch over that size, often steps into a run, recompiled every layer
    graph (about 20 s for Qwen2-0.5B on an H200, 2026-11-30). Without the size checks the fusion's
    choice does not depend on the token count, so one graph serves every width."""
    from torch._inductor import config as inductor  # only where layers compile: 0.7 s to import

    return {"triton.mix_order_reduction_non_strict_mode": True} \
        if hasattr(inductor.triton, "mix_order_reduction_non_strict_mode") else {}
