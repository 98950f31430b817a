"""JSON prompt files (rolefleet.tasks.files): an array of records or JSON lines under a .json name,
with the records and errors of the other formats; the format told from the path or data.format."""

from __future__ import annotations

import json

import pytest

from rolefleet.common.config import ConfigError, parse_config
from rolefleet.tasks import DataError
from rolefleet.tasks.files import Columns, read_prompts, source_format

BASE = {"model": {"model_name_or_path": "some/model"}}
ROWS = [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "reward_model": {"ground_truth": 42}, "id": "a"},
        {"prompt": "Name the capital of France.", "reward_model": {"ground_truth": "Paris"}, "id": "b"}]


def test_a_json_array_and_json_lines_give_the_same_records_as_jsonl(tmp_path):
    (tmp_path / "array.json").write_text(json.dumps(ROWS, indent=2))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # what Dataset.to_json writes
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    columns = Columns(answer="reward_model.ground_truth", extra=("id",))
    read = {name: read_prompts(tmp_path / name, columns=columns) for name in ("array.json", "lines.json", "lines.jsonl")}
    expected = [(ROWS[0]["prompt"], "42", {"id": "a"}), ("Name the capital of France.", "Paris", {"id": "b"})]
    for name, prompts in read.items():
        assert [(p.prompt, p.ground_truth, p.extra) for p in prompts] == expected, name
    assert [p.where for p in read["array.json"]] == [f"{tmp_path / 'array.json'} record {i}" for i in (0, 1)]
    assert [p.where for p in read["lines.json"]] == [f"{tmp_path / 'lines.json'}:{i}" for i in (1, 2)]


@pytest.mark.parametrize("text, message", [
    ('[{"prompt": "a"}, {"prompt": "b", "ground_truth": null}]',
     "d.json record 1: 'ground_truth' must be a string or a number, got None"),
    ('[{"prompt": "a"}, ["b"]]', "d.json record 1: expected a JSON object with a prompt column, got list"),
    ('[{"prompt": "a"},', "d.json: not a JSON array (Expecting value"),
    ('{"prompt": "a"}\n{"prompt": 3}\n', "d.json:2: 'prompt' must be a non-empty string, got 3"),
    ('{"prompt": "a"}\n{"prompt"\n', "d.json:2: not JSON"),
    ('{\n  "data": [{"prompt": "a"}]\n}\n', "d.json holds one JSON object (keys: data), not records: a .json prompt "
                                             "file is an array of objects, or one object a line"),
])
def test_a_malformed_json_file_is_named_with_its_record_or_line(tmp_path, text, message):
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(DataError) as err:
        read_prompts(tmp_path / "d.json")
    assert str(err.value).startswith("data.path: ") and message in str(err.value)


def test_the_format_is_told_from_what_the_path_is_or_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text(json.dumps(ROWS[1:]))
    assert [source_format(p) for p in ("a.jsonl", "a.ndjson", "a.JSON", "a.pq", "openai/gsm8k", "gsm8k")] == \
        ["jsonl", "jsonl", "json", "parquet", "hub", "hub"]
    with pytest.raises(ConfigError, match=r"cannot tell the format of prompts.txt .*; set data.format to one of "
                                          r"jsonl, json, parquet, datasets, hub"):
        parse_config(BASE, ["data.path=prompts.txt"])
    cfg = parse_config(BASE, ["data.path=prompts.txt", "data.format=json", "data.answer_key=reward_model.ground_truth"])
    assert [p.ground_truth for p in read_prompts(cfg.data.path, cfg.data.format, Columns(answer=cfg.data.answer_key))] \
        == ["Paris"]
    # Nothing of that name here is a hub id only when it has an id's shape, not a file's or a path's.
    with pytest.raises(ConfigError, match="data.path train.json is not a file"):
        parse_config(BASE, ["data.path=train.json"])
    for path in ("./data/train", "/data/gsm8k", "data/gsm8k/main"):
        with pytest.raises(ConfigError, match=f"data.path {path} is no file, directory or hub dataset id"):
            parse_config(BASE, [f"data.path={path}"])
