"""Loading a trainer's model straight into its shards (a model of any size).

A rank that shards its trainer (FSDP2, `sharding.sharding_wanted`) never holds the whole model: it
builds it on the meta device (no memory, no initialization), the trainer shards the skeleton
(`sharding.shard`), and `materialize` reads each parameter's shard (FSDP2 shards dim 0 in
`torch.chunk` pieces) out of the checkpoint's safetensors files. safetensors reads a slice of a
tensor without reading the rest, so each rank's host memory while loading is its own share of the
model, whatever the model's size, and its GPU never sees the full weights.

What a checkpoint must be for that: a local (or cached hub) directory of safetensors files whose
tensor names are the model's parameter names, give or take its base-model prefix (every usual
causal LM). Anything else (a .bin checkpoint, renamed or fused tensors, weights the checkpoint
lacks) is loaded whole, as before, with a log line saying why.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers import AutoConfig, GenerationConfig

from rolefleet.common import progress
from rolefleet.common.modeling import disable_dropout, model_source

log = logging.getLogger(__name__)

# Model (a skeleton from `build_on_meta`) -> where its weights are: read by `materialize`.
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: name -> (file, shape)."""

    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def open(cls, directory: Path) -> SafetensorsCheckpoint | None:
        """None where the directory holds no safetensors weights."""
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all((directory / name).is_file() for name in names):  # an interrupted download
                return None
        elif (directory / "model.safetensors").is_file():
            names, weight_map = ["model.safetensors"], None
        else:
            return None
        files, shapes = {}, {}
        for name in names:
            with safe_open(directory / name, framework="pt") as f:  # reads the header only
                for key in f.keys():
                    if weight_map is None or weight_map.get(key) == name:
                        files[key] = directory / name
                        shapes[key] = tuple(f.get_slice(key).get_shape())
        return cls(files, shapes)

    def key_for(self, name: str, prefix: str) -> str | None:
        """The checkpoint's name of parameter `name`: itself, or with the base-model prefix added
        (a backbone read out of a causal LM's checkpoint) or taken off."""
        for key in (name, f"{prefix}.{name}" if prefix else name, name.removeprefix(f"{prefix}.")):
            if key in self.files:
                return key
        return None


@dataclass(frozen=True)
class _Pending:
    checkpoint: SafetensorsCheckpoint
    keys: dict[str, str]  # parameter name -> checkpoint key


def build_on_meta(auto_class, path: str, trust_remote_code: bool = False) -> torch.nn.Module | None:
    """`auto_class`'s model of `path` as an fp32 skeleton on the meta device (its buffers, such as
    rotary frequencies, computed for real: they are not in the checkpoint), waiting for
    `materialize`; None when its checkpoint cannot be read by shard (the caller loads it whole)."""
    directory = model_source(path)
    checkpoint = SafetensorsCheckpoint.open(directory) if directory is not None else None
    if checkpoint is None:
        log.warning("%s: no (complete) safetensors weights to read by shard; every rank loads the whole model "
                    "before sharding it", path)
        return None
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.tie_weights()  # the empty-weights init gave the tied head a parameter of its own
    keys, problems = {}, []
    prefix = getattr(model, "base_model_prefix", "")
    for name, param in model.named_parameters():  # tied weights once, under their first name
        key = checkpoint.key_for(name, prefix)
        if key is None:
            problems.append(f"{name} is not in it")
        elif checkpoint.shapes[key] != tuple(param.shape):
            problems.append(f"{key} is {list(checkpoint.shapes[key])}, the model's {list(param.shape)}")
        else:
            keys[name] = key
    if problems:
        log.warning("%s: its safetensors do not match the model's parameters (%s); every rank loads the whole "
                    "model before sharding it", path, "; ".join(problems[:3]))
        return None
    if getattr(model, "can_generate", lambda: False)() and (directory / "generation_config.json").is_file():
        # Its eos ids end responses (`stop_tokens.checkpoint_stop_ids`), as a loaded model's would.
        model.generation_config = GenerationConfig.from_pretrained(directory)
    _PENDING[model] = _Pending(checkpoint, keys)
    return disable_dropout(model.eval())


def is_pending(model: torch.nn.Module) -> bool:
    return model in _PENDING


def materialize(root: torch.nn.Module, device: torch.device) -> None:
    """Give every skeleton under `root` (already sharded) real memory on `device` and read each
    rank's shard of its weights from the checkpoint; the fp32 master copy is cast from the
    checkpoint's dtype one shard at a time."""
    for model in [m for m in root.modules() if m in _PENDING]:
        pending = _PENDING.pop(model)
        # to_empty gives the parameters memory and would leave the buffers garbage: they were real.
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        model.to_empty(device=device)
        params = list(model.named_parameters())
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
            for i, (name, param) in enumerate(params):
                key = pending.keys[name]
                # Opened per tensor (a header parse): the file's pages read so far are unmapped
                # after each, so besides its own shards the process holds one tensor's pages at most.
                with safe_open(pending.checkpoint.files[key], framework="pt") as f:
                    _read_shard(param, f.get_slice(key))
                progress.report("loading weights", i + 1, len(params))


def _read_shard(param: torch.Tensor, source) -> None:
    """`source`: the checkpoint tensor's slice handle (nothing read yet)."""
    if not isinstance(param, DTensor):
        param.copy_(source[:])
        return
    local = param.to_local()
    mesh = param.device_mesh
    if tuple(param.placements) == (Shard(0),):
        # FSDP2's pieces: torch.chunk over the mesh, the last ones shorter (or empty).
        rows = param.shape[0]
        per = -(-rows // mesh.size())
        start = min(rows, per * mesh.get_local_rank())
        stop = min(rows, start + per)
        if stop - start == local.shape[0]:
            if stop > start:
                local.copy_(source[start:stop])
            return
    # Another layout: the whole tensor on every rank, each keeping its part (no communication).
    whole = distribute_tensor(source[:].to(local.device), mesh, param.placements, src_data_rank=None)
    local.copy_(whole.to_local())
