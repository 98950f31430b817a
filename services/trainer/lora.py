"""LoRA (`actor.lora`, `critic.lora`): low-rank adapters train, the model they sit in stays frozen.

peft injects the adapters into the transformers model in place (`Adapters.model` is that same
model, its targeted linear layers now `base_layer` + `lora_A` / `lora_B`), so the trainer, FSDP2,
activation checkpointing and the compiled layers see the model they always see, with fewer
parameters that want gradients. What changes around it:

- memory: only the adapters have gradients and AdamW state; on CUDA the frozen weights are kept in
  the compute dtype (bf16: 2 bytes a parameter instead of fp32's 4), which autocast computes in
  anyway; sharded (FSDP2 gathers every unit in bf16 already) they stay fp32, so each unit holds one
  dtype;
- the reference: the same model with its adapters switched off (`Adapters.off`), not a second copy;
- the weight sync (`merged_weights`): the engines hold a plain model; each targeted layer's weight
  is sent merged (W + B A x alpha/r), and nothing else, since nothing else changed;
- the critic's adapters sit in its value model's backbone; its value head trains whole beside them
  (it is new: there is nothing to adapt), and nothing is synced;
- checkpoints hold the adapters (and their optimizer state): the trainer saves its trainable
  parameters only; `hf/adapter_config.json` says which base model they belong to, and
  `rolefleet export` merges them into it (and can write peft's adapter directory too).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from peft.tuners.lora import Linear as LoraLinear
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from rolefleet.trainer.sharding import full_tensor

ADAPTER = "default"  # peft's name of the one adapter a trainer has
ADAPTER_CONFIG = "adapter_config.json"  # peft's file name, in a checkpoint's hf/


def lora_config(section, base_model: str | None = None, causal_lm: bool = True) -> LoraConfig:
    """peft's config of `<role>.lora` (a `LoraSection`); `base_model`: where the model came from (a
    local directory is recorded by its absolute path); `causal_lm`: adapters of a causal LM (the
    actor's), else of a bare backbone (the critic's value model)."""
    if base_model is not None and Path(base_model).is_dir():
        base_model = str(Path(base_model).resolve())
    return LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=section.target_modules, bias="none",
                      task_type="CAUSAL_LM" if causal_lm else None, base_model_name_or_path=base_model)


def save_config(directory: Path, section, base_model: str) -> None:
    """`adapter_config.json` (peft's format, naming the base model) into `directory`: beside a
    checkpoint's adapters, what export needs to merge them."""
    lora_config(section, base_model).save_pretrained(str(directory))


class Adapters:
    """A causal LM with LoRA adapters injected, and what the actor does with them."""

    def __init__(self, model: PreTrainedModel, section, frozen_dtype: torch.dtype | None, role: str = "actor"):
        """`frozen_dtype`: the dtype the frozen weights are kept in (None: as loaded); `role`: whose
        adapters (the actor's sit in a causal LM, the critic's in its value model's backbone)."""
        try:
            with warnings.catch_warnings():  # peft asks transformers about checkpointing by a deprecated name
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                self.peft = get_peft_model(model, lora_config(section, causal_lm=role == "actor"))
        except ValueError as exc:  # target modules that match nothing, or a layer type peft cannot wrap
            raise ValueError(f"{role}.lora.target_modules={section.target_modules!r}: {exc}") from None
        self.model = self.peft.get_base_model()  # `model` itself, adapters injected
        if frozen_dtype is not None:
            for param in self.model.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(frozen_dtype)

    def off(self) -> contextlib.AbstractContextManager:
        """The base model: forwards inside run without the adapters (the reference policy)."""
        return self.peft.disable_adapter()


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name in the plain model, merged weight) of every layer with an adapter, in module order:
    what a rollout engine holding the plain model must load after an update. Sharded (FSDP2), the
    pieces are gathered from every rank: all ranks iterate together."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear) and ADAPTER in module.lora_A:
            weight = full_tensor(module.base_layer.weight)
            a, b = full_tensor(module.lora_A[ADAPTER].weight), full_tensor(module.lora_B[ADAPTER].weight)
            delta = (b.float() @ a.float()) * module.scaling[ADAPTER]
            if module.fan_in_fan_out:
                delta = delta.T
            yield f"{name}.weight", weight.float() + delta


def merged_shapes(model_config: PretrainedConfig, section) -> list[tuple[str, tuple[int, ...]]]:
    """What `merged_weights` yields, in order, from the model's config alone (a skeleton on the
    meta device: a rank without the trainer's model knows what a sync will carry)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    inject_adapter_in_model(lora_config(section), skeleton)
    return [(f"{name}.weight", tuple(module.base_layer.weight.shape)) for name, module in skeleton.named_modules()
            if isinstance(module, LoraLinear)]
