"""Whether a model path can be loaded: a local model directory, or a hub id that can be (the same
rule for the config check before anything starts and for the roles' loaders)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id


def model_problem(path: str) -> Optional[str]:
    """Why `path` is neither a local model directory nor a hub id that can be loaded, or None."""
    local = Path(path).expanduser()
    if local.is_dir():
        return _model_dir_problem(path, local)
    if local.exists():
        if local.suffix.lower() == ".gguf":
            return (f"{path} is a GGUF file, not a model directory: write one from it with "
                    f"`rolefleet import-gguf {path} DIR` and give DIR")
        return f"{path} is a file, not a model directory"
    if _meant_as_local(path) or not is_repo_id(path):
        return f"model directory {path} does not exist"
    if hub_offline() and not _in_hub_cache(path):
        return (f"{path} is not a local directory, and as a hub id it is not in the local hub "
                "cache while HF_HUB_OFFLINE is set")
    return None


def _model_dir_problem(path: str, directory: Path) -> Optional[str]:
    config = directory / "config.json"
    if not config.is_file():
        return f"model directory {path} has no config.json"
    # A container's role runs as its own user: a file the host wrote for its owner alone (safetensors
    # writes 0600) fails deep in the loader as "No such file or directory".
    unreadable = sorted(f.name for f in directory.iterdir() if f.is_file() and not os.access(f, os.R_OK))
    if unreadable:
        return (f"model directory {path}: {', '.join(unreadable)} cannot be read by this process (uid {os.getuid()}); "
                f"make the files readable, e.g. chmod -R a+rX {path}")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{config} cannot be read as JSON: {e}"
    return None


def _meant_as_local(path: str) -> bool:
    """A path that does not exist but was clearly typed as one: `./x`, `/x`, `~/x`, or `runs/x`
    when `runs` is a local directory (a typo, not a hub organisation)."""
    if path.startswith((".", "/", "~")):
        return True
    first = path.split("/", 1)[0]
    return "/" in path and Path(first).is_dir()


def is_repo_id(path: str) -> bool:
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    # Read at call time (huggingface_hub reads it once at import), with the hub's own spelling rules.
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _in_hub_cache(repo_id: str) -> bool:
    return cached_config(repo_id) is not None


def cached_config(repo_id: str) -> Optional[Path]:
    """The config.json of `repo_id` in the local hub cache, or None."""
    cached = try_to_load_from_cache(repo_id, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def share_read_access(directory: str | Path) -> None:
    """Give every file under `directory` the read permissions the process's umask allows (rw-r--r--
    under the usual 022). The safetensors writer creates its files 0600, so a model written by one
    user (root on a host) could not be loaded by another (the non-root user of a container)."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(directory):
        for name in files:
            file = Path(root, name)
            file.chmod(file.stat().st_mode | (0o444 & ~umask))


# Where config.json files keep the context length (transformers maps each to max_position_embeddings).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length",
                 "n_ctx")


def max_positions(path: str) -> Optional[int]:
    """The model's context length from its config, or None when it cannot be read offline or the
    architecture has no such limit (the loader then reports or tolerates it). Read from the JSON
    file when it names the limit: importing transformers for AutoConfig would add seconds to every
    `rolefleet up`; AutoConfig (and its class defaults) answers for a file that does not."""
    raw = _config_json(path)
    if raw is not None:
        # Composite configs (vision-language) keep the language model's limit in their text config.
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        for key in POSITION_KEYS:
            if key in text:
                return _positive_int(text[key])
    return _max_positions_from_transformers(path)


def _config_json(path: str) -> Optional[dict]:
    """config.json of a local model directory or of a hub id in the local cache, or None."""
    local = Path(path).expanduser()
    if local.is_dir():
        file = local / "config.json"
    else:
        file = cached_config(path) if is_repo_id(path) else None
    if file is None:
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _max_positions_from_transformers(path: str) -> Optional[int]:
    from transformers import AutoConfig  # only where config.json does not say: seconds to import (max_positions)

    local = Path(path).expanduser()
    try:
        config = AutoConfig.from_pretrained(str(local) if local.is_dir() else path, local_files_only=True)
    except Exception:  # noqa: BLE001 - any unreadable config only skips this check
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _positive_int(getattr(text, "max_position_embeddings", None))


def _positive_int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
