"""`rolefleet export`: the actor's part of a checkpoint as a Hugging Face model directory.

The trainer saves its weights through torch.distributed.checkpoint (one file per training rank,
FSDP shards staying shards, see trainer/checkpoint.py) beside `hf/`, the model's config and
tokenizer. Export rebuilds the model from `hf/` without its weights, has DCP read every shard into
it in this one process (DCP reshards; no process group is needed), and writes config, safetensors
and tokenizer with `save_pretrained`, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it like
any other model directory.

A LoRA run's checkpoint holds only the adapters, with peft's `adapter_config.json` in `hf/` naming
the base model they were trained on: export loads that base model (or `base`), puts the adapters
in, merges them into the weights and writes the merged model; `adapter_out` also writes peft's
adapter directory (`PeftModel.from_pretrained(base, adapter_out)` loads it).
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rolefleet.common.model_paths import share_read_access
from rolefleet.trainer.checkpoint import MANIFEST, begin, commit, latest_checkpoint
from rolefleet.trainer.lora import ADAPTER_CONFIG

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
# What must match between a LoRA checkpoint's hf/config.json and the base model its adapters go into.
_SAME_ARCHITECTURE = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
_KEY_PREFIX = "model."  # save_trainer stores {"model": ..., "optim": ...}; export reads only the model


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an OUT that must not be written; the message says why."""


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "auto", base: str | None = None,
                      adapter_out: Path | None = None) -> Path:
    """Write the actor's weights of `checkpoint` (a run checkpoint `.../step-XXXXXXXX/` or an actor
    directory) as a Hugging Face model directory `out` in `dtype` (auto: the config's dtype, else
    float32). A LoRA checkpoint's adapters are merged into their base model (`base`: instead of the
    one the checkpoint names), and `adapter_out` gets peft's adapter directory. Each output appears
    whole or not at all; an existing non-empty one is refused. Returns `out`."""
    actor = actor_dir(Path(checkpoint))
    out = Path(out)
    check_out(out)
    lora = (actor / "hf" / ADAPTER_CONFIG).is_file()
    if adapter_out is not None:
        if not lora:
            raise ExportError(f"{actor} holds full weights, not LoRA adapters: there is no adapter directory to write")
        adapter_out = Path(adapter_out)
        check_out(adapter_out)
    elif base is not None and not lora:
        raise ExportError(f"{actor} holds full weights, not LoRA adapters: --base applies to LoRA checkpoints")
    config, tokenizer = _read_hf(actor / "hf")  # before the weights: a bad hf/ costs no model load
    target = export_dtype(config, dtype)
    if lora:
        model = _merged_model(actor, config, target, base, adapter_out)
    else:
        model = _empty_model(config, target)
        _load_weights(model, actor / "weights")

    def write(work: Path) -> None:
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        share_read_access(work)

    _write_atomically(out, write)
    log.info("exported %s (%s) to %s", actor, str(target).removeprefix("torch."), out)
    return out


def _write_atomically(out: Path, write) -> None:
    """`write(work)` into `out`'s partial directory, renamed to `out` once done (removed on failure).
    Safetensors either way: save_pretrained's argument is for transformers 4 (5 writes nothing else)."""
    work = begin(out)
    try:
        write(work)
        commit(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _merged_model(actor: Path, config, dtype: torch.dtype, base: str | None, adapter_out: Path | None):
    """The base model with the checkpoint's adapters merged into its weights, in `dtype`."""
    try:
        lora = LoraConfig.from_pretrained(str(actor / "hf"))
    except (OSError, ValueError, TypeError) as exc:
        raise ExportError(f"cannot read {actor / 'hf' / ADAPTER_CONFIG}: {exc}") from None
    base = base or lora.base_model_name_or_path
    if not base:
        raise ExportError(f"{actor / 'hf' / ADAPTER_CONFIG} names no base model: give it with --base")
    try:
        base_config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise ExportError(f"the adapters' base model {base} cannot be read ({exc}); give it with --base") from None
    differ = [f"{key} {getattr(base_config, key, None)} (hf/config.json: {getattr(config, key, None)})"
              for key in _SAME_ARCHITECTURE if getattr(base_config, key, None) != getattr(config, key, None)]
    if differ:
        raise ExportError(f"the base model {base} is not the one the adapters were trained on: {_some(differ)}")
    with warnings.catch_warnings():  # peft asks transformers about checkpointing by a deprecated name
        warnings.filterwarnings("ignore", category=FutureWarning)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora)
    trained = model.get_base_model()
    _load_weights(trained, actor / "weights", {n for n, p in trained.named_parameters() if p.requires_grad})
    if adapter_out is not None:
        _write_atomically(adapter_out, lambda work: model.save_pretrained(work))
    return model.merge_and_unload().to(dtype)


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
    try:
        return AutoConfig.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the model config and tokenizer in {hf}: {exc}") from None


def _empty_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The architecture of `config` in `dtype` on the CPU, its memory allocated once and not
    initialized (every tensor that export writes is then read from the checkpoint)."""
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


def _load_weights(model: torch.nn.Module, weights: Path, names: set[str] | None = None) -> None:
    """The checkpoint's "model" entries into `model`'s tensors, after checking that they are exactly
    the tensors it has (`names`: those of its tensors the checkpoint holds, a LoRA model's adapters;
    None: all). A missing or surplus key means the checkpoint and hf/ do not match."""
    reader = dcp.FileSystemReader(str(weights))
    stored = {key.removeprefix(_KEY_PREFIX): meta for key, meta in reader.read_metadata().state_dict_metadata.items()
              if key.startswith(_KEY_PREFIX)}
    if not stored:
        raise ExportError(f"{weights} holds no model weights")
    state = model.state_dict()
    if names is not None:
        state = {name: tensor for name, tensor in state.items() if name in names}
    targets, missing = {}, []
    for tied in _tied_groups(model, state):  # a tied tensor is loaded if any of its names was saved
        saved = [name for name in tied if name in stored]
        missing += [] if saved else tied
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


def _tied_groups(model: torch.nn.Module, state: dict) -> list[list[str]]:
    """The names of `state` (a part of the model's state dict), those of one tensor (tied
    embeddings) together."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in state:
            groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
