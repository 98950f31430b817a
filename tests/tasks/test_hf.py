"""`datasets` sources (rolefleet.tasks.hf): a save_to_disk directory (a DatasetDict, whose split
data.split / eval.split picks, or a Dataset) read through data.path with the records and errors of
any prompt file; a directory that is no dataset and an unknown split refused by the config; a hub
id that is neither here nor loadable (offline) refused saying what to do. Nothing reaches a hub."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolefleet.app.preflight import check_data
from rolefleet.common.config import ConfigError, parse_config
from rolefleet.coordinator.data import PromptDataset
from rolefleet.tasks import DataError
from rolefleet.tasks.files import Columns, read_prompts

datasets = pytest.importorskip("datasets")

BASE = {"model": {"model_name_or_path": "some/model"}}
# verl's preprocessed layout: chat messages, the answer inside a struct, an index in another.
VERL_KEYS = ["data.answer_key=reward_model.ground_truth", "data.extra_keys=[extra_info.index]"]


def verl_rows(*questions: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": q}], "data_source": "gsm8k",
             "reward_model": {"style": "rule", "ground_truth": str(len(q))}, "extra_info": {"index": i}}
            for i, q in enumerate(questions)]


@pytest.fixture
def saved(tmp_path) -> Path:
    """A DatasetDict (train: 3 rows, test: 1) written by save_to_disk."""
    path = tmp_path / "gsm8k"
    datasets.DatasetDict(train=datasets.Dataset.from_list(verl_rows("one", "three", "seven")),
                         test=datasets.Dataset.from_list(verl_rows("held out"))).save_to_disk(str(path))
    return path


def test_a_saved_dataset_dict_gives_the_split_data_split_names_and_eval_its_test_split(saved):
    cfg = parse_config(BASE, [f"data.path={saved}", *VERL_KEYS, f"eval.path={saved}", "eval.every=1"])
    assert (cfg.data.split, cfg.eval.split) == ("train", "test")
    d = cfg.data
    train = read_prompts(d.path, d.format, Columns(d.prompt_key, d.answer_key, tuple(d.extra_keys)), split=d.split)
    assert [(p.where, p.prompt[0]["content"], p.ground_truth, p.extra) for p in train] == [
        (f"{saved}[train] row 0", "one", "3", {"extra_info.index": 0}),
        (f"{saved}[train] row 1", "three", "5", {"extra_info.index": 1}),
        (f"{saved}[train] row 2", "seven", "5", {"extra_info.index": 2})]
    e = cfg.eval_data()
    [held_out] = read_prompts(e.path, e.format, Columns(e.prompt_key, e.answer_key), split=e.split)
    assert held_out.prompt == [{"role": "user", "content": "held out"}] and held_out.ground_truth == "8"
    test = read_prompts(saved, columns=Columns(answer="reward_model.ground_truth"), split="test")
    assert [p.where for p in test] == [f"{saved}[test] row 0"]


def test_a_saved_directory_under_a_tilde_or_variable_is_expanded_like_any_path(saved, monkeypatch):
    monkeypatch.setenv("HOME", str(saved.parent))
    monkeypatch.setenv("DATA", str(saved.parent))
    cfg = parse_config(BASE, ["data.path=~/gsm8k", "eval.path=$DATA/gsm8k", "eval.every=1"])
    assert cfg.data.path == cfg.eval.path == str(saved)


def test_a_saved_dataset_is_one_split_and_loads_as_the_coordinator_loads_it(tmp_path):
    path = tmp_path / "plain"
    rows = [{"prompt": f"{a}+{a}=", "ground_truth": 2 * a, "level": "easy"} for a in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    cfg = parse_config(BASE, [f"data.path={path}", "data.split=anything"])  # one split: nothing to pick
    dataset = PromptDataset.from_config(cfg.data, 0)
    assert [(r.prompt, r.ground_truth, r.extra) for r in dataset.records] == \
        [(f"{a}+{a}=", str(2 * a), {"level": "easy"}) for a in range(5)]


def test_a_bad_row_or_missing_column_of_a_saved_dataset_is_named(saved, tmp_path):
    with pytest.raises(DataError, match=rf"data.prompt_key: {saved}\[train\] has no column 'question' "
                                        r"\(columns: prompt, data_source, reward_model, extra_info\)"):
        read_prompts(saved, columns=Columns(prompt="question"))
    path = tmp_path / "bad"
    datasets.Dataset.from_list([{"prompt": "fine", "ground_truth": "1"}, {"prompt": "", "ground_truth": "2"}]) \
        .save_to_disk(str(path))
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(err.value) == f"data.path: {path} row 1: 'prompt' must be a non-empty string, got ''; a chat prompt " \
                             "is a list of {role, content} messages"
    with pytest.raises(DataError, match=r"\[train\] row 0: 'reward_model' must be a string or a number, got \{"):
        read_prompts(saved, columns=Columns(answer="reward_model"))


@pytest.mark.parametrize("key", ["data", "eval"])
def test_an_unknown_split_is_a_config_error_naming_the_splits_there_are(saved, key):
    overrides = [f"data.path={saved}", f"eval.path={saved}", f"{key}.split=validation"]
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, overrides)
    assert f"{key}.split: {saved} has no split 'validation' (splits: train, test)" in str(err.value)


@pytest.mark.parametrize("key", ["data", "eval"])
def test_a_directory_that_is_no_saved_dataset_is_refused_at_config_time(tmp_path, key):
    (tmp_path / "parquet_shards").mkdir()
    (tmp_path / "parquet_shards" / "train-00000-of-00001.parquet").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, [f"{key}.path={tmp_path / 'parquet_shards'}", "data.task=addition"])
    assert f"{key}.path {tmp_path / 'parquet_shards'} is a directory but not a `datasets` save_to_disk directory" \
        in str(err.value)
    with pytest.raises(ConfigError, match=r"data.path .* is a directory but not a `datasets` save_to_disk"):
        parse_config(BASE, [f"data.path={tmp_path / 'parquet_shards'}", "data.format=datasets"])


def test_an_id_neither_here_nor_loadable_offline_is_a_data_error_saying_what_to_do(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    cfg = parse_config(BASE, ["data.path=rolefleet-tests/no-such-dataset", "data.name=main"])
    assert cfg.data.path == "rolefleet-tests/no-such-dataset"  # a hub id: no path expansion touches it
    with pytest.raises(DataError) as err:
        read_prompts(cfg.data.path, cfg.data.format, split=cfg.data.split, name=cfg.data.name)
    message = str(err.value)
    assert message.startswith("data.path: rolefleet-tests/no-such-dataset is no file or directory here, and as a hub "
                              "dataset it cannot be loaded (ConnectionError: ")
    assert "prepare a local copy where the hub is reachable" in message
    assert "datasets.load_dataset('rolefleet-tests/no-such-dataset', 'main').save_to_disk(DIR)" in message
    # The preflight of `rolefleet up` finds it before any role starts; an eval source names eval.path.
    assert check_data(cfg) == [message]
    cfg = parse_config(BASE, ["eval.path=rolefleet-tests/no-such-dataset", "eval.every=1"])
    with pytest.raises(DataError, match=r"^eval.path: rolefleet-tests/no-such-dataset is no file .* set eval.path to"):
        PromptDataset.for_eval(cfg)

