"""Independent float64 reference implementations (plain Python loops over unpadded lists)."""

from __future__ import annotations

import math
import statistics


def scores_of(rewards: list[list[float]]) -> list[float]:
    return [sum(r) for r in rewards]


def groups_of(group_ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


def grpo(rewards, group_ids, norm_by_std=True, eps=1e-6):
    s = scores_of(rewards)
    adv = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        vals = [s[i] for i in members]
        mean = sum(vals) / len(vals)
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        for i in members:
            adv[i] = (s[i] - mean) / (std + eps) if norm_by_std else s[i] - mean
    return [[a] * len(r) for a, r in zip(adv, rewards)]


def rloo(rewards, group_ids):
    s = scores_of(rewards)
    adv = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        for i in members:
            others = [s[j] for j in members if j != i]
            adv[i] = s[i] - sum(others) / len(others) if others else 0.0
    return [[a] * len(r) for a, r in zip(adv, rewards)]


def discounted(rewards, gamma):
    out = []
    for r in rewards:
        g, row = 0.0, []
        for x in reversed(r):
            g = x + gamma * g
            row.append(g)
        out.append(row[::-1])
    return out


def whiten(rows):
    flat = [x for r in rows for x in r]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return [[(x - mean) / math.sqrt(std ** 2 + 1e-8) for x in r] for r in rows]


def aggregate(loss_rows, mode, norm_length=None):
    if mode == "token-mean":
        flat = [x for r in loss_rows for x in r]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in loss_rows) / len(loss_rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in loss_rows) / len(loss_rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in loss_rows) / (len(loss_rows) * norm_length)
    raise ValueError(mode)
