"""Continuing a conversation by one assistant turn (multi-turn rollouts, docs/environments.md).

What came before is never tokenized again: a conversation travels as the token ids the prompt, the
model's turns and the earlier observations already are, and only the environment's new messages
are rendered, as the chat template writes them after an assistant turn, together with the header
of the next assistant turn (the generation prompt). Re-tokenizing the whole text instead would
train on ids the model never sampled wherever a tokenizer merges differently across a boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from rolefleet.actor.types import Continuation, FinishReason, Sample
from rolefleet.common.errors import FailedPrecondition, InvalidArgument, LimitExceeded

# A stand-in assistant message: the template's text after it is what follows an assistant turn.
_MARKER = "RoleFleetTurnProbe"
_BASE = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": _MARKER}]
MAX_OBSERVATION_MESSAGES = 64


class TurnRenderer:
    """Renders observations with the tokenizer's chat template, as the text that follows an
    assistant turn, and tokenizes that text alone."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def observation_ids(self, observation: list[dict[str, str]], after: int, field: str) -> list[int]:
        """The ids to append to a context whose last token is `after` (the turn's stop token): the
        template's text after an assistant message, less that stop token's own text when the
        template writes it there (the context has it already)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise FailedPrecondition("the actor's tokenizer has no chat template: multi-turn rollouts render the "
                                     "environment's observations with it (give the model one)")
        try:
            text = self.tokenizer.apply_chat_template([*_BASE, *observation], add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
            raise InvalidArgument(field, f"the chat template refused the observation: {exc}") from None
        if not isinstance(text, str) or _MARKER not in text:
            raise InvalidArgument(field, "the chat template did not render the conversation as text")
        tail = text.split(_MARKER, 1)[1]
        ended_with = self.tokenizer.convert_ids_to_tokens(after)
        if isinstance(ended_with, str) and ended_with and tail.startswith(ended_with):
            tail = tail[len(ended_with):]
        ids = self.encode(tail)
        if not ids:
            raise InvalidArgument(field, "renders to no tokens")
        return ids


    def encode(self, text: str) -> list[int]:
        """`text`'s ids, without special tokens added: the fast tokenizer's own Rust encoder where
        it is all the call does (special tokens kept whole, as the call keeps them by default). The
        transformers call around it builds its full encoding (masks, offsets) and costs twice the
        encoding itself, on the endpoint's loop for every turn of every session."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "split_special_tokens", False):
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def check_observation(messages: list[dict[str, str]], field: str, max_bytes: int) -> None:
    """Messages to render: at least one, each a role and content of strings, within `max_bytes`."""
    if not messages:
        raise InvalidArgument(field, "no messages: a continuation appends the environment's answer")
    if len(messages) > MAX_OBSERVATION_MESSAGES:
        raise InvalidArgument(field, f"{len(messages)} messages, at most {MAX_OBSERVATION_MESSAGES}")
    size = 0
    for j, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not m["role"] or not isinstance(m.get("content"), str):
            raise InvalidArgument(f"{field}[{j}]", "needs a role and a content (strings)")
        size += len(m["content"].encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise LimitExceeded(field, f"{size} bytes exceed actor.max_prompt_bytes={max_bytes}")


def with_no_room(chunks: Iterator[list[Sample]], context_ids: list[torch.Tensor], room: list[bool],
                 version: int) -> Iterator[list[Sample]]:
    """The engine's chunks for the conversations that had room (numbered among themselves),
    renumbered in the request's order, then one chunk of an empty turn for each conversation
    without room: `finish_reason` LENGTH at no tokens, which ends it (coordinator/episodes.py)."""
    index = [i for i, fits in enumerate(room) if fits]
    for chunk in chunks:
        yield [replace(s, prompt_index=index[s.prompt_index]) for s in chunk]
    yield [Sample(prompt_index=i, sample_index=0, prompt_ids=ids, response_ids=torch.zeros(0, dtype=torch.int64),
                  logprobs=torch.zeros(0), finish_reason=FinishReason.LENGTH, policy_version=version,
                  response_text="") for i, (ids, fits) in enumerate(zip(context_ids, room)) if not fits]


def whole_responses(chunks: Iterator[list[Sample]], continuations: list[Continuation],
                    tokenizer: Any) -> Iterator[list[Sample]]:
    """Resumed responses (`Continuation.resume_from`) get the text of the whole response, decoded
    from its ids in one piece, as the engines decode one: the pieces' texts joined would break a
    character whose bytes two pieces split."""
    for chunk in chunks:
        out = []
        for s in chunk:
            c = continuations[s.prompt_index]
            if c.resume_from:
                ids = torch.cat([c.context_ids[c.resume_from:].to(torch.int64), s.response_ids])
                s = replace(s, response_text=tokenizer.decode(ids.tolist(), skip_special_tokens=True))
            out.append(s)
        yield out
