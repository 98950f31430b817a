"""Domain types of the reward role (what its core and its clients share)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ScoreItem:
    prompt: str
    response: str
    ground_truth: str
    extra: dict[str, Any] = field(default_factory=dict)  # extra dataset columns, JSON values

    def size(self) -> int:
        texts = (self.prompt, self.response, self.ground_truth, self.extra_json())
        return sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)

    def extra_json(self) -> str:
        """`extra` as it travels (ScoreItem.extra_json): "" when empty."""
        return json.dumps(self.extra, ensure_ascii=False) if self.extra else ""


@dataclass
class ScoreResult:
    """What one Score call returns for n items.

    total:   float32 [n], sum over the sources of weight x score, where a source that failed on a
             sample counts `reward.fallback_score` as its score.
    sources: each source's raw score (before its weight), float32 [n], NaN where it failed; in the
             order of `reward.sources`.
    errors:  per sample, "" or one line naming each source that failed on it and why.
    """

    total: torch.Tensor
    sources: dict[str, torch.Tensor]
    errors: list[str]

    def check(self, n: int) -> ScoreResult:
        """Raise ValueError unless every part describes exactly `n` samples as float32 vectors."""
        parts = {"total": self.total, **{f"sources[{name!r}]": s for name, s in self.sources.items()}}
        for name, tensor in parts.items():
            if tensor.dtype != torch.float32 or tensor.shape != (n,):
                raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, expected float32 ({n},)")
        if len(self.errors) != n:
            raise ValueError(f"{len(self.errors)} error entries for {n} items")
        return self

    @property
    def failed(self) -> int:
        """Samples on which at least one source failed."""
        return sum(1 for e in self.errors if e)

    def select(self, index: list[int]) -> ScoreResult:
        """The results of the items at `index`, in that order."""
        rows = torch.as_tensor(index, dtype=torch.int64)
        return ScoreResult(self.total[rows], {name: s[rows] for name, s in self.sources.items()},
                           [self.errors[i] for i in index])

    @classmethod
    def concat(cls, parts: list[ScoreResult]) -> ScoreResult:
        """The results of consecutive slices of one batch as one result, in item order; a source
        missing from a part is NaN there (as for a failed source)."""
        names = list(dict.fromkeys(name for p in parts for name in p.sources))
        nan = float("nan")
        sources = {name: torch.cat([p.sources.get(name, torch.full_like(p.total, nan)) for p in parts])
                   for name in names}
        return cls(torch.cat([p.total for p in parts]), sources, [e for p in parts for e in p.errors])

    def source_means(self) -> dict[str, float]:
        """Each source's mean over the samples it scored; a source that scored none is left out."""
        return {name: s.nanmean().item() for name, s in self.sources.items() if not s.isnan().all()}


@dataclass(frozen=True)
class EnvItem:
    """One conversation whose last assistant turn the environment answers (`messages`: after the
    prompt, the assistant turns and the observations between them, as {role, content} dicts)."""

    prompt: str
    ground_truth: str
    messages: list[dict[str, str]]
    extra: dict[str, Any] = field(default_factory=dict)

    def size(self) -> int:
        texts = (self.prompt, self.ground_truth, ScoreItem("", "", "", self.extra).extra_json(),
                 *(m["content"] for m in self.messages))
        return sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)


@dataclass(frozen=True)
class EnvOutcome:
    """The environment's answer to one conversation's turn. `error`: the environment itself failed
    on it (raised, timed out, ran out of memory, answered malformed): the episode ends there."""

    observation: list[dict[str, str]]
    done: bool
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    error: str = ""


@dataclass(frozen=True)
class AgentItem:
    """One agent-driven episode: its session of the actor's endpoint and its record."""

    base_url: str                       # the session's OpenAI base URL (.../sessions/<id>/v1)
    key: str                            # the session's bearer secret
    prompt: Any                         # the prompt as the dataset gave it: text, or chat messages
    ground_truth: str
    extra: dict[str, Any] = field(default_factory=dict)

    def size(self) -> int:
        texts = (json.dumps(self.prompt), self.ground_truth, ScoreItem("", "", "", self.extra).extra_json())
        return sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)


@dataclass(frozen=True)
class AgentOutcome:
    """An episode's reward, or why the agent failed on it (`error`; the reward is then 0)."""

    reward: float = 0.0
    error: str = ""

