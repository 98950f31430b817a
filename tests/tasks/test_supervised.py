"""Supervised examples (`tasks/supervised.py`): a completion follows the prompt as the actor would
see it and ends as the model ends a turn; in a conversation only the assistant messages are trained,
their ids the template's own; records without a target are refused naming the key."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rolefleet.tasks import DataError, PromptRecord
from rolefleet.tasks.supervised import ExampleTokenizer

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30?"},
                {"role": "assistant", "content": "Let me add."}, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "42"}]


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    return AutoTokenizer.from_pretrained(chat_model_dir)


def test_a_completion_follows_the_rendered_prompt_and_ends_the_turn(tok):
    maker = ExampleTokenizer(tok, chat=True, completion_key="completion", from_task=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+30?"}], add_generation_prompt=True, tokenize=False)
    ex = maker.example(PromptRecord(prompt, "42", {"completion": "It is 42."}), "r #0")
    assert ex.prompt_ids.tolist() == tok(prompt)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ex.response_ids.tolist() == tok("It is 42.", add_special_tokens=False)["input_ids"] + [end]
    assert ex.loss_mask is None  # every response token is trained


def test_in_a_conversation_only_the_assistant_messages_are_trained_with_the_template_s_ids(tok):
    maker = ExampleTokenizer(tok, chat=True, completion_key="completion", from_task=False)
    record = PromptRecord("rendered", "", {}, original=CONVERSATION)
    ex = maker.example(record, "r #0")
    whole = tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    first = tok(tok.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"]
    assert ex.prompt_ids.tolist() == first  # the system and user messages, and the assistant header
    assert torch.cat([ex.prompt_ids, ex.response_ids]).tolist() == whole  # the template's ids, as rendered whole
    trained = tok.decode(ex.response_ids[ex.loss_mask].tolist())
    context = tok.decode(ex.response_ids[~ex.loss_mask].tolist())
    assert "Let me add." in trained and "42" in trained and "And?" not in trained
    assert "And?" in context and "Let me add." not in context and "12+30" not in trained + context


def test_context_after_the_last_assistant_message_is_left_out(tok):
    maker = ExampleTokenizer(tok, chat=True, completion_key="completion", from_task=False)
    ex = maker.example(PromptRecord("x", "", {}, original=CONVERSATION[:3] + [{"role": "user", "content": "ok"}]),
                       "r #0")
    assert bool(ex.loss_mask is None or ex.loss_mask[-1])
    assert "ok" not in tok.decode(ex.response_ids.tolist())


def test_a_task_s_ground_truth_is_its_completion_and_a_file_without_one_is_refused_naming_the_key(tok):
    task = ExampleTokenizer(tok, chat=False, completion_key="completion", from_task=True)
    ex = task.example(PromptRecord("3+4=", "7"), "data.task addition #0")
    assert ex.response_ids.tolist() == tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    files = ExampleTokenizer(tok, chat=False, completion_key="answer_text", from_task=False)
    with pytest.raises(DataError, match=r"data.completion_key: d.jsonl #3 has no 'answer_text' column"):
        files.example(PromptRecord("3+4=", "7"), "d.jsonl #3")
    with pytest.raises(DataError, match=r"data.completion_key: d.jsonl #4: 'answer_text' must be non-empty text"):
        files.example(PromptRecord("3+4=", "7", {"answer_text": 7}), "d.jsonl #4")
    with pytest.raises(DataError, match="starts with an assistant message"):
        files.example(PromptRecord("x", "", {}, original=[{"role": "assistant", "content": "hi"}]), "d.jsonl #5")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    class Rewriting:
        """Renders each conversation with a count of its messages up front: nothing extends."""

        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

        def apply_chat_template(self, messages, **kwargs):
            return f"[{len(messages)}]" + tok.apply_chat_template(messages, **kwargs)

    maker = ExampleTokenizer(Rewriting(), chat=True, completion_key="completion", from_task=False)
    with pytest.raises(DataError, match="data.chat_template: r #0: the chat template renders message"):
        maker.example(PromptRecord("x", "", {}, original=CONVERSATION), "r #0")


def test_the_tool_warm_start_task_s_conversations_show_the_tools_and_train_the_calls_not_the_results(tok):
    from rolefleet.tasks import make_task
    from rolefleet.tasks.render import PromptRenderer

    records = make_task("tool_arithmetic_sft", 40, 0)
    calling = [r for r in records if len(r.prompt) == 4]
    assert 0.1 < len(calling) / len(records) < 0.5  # some call the calculator, most answer at once
    renderer = PromptRenderer(tok, "m", chat_template=True, tools=["calculator"])
    maker = ExampleTokenizer(tok, chat=True, completion_key="completion", from_task=True, renderer=renderer)
    record = calling[0]
    ex = maker.example(PromptRecord(renderer.render(record.prompt[:1], "r"), record.ground_truth, record.extra,
                                    original=record.prompt), "r #0")
    assert "calculator" in tok.decode(ex.prompt_ids.tolist())  # the tools, as the RL run's prompts show them
    trained = tok.decode(ex.response_ids[ex.loss_mask].tolist())
    assert "<tool_call>" in trained and record.extra["expression"] in trained
    assert trained.count(record.ground_truth) == 1  # the final answer; the tool's result is context
    assert record.ground_truth in tok.decode(ex.response_ids[~ex.loss_mask].tolist())


def test_examples_over_the_length_limit_are_dropped_cut_or_refused_as_data_overlong_says():
    from rolefleet.tasks.supervised import Example, fit

    def example(prompt: int, response: int, mask: list[bool] | None = None) -> Example:
        return Example(torch.arange(prompt), torch.arange(100, 100 + response),
                       None if mask is None else torch.tensor(mask))

    # Within 6: kept as they are. Over: 4+4; a prompt that fills the limit alone; a conversation whose
    # trained (assistant) tokens all lie past the limit, and one with one trained token within it.
    given = [example(2, 3), example(4, 4), example(6, 1), example(2, 6, [False] * 4 + [True] * 2),
             example(2, 6, [False] * 3 + [True] * 3)]
    kept = fit(given, 6, "filter", "the 6 positions", "d.jsonl")
    assert (kept.kept, kept.filtered, kept.truncated) == ([0], 4, 0) and kept.examples == [given[0]]
    cut = fit(given, 6, "truncate", "the 6 positions", "d.jsonl")
    assert (cut.kept, cut.filtered, cut.truncated) == ([0, 1, 4], 2, 2)
    assert cut.examples[1].response_ids.tolist() == [100, 101] and cut.examples[1].loss_mask is None
    assert cut.examples[2].response_ids.tolist() == [100, 101, 102, 103]
    assert cut.examples[2].loss_mask.tolist() == [False, False, False, True]
    assert all(len(e.prompt_ids) + len(e.response_ids) <= 6 for e in cut.examples)
    assert fit(given, None, "error", "", "d.jsonl").kept == [0, 1, 2, 3, 4]  # no limit known: all kept
    with pytest.raises(DataError, match=r"^data.max_example_tokens: d.jsonl #1: its 8 prompt \+ completion tokens "
                                        r"exceed the 6 positions; data.overlong=truncate"):
        fit(given, 6, "error", "the 6 positions", "d.jsonl")
