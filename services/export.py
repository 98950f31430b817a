"""`rolefleet export`: the actor's part of a checkpoint as a Hugging Face model directory.

The trainer saves its weights through torch.distributed.checkpoint (one file per training rank,
FSDP shards staying shards, see trainer/checkpoint.py) beside `hf/`, the model's config and
tokenizer. Export rebuilds the model from `hf/` without its weights, has DCP read every shard into
it in this one process (DCP reshards; no process group is needed), and writes config, safetensors
and tokenizer with `save_pretrained`, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it like
any other model directory.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch

from rolefleet.trainer.checkpoint import MANIFEST, begin, commit, latest_checkpoint

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
_KEY_PREFIX = "model."  # save_trainer stores {"model": ..., "optim": ...}; export reads only the model


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an OUT that must not be written; the message says why."""


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "auto") -> Path:
    """Write the actor's weights of `checkpoint` (a run checkpoint `.../step-XXXXXXXX/` or an actor
    directory) as a Hugging Face model directory `out` in `dtype` (auto: the config's dtype, else
    float32). `out` appears whole or not at all; an existing non-empty `out` is refused. Returns `out`."""
    actor = actor_dir(Path(checkpoint))
    out = Path(out)
    check_out(out)
    config, tokenizer = _read_hf(actor / "hf")  # before the weights: a bad hf/ costs no model load
    target = export_dtype(config, dtype)
    model = _empty_model(config, target)
    _load_weights(model, actor / "weights")
    work = begin(out)
    try:
        # Safetensors either way: the argument is for transformers 4 (5 writes nothing else).
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        commit(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("exported %s (%s) to %s", actor, str(target).removeprefix("torch."), out)
    return out


def actor_dir(checkpoint: Path) -> Path:
    """The actor directory of `checkpoint`, refusing what is incomplete or not a checkpoint at all."""
    if not checkpoint.exists():
        raise ExportError(f"checkpoint {checkpoint} does not exist")
    if not checkpoint.is_dir():
        raise ExportError(f"checkpoint {checkpoint} is not a directory")
    if checkpoint.name.endswith(".partial"):
        raise ExportError(f"checkpoint {checkpoint} is incomplete: its save never finished")
    if any((checkpoint / name).exists() for name in ("actor", "critic", "coordinator.json", MANIFEST)):
        if not (checkpoint / MANIFEST).is_file():
            raise ExportError(f"checkpoint {checkpoint} is incomplete: it has no {MANIFEST} (its save was "
                              "interrupted); export a complete one")
        checkpoint = checkpoint / "actor"
        if not checkpoint.is_dir():
            raise ExportError(f"checkpoint {checkpoint.parent} has no actor/ directory")
    elif not ((checkpoint / "weights").exists() or (checkpoint / "hf").exists()):
        latest = latest_checkpoint(checkpoint)
        hint = f" (the latest complete one here is {latest})" if latest else ""
        raise ExportError(f"{checkpoint} is neither a run checkpoint (step-XXXXXXXX/ with {MANIFEST}) nor an "
                          f"actor checkpoint directory (weights/ and hf/){hint}")
    if not (checkpoint / "weights" / ".metadata").is_file():
        raise ExportError(f"{checkpoint} has no weights/ (torch.distributed.checkpoint files with their .metadata)")
    if not (checkpoint / "hf" / "config.json").is_file():
        raise ExportError(f"{checkpoint} has no hf/ with the model's config.json")
    if not any((checkpoint / "hf" / name).is_file() for name in _TOKENIZER_FILES):
        raise ExportError(f"{checkpoint}/hf has no tokenizer (only the actor's checkpoint has one)")
    return checkpoint


def export_dtype(config, dtype: str) -> torch.dtype:
    """`dtype` by name; "auto": the dtype the config was saved with (float32 when it names none)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ExportError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        return DTYPES[dtype]
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # transformers 5 / 4
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    return saved if saved in DTYPES.values() else torch.float32


def check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"output {out} exists and is not empty; choose a new directory")


def _read_hf(hf: Path):
    """The model config and the tokenizer saved in `hf`."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoConfig.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the model config and tokenizer in {hf}: {exc}") from None


def _empty_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The architecture of `config` in `dtype` on the CPU, its memory allocated once and not
    initialized (every tensor that export writes is then read from the checkpoint)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # not a causal LM (a critic's value model, say)
        raise ExportError(f"hf/config.json describes no causal LM transformers knows: {exc}") from None
    model = model.to(dtype).to_empty(device="cpu")
    # to_empty gives each parameter its own storage, which unties shared ones (input and output
    # embeddings). Non-persistent buffers (rotary frequencies) stay unset: save_pretrained does not
    # write them and from_pretrained computes them.
    model.tie_weights()
    return model


def _load_weights(model: torch.nn.Module, weights: Path) -> None:
    """The checkpoint's "model" entries into `model`'s tensors, after checking that they are exactly
    the tensors it has (a missing or surplus key means the checkpoint and hf/ do not match)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(weights))
    stored = {key.removeprefix(_KEY_PREFIX): meta for key, meta in reader.read_metadata().state_dict_metadata.items()
              if key.startswith(_KEY_PREFIX)}
    if not stored:
        raise ExportError(f"{weights} holds no model weights")
    state = model.state_dict()
    targets, missing = {}, []
    for names in _tied_groups(model):  # a tied tensor is loaded if any of its names was saved
        saved = [name for name in names if name in stored]
        missing += [] if saved else names
        targets.update((name, state[name]) for name in saved)
    if missing:
        raise ExportError(f"{weights} lacks {len(missing)} of the weights of the model in hf/config.json: "
                          f"{_some(missing)}")
    surplus = sorted(set(stored) - set(state))
    if surplus:
        raise ExportError(f"{weights} has {len(surplus)} weights that the model in hf/config.json has not: "
                          f"{_some(surplus)}")
    wrong = [f"{key} {tuple(stored[key].size)} (hf/config.json: {tuple(tensor.shape)})"
             for key, tensor in targets.items() if tuple(getattr(stored[key], "size", ())) != tuple(tensor.shape)]
    if wrong:
        raise ExportError(f"{weights} and hf/config.json disagree on shapes: {_some(wrong)}")
    with warnings.catch_warnings():  # one process and no group is what export means to do
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        # Straight into the model's own tensors, whatever the shards (copy_ casts to the export dtype).
        dcp.load({"model": targets}, storage_reader=reader, no_dist=True)


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The state dict's names, those of one tensor (tied embeddings) together."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
