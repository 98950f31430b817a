"""Prompt files (rolefleet.tasks.files): what a record may hold, errors that name the file, the
line or row and the column; and the GSM8K-format sample in examples/."""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import operator
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolefleet.app.tiny_model import build_tokenizer
from rolefleet.common.config import DataSection
from rolefleet.coordinator.data import PromptDataset
from rolefleet.tasks import DataError
from rolefleet.tasks.files import Columns, read_prompts

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def parquet(tmp_path: Path, table: pa.Table) -> Path:
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("line, message", [
    ('{"prompt": [{"role": "user"}]}', "d.jsonl:2: 'prompt' message 0 must be an object with a string 'role' "
                                       "and a string 'content'"),
    ('{"prompt": []}', "d.jsonl:2: 'prompt' is an empty list of chat messages"),
    ('{"prompt": ""}', "d.jsonl:2: 'prompt' must be a non-empty string, got ''"),
    ('{"prompt": "q", "ground_truth": [1]}', "d.jsonl:2: 'ground_truth' must be a string or a number, got [1]"),
    ('{"prompt": "q", "ground_truth": true}', "d.jsonl:2: 'ground_truth' must be a string or a number"),
    ('{"question": "q"}', "d.jsonl:2: no 'prompt' column (the record has: question)"),
    ("[1]", "d.jsonl:2: expected a JSON object"),
    ("{", "d.jsonl:2: not JSON"),
])
def test_a_malformed_jsonl_line_is_named(tmp_path, line, message):
    path = jsonl(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(err.value).startswith("data.path: ") and message in str(err.value)


def test_a_malformed_parquet_row_is_named(tmp_path):
    path = parquet(tmp_path, pa.table({"prompt": ["q0", None, "q2"], "ground_truth": ["a", "b", "c"]}))
    with pytest.raises(DataError, match=r"d.parquet row 1: 'prompt' must be a non-empty string, got None"):
        read_prompts(path)
    path = parquet(tmp_path, pa.table({"question": ["q"]}))
    with pytest.raises(DataError, match=r"data.prompt_key: .*d.parquet has no column 'prompt' \(columns: question\)"):
        read_prompts(path)
    when = pa.array([datetime.datetime(2024, 1, 1)] * 2, pa.timestamp("s"))
    path = parquet(tmp_path, pa.table({"prompt": ["q0", "q1"], "when": when}))
    with pytest.raises(DataError, match=r"d.parquet row 0: column 'when' holds a datetime, which is not a JSON value"):
        read_prompts(path)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="bad.parquet is not a readable Parquet file"):
        read_prompts(tmp_path / "bad.parquet")


def test_dotted_keys_reach_into_nested_columns_and_extra_keys_choose_what_the_reward_gets(tmp_path):
    # verl's preprocessed files: chat messages in `prompt`, the answer inside `reward_model`.
    rows = [{"prompt": [{"role": "user", "content": "q"}], "data_source": "gsm8k",
             "reward_model": {"style": "rule", "ground_truth": "18"}, "extra_info": {"index": 0}}]
    path = parquet(tmp_path, pa.Table.from_pylist(rows))
    [record] = read_prompts(path, columns=Columns(answer="reward_model.ground_truth"))
    assert record.ground_truth == "18" and record.prompt == [{"role": "user", "content": "q"}]
    assert record.extra == {"data_source": "gsm8k", "reward_model": {"style": "rule", "ground_truth": "18"},
                            "extra_info": {"index": 0}}
    [record] = read_prompts(path, columns=Columns(answer="reward_model.ground_truth", extra=("extra_info.index",)))
    assert record.extra == {"extra_info.index": 0}
    with pytest.raises(DataError, match="data.extra_keys: .* has no column 'source'"):
        read_prompts(path, columns=Columns(extra=("source",)))


def test_parquet_and_jsonl_give_the_same_records(tmp_path):
    rows = [{"prompt": "a", "ground_truth": "1", "n": 3}, {"prompt": "b", "ground_truth": "2", "n": 4}]
    from_jsonl = read_prompts(jsonl(tmp_path, *map(json.dumps, rows)))
    from_parquet = read_prompts(parquet(tmp_path, pa.Table.from_pylist(rows)))
    assert [(p.prompt, p.ground_truth, p.extra) for p in from_jsonl] == \
        [(p.prompt, p.ground_truth, p.extra) for p in from_parquet]
    assert [p.where for p in from_parquet] == [f"{tmp_path / 'd.parquet'} row {i}" for i in (0, 1)]


# --- the GSM8K-format sample ---------------------------------------------------------------------

def sample_script():
    spec = importlib.util.spec_from_file_location("make_gsm8k_sample", EXAMPLES / "make_gsm8k_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def arithmetic(expr: str) -> float:
    def value(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](value(node.left), value(node.right))
        assert isinstance(node, ast.Constant)
        return node.value
    return value(ast.parse(expr, mode="eval").body)


def test_the_gsm8k_sample_is_what_its_script_makes_and_its_answers_add_up(tmp_path):
    sample_script().main(tmp_path)
    for name in ("gsm8k_sample.jsonl", "gsm8k_sample_test.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / name).read_bytes(), name
    rows = [json.loads(line) for line in (EXAMPLES / "gsm8k_sample.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (EXAMPLES / "gsm8k_sample_test.jsonl").read_text().splitlines()]
    assert pq.read_table(EXAMPLES / "gsm8k_sample.parquet").to_pylist() == rows
    assert len(rows) == 64 and len({r["answer"] for r in rows}) == 64
    # The held-out split shares no problem with the training one (eval/train_overlap 0).
    assert len(test) == 16 and not {json.dumps(r["question"]) for r in test} & {json.dumps(r["question"]) for r in rows}
    for row in rows + test:
        *steps, last = row["answer"].split("\n")
        assert re.fullmatch(r"#### \d+", last), last
        for expr, result in re.findall(r"<<([^=]+)=(\d+)>>", row["answer"]):
            assert arithmetic(expr) == int(result), (row["id"], expr)
        assert int(last.removeprefix("#### ")) == int(re.findall(r"<<[^=]+=(\d+)>>", steps[-1])[-1])


@pytest.mark.parametrize("name", ["gsm8k_sample.jsonl", "gsm8k_sample.parquet"])
def test_the_gsm8k_sample_loads_as_a_dataset_through_a_chat_template(tmp_path, name):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tokenizer.save_pretrained(tmp_path)
    cfg = DataSection(task=None, path=str(EXAMPLES / name), prompt_key="question", answer_key="answer")
    data = PromptDataset.from_config(cfg, 0, tokenizer_path=str(tmp_path))
    first = data.records[0]
    assert len(data.records) == 64 and first.prompt.startswith("<user>Jonas buys 6 sandwiches")
    assert first.prompt.endswith('as "#### <number>".<assistant>')
    assert first.ground_truth.endswith("\n#### 8") and first.extra == {"id": "sample-000", "topic": "change"}
