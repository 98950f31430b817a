"""`rolefleet data gsm8k OUT_DIR`: GSM8K as configs/gsm8k.yaml reads it, `train.parquet` and
`test.parquet` in OUT_DIR (docs/data.md, "GSM8K itself").

The source is the hub's `openai/gsm8k` (configuration `main`), from the local cache or the hub, or a
local copy: a save_to_disk directory, or JSONL, JSON or Parquet files with GSM8K's `question` and
`answer` columns. A source of one split (a file, a saved Dataset) gives the training split; the test
split then comes from `--test-source`.

Each written row holds
  question  chat messages: one user message, the problem and how to give the answer (a question
            that already is chat messages, as the project's sample holds, is kept as it is)
  answer    GSM8K's full solution: the math reward reads the number after its `####`
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from rolefleet.tasks import DataError
from rolefleet.tasks.files import read_rows, source_format
from rolefleet.tasks.hf import HubUnavailable, saved_splits

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
# The sample (examples/make_gsm8k_sample.py) asks the same: what the format reward checks for.
INSTRUCTION = 'Solve the problem step by step, then give the final answer on its own last line as "#### <number>".'
_FINAL = re.compile(r"####\s*\S")


@dataclass(frozen=True)
class Written:
    split: str
    path: Path
    rows: int
    source: str  # where its rows came from, as the summary names it


def prepare(out_dir: str | Path, source: str = HUB_ID, name: Optional[str] = None,
            test_source: Optional[str] = None) -> list[Written]:
    """Write OUT_DIR/train.parquet and OUT_DIR/test.parquet; a problem with a source is a DataError
    naming the option that gave it (`--source`, `--test-source`, `--name`)."""
    if test_source is None and not _has_splits(source, "--source"):
        raise DataError(f"--source: {source} is a single split (the training one): give the test split with "
                        "--test-source (GSM8K's test split, or a held-out file)")
    # Both read before anything is written: a bad source leaves no half-written output.
    tables = {"train": _rows(source, name, "train", "--source"),
              "test": _rows(test_source or source, name, "test", "--test-source" if test_source else "--source")}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, (origin, rows) in tables.items():
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        written.append(Written(split, path, len(rows), origin))
    return written


def _has_splits(source: str, flag: str) -> bool:
    """Whether `source` holds named splits (a hub dataset, a saved DatasetDict)."""
    try:
        fmt = source_format(source)
        return fmt == "hub" or (fmt == "datasets" and saved_splits(source) is not None)
    except ValueError as e:  # DataError too
        raise DataError(_flagged(str(e), flag)) from None


def _rows(source: str, name: Optional[str], split: str, flag: str) -> tuple[str, list[dict[str, Any]]]:
    """(how the summary names the source, its rows of `split` as GSM8K rows)."""
    if name is None and source == HUB_ID:
        name = HUB_CONFIG
    try:
        rows = [_gsm8k_row(row, where) for where, row in read_rows(source, split=split, name=name)]
    except HubUnavailable as e:
        raise DataError(f"{flag}: {source} is neither in the local `datasets` cache nor reachable on the hub "
                        f"({e.reason}): run this command on a machine that reaches the hub and copy its output here, or "
                        "give --source a local copy (a save_to_disk directory; or the training split's file, and "
                        "--test-source the test split's)") from None
    except ValueError as e:  # DataError too
        raise DataError(_flagged(str(e), flag)) from None
    if not rows:
        raise DataError(f"{flag}: {source} holds no rows")
    if not _has_splits(source, flag):
        return source, rows
    named = f" ({name})" if name and source_format(source) == "hub" else ""
    return f"{source}{named}, split {split}", rows


def _gsm8k_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    question, answer = row.get("question"), row.get("answer")
    if not ((isinstance(question, str) and question.strip()) or (isinstance(question, list) and question)):
        raise DataError(f"data.path: {where}: 'question' must be the problem's text (or chat messages), got "
                        f"{question!r:.80}; GSM8K's columns are question and answer")
    if not (isinstance(answer, str) and _FINAL.search(answer)):
        raise DataError(f"data.path: {where}: 'answer' must be GSM8K's solution ending in '#### <number>' (the math "
                        f"reward reads that number), got {answer!r:.80}")
    if isinstance(question, str):
        question = [{"role": "user", "content": f"{question.strip()}\n{INSTRUCTION}"}]
    return {"question": question, "answer": answer}


def _flagged(message: str, flag: str) -> str:
    """A reader's message, which names the data.* keys, as this command's options name them."""
    message = re.sub(r"; set data\.format to .*$", "", message)  # no such option here
    message = re.sub(r"\bdata\.(path|split)\b", flag, message).replace("data.name", "--name")
    return message if message.startswith("--") else f"{flag}: {message}"
