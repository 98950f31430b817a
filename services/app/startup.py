"""How long `rolefleet up` gives a role to start serving (`run.startup_timeout_s`).

Unset, the limit grows with the weights the role loads, read from the models' config.json as the
memory planner reads them (`app/memory.py`; nothing is loaded): a 135M model starts in seconds, a 70B
one reads 140 GB of bf16 weights (twice, with its reference) before it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rolefleet.app.memory import ModelDims
from rolefleet.common.config import RoleFleetConfig

STARTUP_BASE_S = 300.0  # imports, worker processes and a small model's load, on a busy CI machine too
# Reading and placing weights: 200 MB/s, a network volume's pace, with room for vLLM's warm-up.
STARTUP_S_PER_GB = 5.0


@dataclass(frozen=True)
class StartupLimit:
    seconds: float
    why: str  # where the figure comes from, for the error that names it


def default_startup_timeout_s(weight_bytes: float) -> float:
    """The limit for a role that loads `weight_bytes` of model weights."""
    return STARTUP_BASE_S + STARTUP_S_PER_GB * weight_bytes / 1e9


def role_weight_bytes(cfg: RoleFleetConfig, role: str) -> Optional[float]:
    """Bytes of the models `role` loads, as their checkpoints store them (their configs' dtype): the
    actor's policy and its reference (unless the reference is the policy with its adapters off),
    the critic's value model, the reward's models; None when a model's config.json cannot be read
    here (a hub id not yet downloaded)."""
    def stored(path: str, scorer: bool = False) -> float:
        dims = ModelDims.read(path)
        return float(dims.stored_bytes * (dims.scorer_params if scorer else dims.params))

    try:
        if role == "actor":
            weights = stored(cfg.actor.model_name_or_path)
            if cfg.actor.holds_reference:
                weights += stored(cfg.actor.ref_model_name_or_path)
        elif role == "critic":
            weights = stored(cfg.critic.model_name_or_path)
        elif role == "reward":
            weights = sum(stored(s.path, scorer=True) for s in cfg.reward.scoring_sources() if s.kind == "model")
        else:
            weights = 0.0
    except (OSError, ValueError):  # ConfigError: no config.json, or one without the dimensions
        return None
    return weights


def startup_limit(cfg: RoleFleetConfig, role: str) -> StartupLimit:
    """The seconds `role` has from its start to its ready file, and why that many."""
    if cfg.run.startup_timeout_s is not None:
        return StartupLimit(cfg.run.startup_timeout_s, "run.startup_timeout_s, set in the config")
    weights = role_weight_bytes(cfg, role)
    seconds = default_startup_timeout_s(weights or 0.0)
    of = ("its models' size not known here (a hub model still to download: the download counts too)"
          if weights is None else f"{weights / 1e9:.1f} GB of model weights")
    return StartupLimit(seconds, f"run.startup_timeout_s unset: {STARTUP_BASE_S:.0f} s + "
                                 f"{STARTUP_S_PER_GB:.0f} s a GB, for {of}")
