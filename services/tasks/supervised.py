"""Supervised examples (`algorithm: sft`): the data's records as token ids to train on, with the
mask of the tokens that are trained.

A record gives its target in one of three ways, tried in this order:

- **a completion column** (`data.completion_key`, default `completion`): text trained after the
  prompt as the run renders it (its chat template, if any), ended as the model ends a turn (the
  template's end-of-turn token with a chat template, else the tokenizer's EOS);
- **a conversation**: a chat prompt with assistant messages; every assistant message is trained
  (its content and the template's end of it), everything else (system, user, tool messages, the
  template's headers) is context. Each message's tokens are the difference between the template's
  rendering of the conversation up to it and up to the one before, so the ids are the template's
  own; a template whose rendering of a longer conversation does not extend the shorter one's is
  refused;
- **a built-in task's ground truth** (`data.task`): the answer as the completion.

Prompt tokens are never targets: they are the example's prompt, outside its response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from rolefleet.common.stop_tokens import end_of_turn_id
from rolefleet.tasks import DataError, PromptRecord
from rolefleet.tasks.render import PromptRenderer


@dataclass(frozen=True)
class Example:
    prompt_ids: torch.Tensor         # int64 [P]
    response_ids: torch.Tensor       # int64 [R]: what follows the prompt
    loss_mask: torch.Tensor | None   # bool [R]: the trained tokens; None: all of them


class ExampleTokenizer:
    """Records to `Example`s with the actor model's tokenizer; `chat`: the run renders prompts with
    the chat template (`data.chat_template`)."""

    def __init__(self, tokenizer: Any, chat: bool, completion_key: str, from_task: bool, key: str = "data",
                 renderer: Optional[PromptRenderer] = None):
        """`renderer`: the dataset's, whose tools (`data.tools`) a conversation is rendered with, as
        its prompt is."""
        self.tokenizer, self.chat, self.completion_key, self.from_task, self.key = (
            tokenizer, chat, completion_key, from_task, key)
        self.renderer = renderer
        eot = end_of_turn_id(tokenizer) if chat else None
        self.end = eot if eot is not None else tokenizer.eos_token_id
        if self.end is None:
            raise DataError(f"{key}.completion_key: the tokenizer has no end-of-turn or EOS token to end a "
                            "completion with, so a model trained on them would not learn to stop")

    def example(self, record: PromptRecord, where: str) -> Example:
        completion = record.extra.get(self.completion_key)
        if completion is not None:
            if not isinstance(completion, str) or not completion:
                raise DataError(f"{self.key}.completion_key: {where}: {self.completion_key!r} must be non-empty "
                                f"text, got {type(completion).__name__} {str(completion)[:40]!r}")
            return self._completion(record.prompt, completion, where)
        given = record.given
        if isinstance(given, list) and any(m.get("role") == "assistant" for m in given):
            return self._conversation(given, where)
        if self.from_task:
            return self._completion(record.prompt, str(record.ground_truth), where)
        raise DataError(f"{self.key}.completion_key: {where} has no {self.completion_key!r} column and its prompt "
                        "is no conversation with assistant messages: algorithm sft needs a completion to train "
                        f"on (name its column with {self.key}.completion_key)")

    def _completion(self, prompt: str, completion: str, where: str) -> Example:
        # As the actor tokenizes a rendered prompt (`ActorCore.tokenize_prompts`).
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        target = self.tokenizer(completion, add_special_tokens=False)["input_ids"] + [self.end]
        if not prompt_ids:
            raise DataError(f"{self.key}.prompt_key: {where}: the prompt tokenizes to no tokens")
        return Example(_ids(prompt_ids), _ids(target), None)

    def _conversation(self, messages: list[dict], where: str) -> Example:
        first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        if first == 0:
            raise DataError(f"{self.key}.prompt_key: {where}: the conversation starts with an assistant message: "
                            "nothing to condition it on")
        ids = self._render(messages[:first], True, where)
        prompt_len, trained = len(ids), []
        for i in range(first, len(messages)):
            assistant = messages[i].get("role") == "assistant"
            after = i + 1 < len(messages) and messages[i + 1].get("role") == "assistant"
            longer = self._render(messages[:i + 1], after, where)
            if longer[:len(ids)] != ids:
                raise DataError(f"{self.key}.chat_template: {where}: the chat template renders message {i} "
                                "so that the conversation before it changes (its rendering of a longer "
                                "conversation does not extend the shorter one's): the trained tokens would not "
                                "be the ones the model sees; use a template that renders turns in order")
            trained += [assistant] * (len(longer) - len(ids))
            ids = longer
        if messages[-1].get("role") != "assistant":
            # Context after the last assistant message trains nothing: left out.
            keep = len(trained) - trained[::-1].index(True)
            ids, trained = ids[:prompt_len + keep], trained[:keep]
        mask = torch.tensor(trained, dtype=torch.bool)
        return Example(_ids(ids[:prompt_len]), _ids(ids[prompt_len:]), None if bool(mask.all()) else mask)

    def _render(self, messages: list[dict], generation_prompt: bool, where: str) -> list[int]:
        messages, tools = self.renderer.with_tools(messages) if self.renderer is not None else (messages, {})
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      tokenize=False, **tools)
        except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
            raise DataError(f"{self.key}.chat_template: {where}: the chat template refused the conversation: "
                            f"{exc}") from None
        # The template writes the special tokens it wants: none added here.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass(frozen=True)
class Fitted:
    """The examples within a length limit (`kept`: their indices among those given)."""
    examples: list[Example]
    kept: list[int]
    filtered: int   # dropped: over the limit (filter), or no trained token left within it (truncate)
    truncated: int  # their completion's end cut


def fit(examples: list[Example], limit: Optional[int], overlong: str, limit_named: str, source: str) -> Fitted:
    """`examples` whose prompt + completion tokens are at most `limit` (None: no limit), the longer
    ones as `overlong` says: filter (drop), truncate (cut the completion's end; dropped when no trained
    token is left), error (a DataError naming the first, `limit_named` naming where the limit comes from)."""
    kept, out, filtered, truncated = [], [], 0, 0
    for i, e in enumerate(examples):
        total = len(e.prompt_ids) + len(e.response_ids)
        if limit is None or total <= limit:
            kept.append(i)
            out.append(e)
            continue
        if overlong == "error":
            raise DataError(f"data.max_example_tokens: {source} #{i}: its {total} prompt + completion tokens exceed "
                            f"{limit_named}; data.overlong=truncate cuts the completion's end, filter drops it")
        room = limit - len(e.prompt_ids)
        mask = e.loss_mask[:room] if e.loss_mask is not None and room > 0 else None
        if overlong == "filter" or room < 1 or (mask is not None and not bool(mask.any())):
            filtered += 1
            continue
        kept.append(i)
        out.append(Example(e.prompt_ids, e.response_ids[:room], mask))
        truncated += 1
    return Fitted(out, kept, filtered, truncated)


def examples(tokenizer: Optional[Any], records: list[PromptRecord], chat: bool, completion_key: str,
             from_task: bool, source: str, key: str = "data",
             renderer: Optional[PromptRenderer] = None) -> list[Example]:
    """Every record as an Example (`where`: `source #i`); the first problem is a DataError."""
    if tokenizer is None:
        raise DataError(f"{key}.completion_key: algorithm sft needs the actor model's tokenizer")
    maker = ExampleTokenizer(tokenizer, chat, completion_key, from_task, key, renderer)
    return [maker.example(r, f"{source} #{i}") for i, r in enumerate(records)]
