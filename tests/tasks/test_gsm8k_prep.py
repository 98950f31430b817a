"""`rolefleet data gsm8k OUT_DIR` (rolefleet.tasks.gsm8k_prep) on the project's sample: from a local
copy as GSM8K's own (a save_to_disk DatasetDict of plain questions) or from files, it writes
train.parquet and test.parquet that configs/gsm8k.yaml reads as the coordinator does, every ground
truth the full solution the math reward scores by its `####` number. Sources it cannot use are
refused naming the option, with nothing written. Nothing reaches a hub."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rolefleet.app.tiny_model import build_tokenizer
from rolefleet.cli import main
from rolefleet.common.config import load_config
from rolefleet.coordinator.data import PromptDataset
from rolefleet.reward.math_answers import math_reward
from rolefleet.tasks.gsm8k_prep import INSTRUCTION

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
SAMPLE, SAMPLE_TEST = REPO / "examples" / "gsm8k_sample.jsonl", REPO / "examples" / "gsm8k_sample_test.jsonl"


def sample(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def as_gsm8k(rows: list[dict]) -> list[dict]:
    """The sample's rows as GSM8K holds them: the problem as plain text, without the instruction."""
    return [{"question": r["question"][0]["content"].removesuffix("\n" + INSTRUCTION), "answer": r["answer"]}
            for r in rows]


@pytest.fixture
def local_copy(tmp_path) -> Path:
    """What `load_dataset("openai/gsm8k", "main").save_to_disk(DIR)` writes, with the sample's rows."""
    path = tmp_path / "gsm8k_hf"
    datasets.DatasetDict(train=datasets.Dataset.from_list(as_gsm8k(sample(SAMPLE))),
                         test=datasets.Dataset.from_list(as_gsm8k(sample(SAMPLE_TEST)))).save_to_disk(str(path))
    return path


@pytest.fixture
def chat_tokenizer(tmp_path) -> Path:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tokenizer.save_pretrained(tmp_path / "chat-model")
    return tmp_path / "chat-model"


def prepare(capsys, *args: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = main(["data", "gsm8k", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_a_local_copy_prepared_loads_through_the_shipped_config_with_the_answers_the_math_reward_scores(
        local_copy, chat_tokenizer, tmp_path, capsys):
    out = tmp_path / "data" / "gsm8k"
    code, lines, _ = prepare(capsys, str(out), "--source", str(local_copy))
    assert code == 0
    assert lines == [f"{out}/train.parquet: 64 rows ({local_copy}, split train)",
                     f"{out}/test.parquet: 16 rows ({local_copy}, split test)",
                     f"train on them: rolefleet up configs/gsm8k.yaml data.path={out}/train.parquet "
                     f"eval.path={out}/test.parquet"]
    cfg = load_config(REPO / "configs" / "gsm8k.yaml", [f"data.path={out}/train.parquet",
                                                        f"eval.path={out}/test.parquet",
                                                        f"model.model_name_or_path={chat_tokenizer}"])
    train, held_out = PromptDataset.for_run(cfg), PromptDataset.for_eval(cfg)
    # The same prompts and answers as the sample's, which asks for the answer the same way.
    for dataset, rows in ((train, sample(SAMPLE)), (held_out, sample(SAMPLE_TEST))):
        assert len(dataset.records) == len(rows) and dataset.stats["data/filtered"] == 0
        for record, row in zip(dataset.records, rows):
            assert record.prompt == f"<user>{row['question'][0]['content']}<assistant>"
            assert record.ground_truth == row["answer"] and record.extra == {}
    for record in train.records + held_out.records:
        final = record.ground_truth.rsplit("#### ", 1)[1]
        assert math_reward(record.prompt, f"So it is 7.\n#### {final}", record.ground_truth, {}) == 1.0
        assert math_reward(record.prompt, f"#### {int(final) + 1}", record.ground_truth, {}) == 0.0


def test_files_of_one_split_each_and_questions_already_chat_messages(tmp_path, capsys):
    out = tmp_path / "out"
    code, lines, _ = prepare(capsys, str(out), "--source", str(REPO / "examples" / "gsm8k_sample.parquet"),
                             "--test-source", str(SAMPLE_TEST))
    assert code == 0 and lines[1] == f"{out}/test.parquet: 16 rows ({SAMPLE_TEST})"
    for split, source in (("train", SAMPLE), ("test", SAMPLE_TEST)):
        written = pq.read_table(out / f"{split}.parquet").to_pylist()
        assert written == [{"question": r["question"], "answer": r["answer"]} for r in sample(source)]


def test_sources_it_cannot_use_are_refused_naming_the_option_and_nothing_is_written(offline, tmp_path, capsys,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code, _, err = prepare(capsys, str(out), "--source", str(SAMPLE))
    assert code == 2 and err == (f"rolefleet: --source: {SAMPLE} is a single split (the training one): give the test "
                                 "split with --test-source (GSM8K's test split, or a held-out file)\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "42"}) + "\n")
    code, _, err = prepare(capsys, str(out), "--source", str(SAMPLE), "--test-source", "bad.jsonl")
    assert code == 2 and err.startswith("rolefleet: --test-source: bad.jsonl:1: 'answer' must be GSM8K's solution "
                                        "ending in '#### <number>'"), err
    code, _, err = prepare(capsys, str(out), "--source", "rolefleet-tests/no-such-gsm8k")
    assert code == 2 and err.startswith("rolefleet: --source: rolefleet-tests/no-such-gsm8k is neither in the local "
                                        "`datasets` cache nor reachable on the hub (ConnectionError: "), err
    assert "run this command on a machine that reaches the hub" in err
    (tmp_path / "shards").mkdir()
    code, _, err = prepare(capsys, str(out), "--source", "shards")
    assert code == 2 and err.startswith("rolefleet: --source shards is a directory but not a `datasets` save_to_disk "
                                        "directory"), err
    assert not out.exists()
