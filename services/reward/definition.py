"""The reward's version: a digest of what it scores with, so that a run can say per step which
reward definition scored it (a rolling update swaps replicas of one definition for another's).

It covers the reward section as configured (sources, weights, options, limits) and the bytes of the
user code it names (`kind: user` sources, `reward.env.path`, the user tools the `tools` environment
runs): editing a reward function's file gives a new version even under the same config. A reward
model counts by its path, not its weights (hashing gigabytes at every start would cost more than it
tells).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rolefleet.common.config import RewardSection

DIGEST_CHARS = 12


def definition_digest(cfg: RewardSection) -> str:
    h = hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode())
    files = [s.path for s in cfg.scoring_sources() if s.kind == "user" and s.path]
    files += [cfg.env.path] if cfg.env.path else []
    files += list(cfg.env.user_tools) if cfg.env.name == "tools" else []
    for spec in files:
        file = Path(str(spec).rpartition(":")[0])
        h.update(str(file).encode())
        try:
            h.update(file.read_bytes())
        except OSError:  # the source's own load says what is wrong with it
            h.update(b"unreadable")
    return h.hexdigest()[:DIGEST_CHARS]
