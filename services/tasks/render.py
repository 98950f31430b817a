"""From file records to the prompt texts the actor receives: the chat template, and the token limit.

The actor takes prompts as text and tokenizes them itself (`tokenizer(prompt)`), so prompts are
rendered here to text with the actor model's tokenizer, and their length is counted the same way
the actor will count it.

An overlong prompt is cut from the left: the start of its last message (of a plain text prompt,
the start of the text) goes, and the chat template is applied again around what is left. The end
of a prompt is what the model answers (the question after a long context, the turn it replies
to), and the template's own tokens (role headers, the generation prompt) stay intact, which
cutting the rendered text would break.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from rolefleet.reward.tool_schema import ToolSchemaError
from rolefleet.reward.tool_schema import tool_schemas as _tool_schemas
from rolefleet.tasks import DataError, PromptRecord
from rolefleet.tasks.files import Messages, RawPrompt

OVERLONG = ("filter", "truncate", "error")
_COUNT_BATCH = 1024  # prompts per tokenizer call: fast tokenizers spread a batch over threads
_NAMED_OVERLONG = 3  # overlong prompts an error names


def load_tokenizer(path: str, key: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of the model at `path`; `key` is the setting that needs it (for the error);
    `trust_remote_code`: the actor's (a tokenizer of the model's own code)."""
    try:
        # Importing the coordinator loads no model library (tests/coordinator/test_imports.py).
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{key}: needs the transformers package where the coordinator runs, to load "
                        f"the tokenizer of {path}") from None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure to load is the same problem for the user
        raise DataError(f"{key}: cannot load the tokenizer of {path} (the coordinator renders and counts "
                        f"prompts with the actor model's tokenizer): {e}") from None


@dataclass
class Rendered:
    records: list[PromptRecord]
    filtered: int = 0  # longer than the limit and dropped (data.overlong=filter, or no room to truncate)
    truncated: int = 0


class PromptRenderer:
    """Applies `data.chat_template` and `data.max_prompt_tokens` / `data.overlong` to records."""

    def __init__(self, tokenizer: Any, model: str, *, chat_template: bool, max_tokens: Optional[int] = None,
                 overlong: str = "filter", tools: Sequence[str] = ()):
        """`tools`: `data.tools` (built-in names, path/to/file.py:function of the user's), whose
        schemas go to the chat template as `tools=`; a template that ignores them gets them described
        in a system message instead."""
        if overlong not in OVERLONG:
            raise ValueError(f"unknown overlong policy {overlong!r}; valid: {', '.join(OVERLONG)}")
        if chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"data.chat_template: the tokenizer of {model} has no chat template; use a model "
                            "whose tokenizer defines one (an instruct or chat model), or set "
                            "data.chat_template=false and give plain text prompts")
        self.tokenizer, self.model = tokenizer, model
        self.chat_template, self.max_tokens, self.overlong = chat_template, max_tokens, overlong
        self._bos_to_strip = _bos_added_by(tokenizer) if chat_template else None
        self.tools = tool_schemas(tools)
        self._tools_in_template = bool(self.tools) and chat_template and template_shows_tools(tokenizer, self.tools)

    def render_all(self, prompts: list[RawPrompt]) -> Rendered:
        texts = [self.render(p.prompt, p.where) for p in prompts]
        if self.max_tokens is None:
            return Rendered([PromptRecord(t, p.ground_truth, p.extra, p.prompt) for t, p in zip(texts, prompts)])
        out, too_long = Rendered([]), []
        for p, text, n in zip(prompts, texts, self.count(texts)):
            if n > self.max_tokens:
                if self.overlong == "error":
                    too_long.append(f"{p.where} ({n} tokens)")
                    continue
                text = self.truncate(p, n) if self.overlong == "truncate" else None
                if text is None:
                    out.filtered += 1
                    continue
                out.truncated += 1
            out.records.append(PromptRecord(text, p.ground_truth, p.extra, p.prompt))
        if too_long:
            named = ", ".join(too_long[:_NAMED_OVERLONG]) + (", ..." if len(too_long) > _NAMED_OVERLONG else "")
            raise DataError(f"data.max_prompt_tokens: {len(too_long)} of {len(prompts)} prompts are longer than "
                            f"{self.max_tokens} tokens and data.overlong is error: {named}; raise the limit, or set "
                            "data.overlong to filter or truncate")
        return out

    def render(self, prompt: str | Messages, where: str, last_content: Optional[str] = None) -> str:
        """The text the actor receives; `last_content` replaces the last message's content (or the
        text of a plain prompt)."""
        if not self.chat_template:
            if not isinstance(prompt, str):
                raise DataError(f"data.chat_template: {where}: the prompt is a list of chat messages, which "
                                "needs the chat template, and data.chat_template is false")
            return prompt if last_content is None else last_content
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if last_content is not None:
            messages = [*messages[:-1], {**messages[-1], "content": last_content}]
        messages, tools = self.with_tools(messages)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **tools)
        except Exception as e:  # noqa: BLE001 - a template raises whatever its author chose
            raise DataError(f"data.chat_template: {where}: the chat template of {self.model} refused this "
                            f"prompt: {e}") from None
        if not isinstance(text, str):
            raise DataError(f"data.chat_template: the chat template of {self.model} gave a "
                            f"{type(text).__name__}, not text")
        if self._bos_to_strip and text.startswith(self._bos_to_strip):
            # The template writes the BOS token and the actor's tokenizer call adds one too: keep one.
            text = text[len(self._bos_to_strip):]
        return text

    def with_tools(self, messages: Messages) -> tuple[Messages, dict[str, Any]]:
        """`messages` and the chat template's keyword arguments with the run's tools (`data.tools`):
        `tools=` where the template renders them, else described in a system message."""
        if self._tools_in_template:
            return messages, {"tools": self.tools}
        if self.tools:
            return with_tools_described(messages, self.tools), {}
        return messages, {}

    def count(self, texts: list[str]) -> list[int]:
        """Tokens of each text as the actor's tokenizer call counts them (special tokens included)."""
        counts = []
        for start in range(0, len(texts), _COUNT_BATCH):
            counts += [len(ids) for ids in self.tokenizer(texts[start:start + _COUNT_BATCH])["input_ids"]]
        return counts

    def truncate(self, p: RawPrompt, tokens: int) -> Optional[str]:
        """The prompt cut from the left of its last message until it fits, or None when even an
        empty last message does not fit."""
        content = p.prompt if isinstance(p.prompt, str) else p.prompt[-1]["content"]
        drop = tokens - self.max_tokens
        while (rest := self._without_first_tokens(content, drop)) is not None:
            text = self.render(p.prompt, p.where, last_content=rest)
            tokens = self.count([text])[0]
            if tokens <= self.max_tokens:
                return text
            # Tokens merge differently at the new start, and the template adds its own: cut again.
            drop += tokens - self.max_tokens
        return None

    def _without_first_tokens(self, content: str, drop: int) -> Optional[str]:
        """`content` without its first `drop` tokens, or None when it has no more than that."""
        if self.tokenizer.is_fast:  # cut at a character offset: the kept text is the file's, unchanged
            starts = [s for s, _ in self.tokenizer(content, add_special_tokens=False,
                                                   return_offsets_mapping=True)["offset_mapping"]]
            return content[starts[drop]:] if drop < len(starts) else None
        ids = self.tokenizer(content, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(ids[drop:]) if drop < len(ids) else None


def tool_schemas(entries: Sequence[str], key: str = "data.tools") -> list[dict]:
    """The JSON schemas (chat-template `tools=` form) of `data.tools`: built-in tools by name, the
    user's from their functions (path/to/file.py:function). DataError naming the entry."""
    try:
        return _tool_schemas(list(entries), key)
    except ToolSchemaError as e:
        raise DataError(str(e)) from None


def with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The documented fallback for a chat template that ignores `tools=` (SmolLM2's, Llama 2's):
    the tools and the Hermes call format described in a system message (before the conversation,
    or prepended to its own system message)."""
    described = ("You can call these tools. To call one, answer with <tool_call>{\"name\": ..., \"arguments\": "
                 "{...}}</tool_call> and wait for its result.\nTools:\n"
                 + "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def template_shows_tools(tokenizer: Any, tools: list[dict]) -> bool:
    """Whether the chat template renders `tools=` (its text changes with them)."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        shown = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, tools=tools)
    except Exception:  # noqa: BLE001 - a template that refuses tools= does not show them
        return False
    return shown != plain


def _bos_added_by(tokenizer: Any) -> Optional[str]:
    """The BOS token's text when tokenizing a text adds it (as the actor's `tokenizer(prompt)`
    does), else None."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos:
        return None
    ids = tokenizer("a")["input_ids"]
    added = len(ids) > len(tokenizer("a", add_special_tokens=False)["input_ids"])
    return bos if added and ids[0] == tokenizer.bos_token_id else None
