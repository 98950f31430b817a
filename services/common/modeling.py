"""Model loading and the forward passes every training engine shares.

Models load with `from_pretrained` from `model_name_or_path`, exactly as real checkpoints do; the
tiny demo and test models are saved directories that take the same path.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import MIN_TEMPERATURE, MIN_WIRE_TEMPERATURE
from rolefleet.common.errors import InvalidArgument

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    """The role's device: its first visible GPU (CUDA_VISIBLE_DEVICES is set per group) or the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


def check_model_path(path: str) -> str:
    """The same rule as the config check (`preflight.model_problem`): a local model directory, or
    a hub id that can be loaded; anything else fails here with a plain message."""
    from rolefleet.common.preflight import model_problem

    if (problem := model_problem(path)) is not None:
        raise FileNotFoundError(problem)
    return path


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(check_model_path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, device: torch.device) -> PreTrainedModel:
    # fp32 master weights; bf16 autocast on CUDA comes with the GPU training issue.
    model = AutoModelForCausalLM.from_pretrained(check_model_path(path), dtype=torch.float32)
    return disable_dropout(model).to(device)


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


def response_logits(model: torch.nn.Module, batch: SequenceBatch, device: torch.device) -> torch.Tensor:
    """Logits [N, V] predicting each packed response token (N = total response tokens)."""
    input_ids, attention_mask = batch.model_inputs()
    out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    rows, cols = batch.response_positions()
    return out.logits[rows.to(device), cols.to(device)]


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
            h.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
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
