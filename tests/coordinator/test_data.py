"""PromptDataset: prompt files through the chat template and the token limit, deterministic
epochs, and a position saved and restored for resume."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from rolefleet.app.preflight import check_data
from rolefleet.app.tiny_model import build_tokenizer
from rolefleet.common.config import ConfigError, DataSection, parse_config
from rolefleet.coordinator.data import PromptDataset
from rolefleet.tasks import DataError

# Role, content and the generation prompt in characters the tiny tokenizer knows: one token each.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 6*7?"}]


def tokenizer_dir(path: Path, template: str | None) -> str:
    """The tiny character tokenizer (one token per character, no special tokens added), saved as a
    model directory with or without a chat template; config.json makes it a model directory for
    the preflight check."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return tokenizer_dir(tmp_path_factory.mktemp("chat-tokenizer"), TEMPLATE)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    return tokenizer_dir(tmp_path_factory.mktemp("plain-tokenizer"), None)


def write(path: Path, rows: list[dict]) -> str:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(path: str, model: str | None = None, seed: int = 0, **data) -> PromptDataset:
    return PromptDataset.from_config(DataSection(task=None, path=path, **data), seed, tokenizer_path=model)


# --- formats, chat template, extra columns ------------------------------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_chat_messages_go_through_the_chat_template_and_extra_columns_reach_the_record(tmp_path, chat_model, suffix):
    rows = [{"prompt": CHAT, "ground_truth": 42, "id": 7, "meta": {"level": "easy", "tags": ["x"]}},
            {"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": 2, "id": 8,
             "meta": {"level": "hard", "tags": []}}]
    data = load(write(tmp_path / f"d{suffix}", rows), chat_model)
    first, second = data.records
    assert first.prompt == "system: be brief.\nuser: what is 6*7?\nassistant:"
    assert first.ground_truth == "42"  # a number arrives as its text
    assert first.extra == {"id": 7, "meta": {"level": "easy", "tags": ["x"]}}
    assert second.prompt == "user: 1+1?\nassistant:" and second.extra["id"] == 8
    assert data.stats == {"data/records": 2, "data/filtered": 0, "data/truncated": 0}


def test_plain_text_prompts_are_one_user_message_when_the_template_is_asked_for(tmp_path, chat_model):
    path = write(tmp_path / "d.jsonl", [{"prompt": "2+3=", "ground_truth": "5"}])
    assert load(path, chat_model).records[0].prompt == "2+3="  # default: text stays text
    assert load(path, chat_model, chat_template=True).records[0].prompt == "user: 2+3=\nassistant:"
    # The built-in task takes the template too.
    task = PromptDataset.from_config(DataSection(task="addition", size=3, chat_template=True), 0, chat_model)
    assert all(r.prompt.startswith("user: ") and r.prompt.endswith("=\nassistant:") for r in task.records)


def test_a_tokenizer_without_a_chat_template_is_a_config_error_naming_the_key_and_model(tmp_path, plain_model):
    path = write(tmp_path / "d.jsonl", [{"prompt": CHAT}])
    with pytest.raises(ConfigError) as err:
        load(path, plain_model)
    assert "data.chat_template" in str(err.value) and plain_model in str(err.value)
    assert "no chat template" in str(err.value)


def test_chat_messages_without_the_template_are_refused(tmp_path, chat_model):
    path = write(tmp_path / "d.jsonl", [{"prompt": "text"}, {"prompt": CHAT}])
    with pytest.raises(DataError, match=r"data.chat_template: .*d.jsonl:2: the prompt is a list of chat messages"):
        load(path, chat_model, chat_template=False)


def test_the_run_takes_the_tokenizer_of_the_actor_model_and_preflight_finds_template_problems(tmp_path, chat_model,
                                                                                            plain_model):
    path = write(tmp_path / "d.parquet", [{"prompt": CHAT, "ground_truth": "42"}])
    raw = {"model": {"model_name_or_path": chat_model}, "data": {"task": None, "path": path}}
    cfg = parse_config(raw)
    assert PromptDataset.for_run(cfg).records[0].prompt.endswith("what is 6*7?\nassistant:")
    assert check_data(cfg) == []
    cfg = parse_config(raw, [f"actor.model_name_or_path={plain_model}"])
    [problem] = check_data(cfg)
    assert problem.startswith("data.chat_template: ") and plain_model in problem


def test_the_format_comes_from_the_extension_or_data_format(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('{"prompt": "q"}\n')
    base = {"model": {"model_name_or_path": "m"}}
    with pytest.raises(ConfigError, match="data.format"):
        parse_config({**base, "data": {"task": None, "path": str(path)}})
    cfg = parse_config({**base, "data": {"task": None, "path": str(path), "format": "jsonl"}})
    assert PromptDataset.from_config(cfg.data, 0).records[0].prompt == "q"


# --- long prompts ------------------------------------------------------------------------------

LENGTHS = {"short": "ab", "exact": "abcdefgh", "long": "0123456789", "longer": "abcdefghijklmnop"}


def overlong_file(tmp_path) -> str:
    return write(tmp_path / "d.jsonl", [{"prompt": text, "ground_truth": name} for name, text in LENGTHS.items()])


def test_overlong_prompts_are_filtered_and_counted(tmp_path, plain_model):
    data = load(overlong_file(tmp_path), plain_model, max_prompt_tokens=8)
    assert [r.ground_truth for r in data.records] == ["short", "exact"]
    assert data.stats == {"data/records": 2, "data/filtered": 2, "data/truncated": 0}


def test_overlong_prompts_are_cut_from_the_left_and_counted(tmp_path, plain_model):
    data = load(overlong_file(tmp_path), plain_model, max_prompt_tokens=8, overlong="truncate")
    # The end of each prompt stays: that is where the question is.
    assert [r.prompt for r in data.records] == ["ab", "abcdefgh", "23456789", "ijklmnop"]
    assert data.stats == {"data/records": 4, "data/filtered": 0, "data/truncated": 2}


def test_truncation_keeps_the_chat_template_whole(tmp_path, chat_model):
    path = write(tmp_path / "d.jsonl", [{"prompt": CHAT}, {"prompt": "what is 6*7?"}])
    # "system: be brief.\nuser: " is 24 characters and "\nassistant:" 11: 7 are left for the question.
    data = load(path, chat_model, max_prompt_tokens=42, overlong="truncate")
    assert [r.prompt for r in data.records] == ["system: be brief.\nuser: is 6*7?\nassistant:",
                                                "user: what is 6*7?\nassistant:"]
    assert data.stats["data/truncated"] == 1
    # No room for any of the last message: the prompt cannot be truncated, so it is dropped (counted).
    data = load(path, chat_model, max_prompt_tokens=35, overlong="truncate")
    assert [r.prompt for r in data.records] == ["user: what is 6*7?\nassistant:"]
    assert data.stats == {"data/records": 1, "data/filtered": 1, "data/truncated": 0}


def test_overlong_error_names_the_prompts(tmp_path, plain_model):
    with pytest.raises(DataError) as err:
        load(overlong_file(tmp_path), plain_model, max_prompt_tokens=8, overlong="error")
    message = str(err.value)
    assert message.startswith("data.max_prompt_tokens: 2 of 4 prompts are longer than 8 tokens")
    assert "d.jsonl:3 (10 tokens)" in message and "d.jsonl:4 (16 tokens)" in message


def test_a_limit_no_prompt_fits_is_an_error(tmp_path, plain_model):
    with pytest.raises(DataError, match="every one of the 4 prompts .* is longer than 1 tokens"):
        load(overlong_file(tmp_path), plain_model, max_prompt_tokens=1)


# --- order and resume ---------------------------------------------------------------------------

def numbered(tmp_path, n: int = 10, name: str = "d.jsonl") -> str:
    return write(tmp_path / name, [{"prompt": f"q{i}", "ground_truth": str(i)} for i in range(n)])


def answers(records) -> list[str]:
    return [r.ground_truth for r in records]


def test_shuffling_is_deterministic_by_seed_and_each_epoch_is_a_permutation(tmp_path):
    path = numbered(tmp_path)
    a, b, other = load(path, seed=1), load(path, seed=1), load(path, seed=2)
    epochs = [answers(a.batch(e, 10)) for e in (1, 2, 3)]
    assert epochs[0] == answers(b.batch(1, 10)) and epochs[0] != answers(other.batch(1, 10))
    for epoch in epochs:
        assert sorted(epoch, key=int) == [str(i) for i in range(10)]
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    in_order = load(path, seed=1, shuffle=False)
    assert answers(in_order.batch(1, 10)) == answers(in_order.batch(2, 10)) == [str(i) for i in range(10)]


def test_a_restored_position_gives_the_same_following_batches(tmp_path):
    path = numbered(tmp_path)
    run = load(path, seed=5)
    for _ in range(3):
        run.next_batch(4)  # 12 prompts: into the second epoch
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint stores
    assert state["position"] == 12 and state["epoch"] == 1 and state["seed"] == 5
    expected = [answers(run.next_batch(4)) for _ in range(4)]
    resumed = load(path, seed=5)
    resumed.load_state_dict(state)
    assert [answers(resumed.next_batch(4)) for _ in range(4)] == expected
    # Drawing by step is the same stream: position 12 = 3 steps of 4.
    assert answers(load(path, seed=5).batch(4, 4)) == expected[0]


def test_a_resume_keeps_the_saved_order_even_if_the_seed_changed(tmp_path):
    path = numbered(tmp_path)
    run = load(path, seed=5)
    run.next_batch(7)
    resumed = load(path, seed=6)
    resumed.load_state_dict(run.state_dict())
    assert answers(resumed.next_batch(9)) == answers(run.next_batch(9))


def test_a_resume_on_changed_data_is_refused(tmp_path):
    run = load(numbered(tmp_path), seed=0)
    run.next_batch(4)
    state = run.state_dict()
    changed = write(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "ground_truth": str(i + (i == 3))} for i in range(10)])
    with pytest.raises(DataError, match="data.path: cannot resume: the saved data position was taken on other"):
        load(changed, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="11 records"):
        load(numbered(tmp_path, 11, "e.jsonl"), seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="missing fingerprint"):
        load(numbered(tmp_path), seed=0).load_state_dict({k: v for k, v in state.items() if k != "fingerprint"})


def test_a_template_that_writes_the_bos_token_does_not_double_the_one_the_tokenizer_adds(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])  # adds BOS, as Llama's does
    tokenizer.chat_template = "{{ bos_token }}" + TEMPLATE
    tokenizer.save_pretrained(tmp_path / "model")
    data = load(write(tmp_path / "d.jsonl", [{"prompt": "2+3="}]), str(tmp_path / "model"), chat_template=True,
                max_prompt_tokens=22)  # 21 characters and the BOS
    prompt = data.records[0].prompt
    assert prompt == "user: 2+3=\nassistant:"
    ids = AutoTokenizer.from_pretrained(tmp_path / "model")(prompt)["input_ids"]  # as the actor tokenizes it
    assert ids.count(tokenizer.bos_token_id) == 1 and len(ids) == 1 + len(prompt) == 22
