"""Prompt sources of the Hugging Face `datasets` library: a directory written by `save_to_disk` (a
Dataset, or a DatasetDict whose split `data.split` picks) and a hub dataset id loaded through
`load_dataset` from the local cache or the hub.

What a directory holds is told from the small JSON files `save_to_disk` writes beside the Arrow
shards, so the config check reads no data and imports no `datasets` (a second of start-up every
role would pay); the library is imported only to read the rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from rolefleet.tasks import DataError

# An owner/name or a bare name, as the hub spells them; a path with more parts, or one that starts
# with `.`, `/` or `~` is a local path however it is spelled.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
_DICT_FILE, _DATASET_FILES = "dataset_dict.json", ("state.json", "dataset_info.json")


def looks_like_hub_id(path: str) -> bool:
    return _HUB_ID.fullmatch(path) is not None


class HubUnavailable(DataError):
    """A hub dataset that is neither in the local cache nor reachable (or does not exist)."""

    def __init__(self, dataset_id: str, name: Optional[str], reason: str):
        self.reason = reason
        super().__init__(f"data.path: {dataset_id} is no file or directory here, and as a hub dataset it cannot be "
                         f"loaded ({reason}): {local_copy_hint(dataset_id, name)}")


def local_copy_hint(dataset_id: str, name: Optional[str]) -> str:
    load = ", ".join(map(repr, [dataset_id, *([name] if name else [])]))
    return ("prepare a local copy where the hub is reachable (`rolefleet data gsm8k DIR` for GSM8K; for any "
            f"dataset, `datasets.load_dataset({load}).save_to_disk(DIR)`) and set data.path to it")


def is_saved(path: str | Path) -> bool:
    """`path` is a directory `save_to_disk` wrote (a Dataset or a DatasetDict)."""
    path = Path(path)
    return (path / _DICT_FILE).is_file() or all((path / name).is_file() for name in _DATASET_FILES)


def saved_splits(path: str | Path) -> Optional[list[str]]:
    """The splits of a saved DatasetDict; None for a saved Dataset (a single split)."""
    file = Path(path) / _DICT_FILE
    if not file.is_file():
        return None
    try:
        splits = json.loads(file.read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.path: {file} is not a readable `datasets` split list ({e})") from None
    return [str(s) for s in splits]


def check_split(splits: list[str], split: str, where: str) -> None:
    if split not in splits:
        raise DataError(f"data.split: {where} has no split {split!r} (splits: {', '.join(splits) or 'none'})")


def _library() -> Any:
    try:
        import datasets  # seconds to import, and only for a saved Dataset or a hub id
    except ImportError as e:  # a dependency; an install without it still reads files
        raise DataError(f"data.path: a save_to_disk directory or a hub dataset is read through the `datasets` "
                        f"library, which is not installed here ({e}): pip install 'datasets>=3.0'") from None
    return datasets


def saved_table(path: str | Path, split: str) -> tuple[str, Any]:
    """(how errors name it, the Dataset) of a `save_to_disk` directory: its split `split` when it
    holds a DatasetDict."""
    datasets = _library()
    splits = saved_splits(path)
    if splits is not None:
        check_split(splits, split, str(path))
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"data.path: {path} is not a readable `datasets` directory ({e})") from None
    if splits is None:
        return str(path), loaded
    return f"{path}[{split}]", loaded[split]


def hub_table(dataset_id: str, name: Optional[str], split: str) -> tuple[str, Any]:
    """(how errors name it, the Dataset) of split `split` of a hub dataset, from the local cache or
    the hub; every way that fails is a DataError that says what to do."""
    datasets = _library()
    try:
        loaded = datasets.load_dataset(dataset_id, name)
    except (ConnectionError, FileNotFoundError) as e:
        # Offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) and not cached, no network, or no such dataset.
        raise HubUnavailable(dataset_id, name, f"{type(e).__name__}: {e}") from None
    except ValueError as e:  # a config name missing or unknown: the message lists the dataset's configs
        raise DataError(f"data.name: hub dataset {dataset_id} (data.name={name}): {e}") from None
    if not isinstance(loaded, datasets.DatasetDict):
        return dataset_id, loaded
    check_split(list(loaded), split, f"hub dataset {dataset_id}")
    return f"{dataset_id}[{split}]", loaded[split]

