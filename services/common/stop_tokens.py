"""Which token ids end a response (DESIGN "Engines").

A response ends at any id of: the tokenizer's eos, every id of the checkpoint's generation config
`eos_token_id` (an int or a list: chat checkpoints often list the end-of-turn token there, which is
not the tokenizer's eos: Llama-3-Instruct's `<|eot_id|>`, Qwen2.5's `<|im_end|>` and
`<|endoftext|>`), and the request's `sampling.stop_token_ids`. Every rollout engine stops at the
same set and keeps the stop token as the response's last token, which is trained.

The chat template is the other witness of where a turn ends: `end_of_turn_id` reads the token a
template writes right after an assistant message, so a checkpoint whose stop set lacks it can be
warned about (or, when converting a checkpoint, fixed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional

log = logging.getLogger(__name__)

# A stand-in assistant message: the template's text after it is the end of an assistant turn.
_MARKER = "RoleFleetEndOfTurnProbe"


def _ids(value: Any) -> list[int]:
    """An `eos_token_id` setting (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def checkpoint_stop_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The ids a checkpoint itself ends responses at: the tokenizer's eos and the generation
    config's `eos_token_id` (int or list), sorted, without repeats."""
    ids = set(_ids(getattr(tokenizer, "eos_token_id", None)))
    ids.update(_ids(getattr(generation_config, "eos_token_id", None)))
    return tuple(sorted(ids))


def merged(checkpoint_ids: Iterable[int], request_ids: Iterable[int]) -> tuple[int, ...]:
    """The stop set of one request: the checkpoint's and the request's own."""
    return tuple(sorted(set(checkpoint_ids) | set(request_ids)))


def end_of_turn_id(tokenizer: Any) -> Optional[int]:
    """The special token the tokenizer's chat template writes right after an assistant message
    (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), or None: no template, a template that refuses
    a plain conversation, or no special token there (plain-text templates)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": _MARKER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template raises whatever its author chose
        return None
    if not isinstance(text, str) or _MARKER not in text:
        return None
    after = text.rsplit(_MARKER, 1)[1].lstrip()
    # The longest special token the text after the message starts with (`<|im_end|>`, not `<`).
    specials = sorted((t for t in getattr(tokenizer, "all_special_tokens", []) if t and after.startswith(t)),
                      key=len, reverse=True)
    extra = sorted((t for t in _added_tokens(tokenizer) if t and after.startswith(t)), key=len, reverse=True)
    for token in specials + extra:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            return token_id
    return None


def _added_tokens(tokenizer: Any) -> list[str]:
    """Special tokens the tokenizer added beyond its named ones (`<|eot_id|>` in Llama 3)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [str(t) for t in decoder.values() if getattr(t, "special", False)]


def warn_if_turn_runs_on(tokenizer: Any, stop_ids: Iterable[int], model: str) -> Optional[int]:
    """Warn when the chat template's end-of-turn token is not a stop id: chat prompts would then
    be answered past the end of the turn. Returns that token's id when it is missing."""
    eot = end_of_turn_id(tokenizer)
    if eot is None or eot in set(stop_ids):
        return None
    log.warning("%s: its chat template ends an assistant turn with %r (id %d), which is neither the tokenizer's "
                "eos nor in the generation config's eos_token_id: responses to chat prompts will run past the "
                "end of the turn; add it to sampling.stop_token_ids, or fix the checkpoint's "
                "generation_config.json", model, tokenizer.convert_ids_to_tokens(eot), eot)
    return eot
