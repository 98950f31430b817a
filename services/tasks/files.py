"""Prompt sources: JSONL (one JSON object a line), JSON (an array of objects, or JSON lines),
Parquet (one record a row), a `datasets` save_to_disk directory and a hub dataset id (both read
through the `datasets` library: `hf`).

Each record has a prompt column (plain text, or chat messages: a list of {role, content}), an
optional ground-truth column (a string or a number), and any other columns, which go to the reward
as `PromptRecord.extra`. Column names may be dotted to reach into a nested object or struct
(`reward_model.ground_truth`, as verl's preprocessed Parquet files hold it). Every problem is a
DataError naming the source, the line (JSONL, from 1 as editors count) or row (Parquet and
`datasets`, from 0 as pandas and pyarrow count; a JSON array's record, from 0 as its index) and
the column.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from rolefleet.tasks import DataError
from rolefleet.tasks.hf import check_split, hub_table, is_saved, looks_like_hub_id, saved_splits, saved_table

FILE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
FORMATS = ("jsonl", "json", "parquet", "datasets", "hub")
Messages = list[dict[str, Any]]
Row = tuple[str, dict[str, Any]]  # (where: named by every error about the row, the row)
_BATCH_ROWS = 4096
_SHOWN_CHARS = 80


@dataclass(frozen=True)
class Columns:
    """Which columns hold what (`data.prompt_key`, `data.answer_key`, `data.extra_keys`)."""

    prompt: str = "prompt"
    answer: str = "ground_truth"
    extra: Optional[tuple[str, ...]] = None  # None: every column but the prompt and answer ones


@dataclass(frozen=True)
class RawPrompt:
    """A record as the source holds it, before any chat template or token limit."""

    where: str  # "data.jsonl:3" or "data.parquet row 2": named by every error about this record
    prompt: Union[str, Messages]
    ground_truth: str
    extra: dict[str, Any]

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


def source_format(path: str | Path, fmt: Optional[str] = None, key: str = "data") -> str:
    """`fmt` when given, else what `path` is: a file by its extension, a save_to_disk directory, or
    a hub dataset id (when nothing here has that name). ValueError, naming `key`'s keys, when it is
    none of them."""
    local = Path(path)
    if fmt is not None:
        return fmt
    if local.is_dir():
        if not is_saved(local):
            raise ValueError(_not_saved(path, key))
        return "datasets"
    suffix = local.suffix.lower()
    if suffix in FILE_FORMATS:
        return FILE_FORMATS[suffix]
    if not local.exists():
        if looks_like_hub_id(str(path)):
            return "hub"
        raise ValueError(f"{key}.path {path} is no file, directory or hub dataset id")
    raise ValueError(f"cannot tell the format of {path} from its extension (known: {', '.join(FILE_FORMATS)}); "
                     f"set {key}.format to one of {', '.join(FORMATS)}")


def check_source(path: str, fmt: Optional[str], split: str, key: str = "data") -> str:
    """What the config checks of `key`.path before anything starts: the source exists as its format
    needs (a hub id is checked when it is loaded: that may need the network), and a saved
    DatasetDict has the split `key`.split names. Returns the format; ValueError naming the key."""
    fmt = source_format(path, fmt, key)
    if fmt == "datasets":
        if not (Path(path).is_dir() and is_saved(path)):
            raise ValueError(_not_saved(path, key))
        try:
            splits = saved_splits(path)
            if splits is not None:
                check_split(splits, split, path)
        except DataError as e:  # it names data.*: the config check names the section it checks
            raise ValueError(re.sub(r"\bdata\.", f"{key}.", str(e))) from None
    elif fmt != "hub" and not Path(path).is_file():
        raise ValueError(f"{key}.path {path} is not a file")
    return fmt


def _not_saved(path: str | Path, key: str) -> str:
    return (f"{key}.path {path} is a directory but not a `datasets` save_to_disk directory (one holds "
            "dataset_dict.json, or state.json and dataset_info.json): name a JSONL, JSON or Parquet file, or a "
            "directory that `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote")


def read_prompts(path: str | Path, fmt: Optional[str] = None, columns: Columns = Columns(), *,
                 split: str = "train", name: Optional[str] = None) -> list[RawPrompt]:
    """Every record of a prompt source, checked; at least one. `split` picks a DatasetDict's or a
    hub dataset's split, `name` a hub dataset's configuration."""
    prompts = [_prompt(row, where, columns) for where, row in read_rows(path, fmt, columns, split=split, name=name)]
    if not prompts:
        raise DataError(f"data.path: {path} holds no records")
    return prompts


def read_rows(path: str | Path, fmt: Optional[str] = None, columns: Optional[Columns] = None, *,
              split: str = "train", name: Optional[str] = None) -> Iterator[Row]:
    """The rows of a prompt source as it holds them. With `columns`, a column missing from a
    source that has a schema (Parquet, `datasets`) is an error before any row is read."""
    fmt = source_format(path, fmt)
    if fmt == "jsonl":
        return _jsonl_rows(path)
    if fmt == "json":
        return _json_rows(path)
    if fmt == "parquet":
        return _parquet_rows(path, columns)
    if fmt not in ("datasets", "hub"):
        raise DataError(f"data.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    where, table = saved_table(path, split) if fmt == "datasets" else hub_table(str(path), name, split)
    _check_columns(where, table.column_names, columns)
    return _arrow_rows(where, table.with_format("arrow").iter(batch_size=_BATCH_ROWS))


def _jsonl_rows(path: str | Path) -> Iterator[Row]:
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"data.path: {where}: not JSON ({e})") from None
                yield where, _object(obj, where)
    except UnicodeDecodeError as e:
        raise DataError(f"data.path: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json_rows(path: str | Path) -> Iterator[Row]:
    """An array of records, or JSON lines under a .json name (what `Dataset.to_json` writes)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.path: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise DataError(f"data.path: {path}: not a JSON array ({e})") from None
        yield from _jsonl_rows(path)  # JSON lines, or broken: the line reader says which line
        return
    if isinstance(whole, list):
        for i, obj in enumerate(whole):
            where = f"{path} record {i}"
            yield where, _object(obj, where)
    elif isinstance(whole, dict) and "\n" in text.strip():
        # One object over many lines: a wrapper ({"data": [...]}) or a single pretty-printed record.
        raise DataError(f"data.path: {path} holds one JSON object (keys: {', '.join(map(str, whole))}), not "
                        "records: a .json prompt file is an array of objects, or one object a line")
    else:
        yield from _jsonl_rows(path)


def _object(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(f"data.path: {where}: expected a JSON object with a prompt column, got {type(obj).__name__}")
    return obj


def _parquet_rows(path: str | Path, columns: Optional[Columns]) -> Iterator[Row]:
    import pyarrow as pa  # only for Parquet prompts: the config's checks and the coordinator import this module
    import pyarrow.parquet as pq  # as above

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data.path: {path} is not a readable Parquet file ({e})") from None
    _check_columns(str(path), file.schema_arrow.names, columns)
    return _arrow_rows(str(path), file.iter_batches(batch_size=_BATCH_ROWS))


def _check_columns(where: str, names: list[str], columns: Optional[Columns]) -> None:
    """A column missing from a schema is missing in every row: said once, before reading any."""
    if columns is None:
        return
    for key, what in ((columns.prompt, "data.prompt_key"), *((k, "data.extra_keys") for k in columns.extra or ())):
        if key not in names and key.split(".")[0] not in names:
            raise DataError(f"{what}: {where} has no column {key!r} (columns: {', '.join(names)})")


def _arrow_rows(where: str, batches: Iterable[Any]) -> Iterator[Row]:
    import pyarrow as pa  # as in _parquet_rows

    row = 0
    try:
        for batch in batches:
            for obj in batch.to_pylist():
                yield f"{where} row {row}", obj
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data.path: {where}: cannot read row {row} or the rows after it ({e})") from None


def _prompt(row: dict[str, Any], where: str, columns: Columns) -> RawPrompt:
    found, prompt = _column(row, columns.prompt)
    if not found:
        raise DataError(f"data.path: {where}: no {columns.prompt!r} column (the record has: "
                        f"{', '.join(map(str, row)) or 'nothing'}); data.prompt_key names the prompt column")
    found, truth = _column(row, columns.answer)
    if not found:
        truth = ""  # prompts without an answer: a reward model or a user function scores them
    elif truth is None or isinstance(truth, (bool, dict, list)):
        raise DataError(f"data.path: {where}: {columns.answer!r} must be a string or a number, got {_show(truth)}")
    return RawPrompt(where, _checked_prompt(prompt, where, columns.prompt), str(truth), _extra(row, where, columns))


def _column(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of `key` in `row`: a column of that exact name, else a dotted path into nested
    objects."""
    if key in row:
        return True, row[key]
    head, dot, rest = key.partition(".")
    if dot and isinstance(row.get(head), dict):
        return _column(row[head], rest)
    return False, None


def _checked_prompt(prompt: Any, where: str, key: str) -> Union[str, Messages]:
    if isinstance(prompt, str) and prompt:
        return prompt
    if not isinstance(prompt, list):
        raise DataError(f"data.path: {where}: {key!r} must be a non-empty string, got {_show(prompt)}; "
                        "a chat prompt is a list of {role, content} messages")
    if not prompt:
        raise DataError(f"data.path: {where}: {key!r} is an empty list of chat messages")
    messages = []
    for i, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]
                and isinstance(message.get("content"), str)):
            raise DataError(f"data.path: {where}: {key!r} message {i} must be an object with a string 'role' "
                            f"and a string 'content', got {_show(message)}")
        # Parquet gives every message every field of the column's struct type, None where unset.
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _extra(row: dict[str, Any], where: str, columns: Columns) -> dict[str, Any]:
    if columns.extra is None:
        # pandas stores a non-default index as `__index_level_0__` columns: row labels, not data.
        extra = {k: v for k, v in row.items()
                 if k not in (columns.prompt, columns.answer) and not k.startswith("__index_level_")}
    else:
        extra = {}
        for key in columns.extra:
            found, extra[key] = _column(row, key)
            if not found:
                raise DataError(f"data.path: {where}: no {key!r} column, which data.extra_keys names")
    for key, value in extra.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise DataError(f"data.path: {where}: column {key!r} holds a {type(value).__name__}, which is not a "
                            "JSON value (extra columns go to the reward as JSON): convert it to a string or "
                            "number, or leave it out with data.extra_keys") from None
    return extra


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
