"""Prompt batches for the run: a built-in task or a prompt source (tasks/files.py), chat template and
token limit applied once at load, reshuffled every epoch, with a position a checkpoint saves and a
resume restores (docs/data.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from typing import TYPE_CHECKING, Any, Optional

from rolefleet.common.config import DataSection
from rolefleet.tasks import DataError, PromptRecord, make_task
from rolefleet.tasks.files import Columns, RawPrompt, read_prompts
from rolefleet.tasks.render import PromptRenderer, load_tokenizer

if TYPE_CHECKING:
    from rolefleet.common.config import RoleFleetConfig

log = logging.getLogger(__name__)

STATE_VERSION = 1
EVAL_SEED = 7_919  # the held-out draw of a built-in task: a stream apart from the training draw's
# The keys an eval file's problems are reported under (its errors are read_prompts' own, which name data.*).
_EVAL_KEYS = re.compile(r"\bdata\.(path|format|split|name|prompt_key|answer_key|extra_keys)\b")
_STATE_KEYS = ("version", "position", "epoch", "seed", "shuffle", "records", "fingerprint", "source")


class PromptDataset:
    """`batch(step, size)` is a pure function of (seed, step); `next_batch(size)` draws from
    `position` on and advances it. `stats` holds the load's counts (`data/records`,
    `data/filtered`, `data/truncated`) for the run's metrics."""

    def __init__(self, records: list[PromptRecord], seed: int, *, shuffle: bool = True,
                 stats: Optional[dict[str, int]] = None, source: str = "records"):
        if not records:
            raise ValueError("the dataset is empty")
        self.records, self.seed, self.shuffle, self.source = records, seed, shuffle, source
        self.stats = {"data/records": len(records), "data/filtered": 0, "data/truncated": 0, **(stats or {})}
        self.position = 0  # prompts consumed: what a checkpoint saves
        self.chat, self.tokenizer, self.renderer = False, None, None  # as `from_config` rendered the prompts
        self._orders: dict[int, list[int]] = {}
        self._fingerprint: Optional[str] = None

    @classmethod
    def for_run(cls, cfg: RoleFleetConfig) -> PromptDataset:
        """The run's dataset: prompts rendered with the actor model's tokenizer. With evaluation on
        a draw of the training task, the held-out prompts are left out of it."""
        held_out = None
        if cfg.eval.enabled and not cfg.data.path and cfg.eval_data().task == cfg.data.task:  # a draw of this task
            held_out = {r.prompt for r in cls.for_eval(cfg).records}
        return cls.from_config(cfg.data, cfg.run.seed, tokenizer_path=cfg.actor.model_name_or_path, exclude=held_out,
                               trust_remote_code=bool(cfg.actor.trust_remote_code))

    @classmethod
    def for_eval(cls, cfg: RoleFleetConfig) -> PromptDataset:
        """The held-out prompts of `eval.*` (at most `eval.max_prompts`, distinct), rendered as the
        training prompts are; a problem with them is a DataError naming the eval key."""
        d = cfg.eval_data()
        try:
            if d.task:  # a draw of its own seed, without repeats (a task may give a problem twice)
                records = make_task(d.task, 4 * cfg.eval.max_prompts, cfg.eval_seed * 1_000_003 + EVAL_SEED)
                unique = list({json.dumps(r.prompt, sort_keys=True): r for r in records}.values())
                dataset = cls.from_config(d, 0, cfg.actor.model_name_or_path, records=unique, source=f"eval.task {d.task}",
                                          trust_remote_code=bool(cfg.actor.trust_remote_code))
            else:
                dataset = cls.from_config(d, 0, cfg.actor.model_name_or_path, source=f"eval.path {d.path}",
                                          trust_remote_code=bool(cfg.actor.trust_remote_code))
        except DataError as e:
            raise DataError(_EVAL_KEYS.sub(r"eval.\1", str(e))) from None
        dataset.records = dataset.records[:cfg.eval.max_prompts]
        return dataset

    @classmethod
    def from_config(cls, cfg: DataSection, seed: int, tokenizer_path: Optional[str] = None, *,
                    exclude: Optional[set[str]] = None, records: Optional[list[PromptRecord]] = None,
                    source: Optional[str] = None, trust_remote_code: bool = False) -> PromptDataset:
        """`tokenizer_path`: the model whose tokenizer applies the chat template and counts prompt
        tokens; loaded only when `data.chat_template` or `data.max_prompt_tokens` needs it.
        `exclude`: rendered prompts left out (held out for evaluation), counted as `data/held_out`.
        `records`: the task's records when drawn by the caller."""
        if cfg.path:
            columns = Columns(cfg.prompt_key, cfg.answer_key, None if cfg.extra_keys is None else tuple(cfg.extra_keys))
            prompts = read_prompts(cfg.path, cfg.format, columns, split=cfg.split, name=cfg.name)
            source = source or cfg.path
        else:
            source = source or f"data.task {cfg.task}"
            records = records if records is not None else make_task(cfg.task, cfg.size, seed)
            prompts = [RawPrompt(f"{source} #{i}", r.prompt, r.ground_truth, r.extra) for i, r in enumerate(records)]
        # Chat messages mean a chat template unless told otherwise (and then they are refused).
        chat = cfg.chat_template if cfg.chat_template is not None else (any(p.is_chat for p in prompts)
                                                                         or bool(cfg.tools))
        tokenizer = None
        if chat or cfg.max_prompt_tokens is not None:
            key = "data.chat_template" if chat else "data.max_prompt_tokens"
            if tokenizer_path is None:
                raise DataError(f"{key}: needs the actor model's tokenizer, and no model was given")
            tokenizer = load_tokenizer(tokenizer_path, key, trust_remote_code)
        renderer = PromptRenderer(tokenizer, tokenizer_path or "", chat_template=chat,
                                  max_tokens=cfg.max_prompt_tokens, overlong=cfg.overlong, tools=cfg.tools)
        rendered = renderer.render_all(prompts)
        if not rendered.records:
            raise DataError(f"data.max_prompt_tokens: every one of the {len(prompts)} prompts of {source} is "
                            f"longer than {cfg.max_prompt_tokens} tokens (data.overlong={cfg.overlong})")
        kept = [r for r in rendered.records if not exclude or r.prompt not in exclude]
        if not kept:
            raise DataError(f"eval.max_prompts: every prompt of {source} is held out for evaluation; lower "
                            "eval.max_prompts or give eval.path")
        stats = {"data/filtered": rendered.filtered, "data/truncated": rendered.truncated}
        if exclude is not None:
            stats["data/held_out"] = len(rendered.records) - len(kept)
        dataset = cls(kept, seed, shuffle=cfg.shuffle, source=source, stats=stats)
        # What supervised examples are tokenized with (`tasks/supervised.py`).
        dataset.chat, dataset.tokenizer, dataset.renderer = chat, tokenizer, renderer
        dataset._log_load(cfg, chat)
        return dataset

    def narrow(self, kept: list[int], filtered: int = 0, truncated: int = 0) -> None:
        """Keep the records at `kept` alone (before any batch is drawn or position loaded): the
        records a later check dropped (`filtered`) or cut (`truncated`), counted with the load's."""
        if not kept:
            raise ValueError("the dataset is empty")
        self.records = [self.records[i] for i in kept]
        self._orders, self._fingerprint = {}, None
        self.stats["data/records"] = len(self.records)
        self.stats["data/filtered"] += filtered
        self.stats["data/truncated"] += truncated

    def _log_load(self, cfg: DataSection, chat: bool) -> None:
        s = self.stats
        cut = s["data/filtered"] + s["data/truncated"]
        # Dropped or cut prompts change what the run trains on: a warning, never silence.
        (log.warning if cut else log.info)(
            "data: %s: %d prompts%s; %d longer than %s tokens dropped, %d truncated (data.overlong=%s)",
            self.source, s["data/records"], " (chat template applied)" if chat else "", s["data/filtered"],
            cfg.max_prompt_tokens or "any", s["data/truncated"], cfg.overlong)

    # --- batches --------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.position // len(self.records)

    def batch(self, step: int, size: int) -> list[PromptRecord]:
        """The prompts of `step` (1-based): a pure function of (seed, step), so a resumed run sees
        the same prompts it would have seen. It leaves `position` alone."""
        return self._take((step - 1) * size, size)

    def next_batch(self, size: int) -> list[PromptRecord]:
        """The next `size` prompts from `position`, which moves past them."""
        records = self._take(self.position, size)
        self.position += size
        return records

    def _take(self, start: int, size: int) -> list[PromptRecord]:
        n = len(self.records)
        return [self.records[self._order(epoch)[index]] for epoch, index in (divmod(i, n) for i in range(start, start + size))]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # a batch spans at most two epochs; keep the newest
        return self._orders[epoch]

    # --- resume ---------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the records as the run sees them (rendered prompt, ground truth, extra)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for r in self.records:
                h.update(json.dumps([r.prompt, r.ground_truth, r.extra], sort_keys=True, default=str).encode())
                h.update(b"\n")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """The position as plain JSON values: what a checkpoint saves."""
        return {"version": STATE_VERSION, "position": self.position, "epoch": self.epoch, "seed": self.seed,
                "shuffle": self.shuffle, "records": len(self.records), "fingerprint": self.fingerprint,
                "source": self.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: the following batches are those the saved run would
        have drawn. A position saved on other records is refused."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing or state["version"] != STATE_VERSION:
            raise ValueError(f"not a data position of this version ({STATE_VERSION}): "
                             + (f"missing {', '.join(missing)}" if missing else f"version {state['version']}"))
        if state["records"] != len(self.records) or state["fingerprint"] != self.fingerprint:
            raise DataError(
                f"data.path: cannot resume: the saved data position was taken on other prompts ({state['source']}: "
                f"{state['records']} records, fingerprint {str(state['fingerprint'])[:12]}) than this run's "
                f"({self.source}: {len(self.records)} records, fingerprint {self.fingerprint[:12]}); the file or "
                "a data setting that changes the prompts (keys, chat template, token limit, model) changed since "
                "the checkpoint. Resume with the same data, or start a new run")
        position = state["position"]
        if not isinstance(position, int) or position < 0 or state["epoch"] != position // len(self.records):
            raise ValueError(f"the saved data position is inconsistent: position {position!r}, epoch "
                             f"{state['epoch']!r}, {len(self.records)} records")
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            # The saved order wins: the resumed run continues the epoch it was in, without repeats.
            log.warning("data: resuming with the saved order (seed %s, shuffle %s), not run.seed=%s / "
                        "data.shuffle=%s", state["seed"], state["shuffle"], self.seed, self.shuffle)
        self.seed, self.shuffle, self.position = state["seed"], state["shuffle"], position
        self._orders = {}
