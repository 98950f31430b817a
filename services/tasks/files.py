"""Prompt files: JSONL (one JSON object a line) or Parquet (one record a row).

Each record has a prompt column (plain text, or chat messages: a list of {role, content}), an
optional ground-truth column (a string or a number), and any other columns, which go to the reward
as `PromptRecord.extra`. Column names may be dotted to reach into a nested object or struct
(`reward_model.ground_truth`, as verl's preprocessed Parquet files hold it). Every problem is a
DataError naming the file, the line (JSONL, from 1 as editors count) or row (Parquet, from 0 as
pandas and pyarrow count) and the column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from rolefleet.tasks import DataError

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
Messages = list[dict[str, Any]]
_PARQUET_BATCH_ROWS = 4096
_SHOWN_CHARS = 80


@dataclass(frozen=True)
class Columns:
    """Which columns hold what (`data.prompt_key`, `data.answer_key`, `data.extra_keys`)."""

    prompt: str = "prompt"
    answer: str = "ground_truth"
    extra: Optional[tuple[str, ...]] = None  # None: every column but the prompt and answer ones


@dataclass(frozen=True)
class RawPrompt:
    """A record as the file holds it, before any chat template or token limit."""

    where: str  # "data.jsonl:3" or "data.parquet row 2": named by every error about this record
    prompt: Union[str, Messages]
    ground_truth: str
    extra: dict[str, Any]

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


def file_format(path: str | Path, fmt: Optional[str] = None) -> str:
    """`fmt` when given, else the format the extension names."""
    if fmt is not None:
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell the format of {path} from its extension (known: "
                         f"{', '.join(FORMATS)}); set data.format to jsonl or parquet")
    return FORMATS[suffix]


def read_prompts(path: str | Path, fmt: Optional[str] = None, columns: Columns = Columns()) -> list[RawPrompt]:
    """Every record of a JSONL or Parquet file, checked; at least one."""
    rows = _jsonl_rows(path) if file_format(path, fmt) == "jsonl" else _parquet_rows(path, columns)
    prompts = [_prompt(row, where, columns) for where, row in rows]
    if not prompts:
        raise DataError(f"data.path: {path} holds no records")
    return prompts


def _jsonl_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
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
                if not isinstance(obj, dict):
                    raise DataError(f"data.path: {where}: expected a JSON object with a prompt column, "
                                    f"got {type(obj).__name__}")
                yield where, obj
    except UnicodeDecodeError as e:
        raise DataError(f"data.path: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _parquet_rows(path: str | Path, columns: Columns) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data.path: {path} is not a readable Parquet file ({e})") from None
    names = file.schema_arrow.names
    # A missing column is missing in every row: say so once, before reading any.
    for key, what in ((columns.prompt, "data.prompt_key"), *((k, "data.extra_keys") for k in columns.extra or ())):
        if key not in names and key.split(".")[0] not in names:
            raise DataError(f"{what}: {path} has no column {key!r} (columns: {', '.join(names)})")
    row = 0
    try:
        for batch in file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for obj in batch.to_pylist():
                yield f"{path} row {row}", obj
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data.path: {path}: cannot read row {row} or the rows after it ({e})") from None


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
