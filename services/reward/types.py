"""Domain types of the reward role (what its core and its clients share)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoreItem:
    prompt: str
    response: str
    ground_truth: str

    def size(self) -> int:
        return sum(len(t.encode("utf-8", errors="surrogatepass")) for t in (self.prompt, self.response,
                                                                            self.ground_truth))
