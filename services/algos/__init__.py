"""RL maths as pure tensor functions, looked up by name from the config.

Tensors and scalars in, tensors out; shapes in docstrings; masks honoured; no config objects and no
`.item()` (callers decide when to sync). Layout: right-padded [B, T] tensors with a 0/1 `mask`.

The names below load with the module that defines them, when first asked for (PEP 562): importing
the package, or its torch-free `presets` and `registry`, loads no torch, so the config (which names
these registries in its validators) and the commands that only read a config stay quick to import.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ADVANTAGE_ESTIMATORS": "advantages", "discounted_returns": "advantages",
    "LOSS_AGGREGATIONS": "aggregation", "aggregate": "aggregation", "aggregation_weight": "aggregation",
    "pass_at_k": "evaluation",
    "IS_CORRECTIONS": "is_correction", "logprob_mismatch": "is_correction",
    "KL_CONTROLLERS": "kl", "KL_ESTIMATORS": "kl", "TEACHER_KL": "kl",
    "OVERLONG": "long_tail", "informative_groups": "long_tail",
    "POLICY_LOSSES": "losses", "VALUE_LOSSES": "losses", "entropy_from_logits": "losses",
    "Registry": "registry",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # asked once: later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
