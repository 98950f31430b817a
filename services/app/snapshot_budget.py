"""Whether the run's per-step snapshots (`checkpoint.snapshot`) fit where `rolefleet up` runs them.

A snapshot holds each trainer's whole state (fp32 weights and AdamW moments: 12 bytes a trained
parameter) in memory, and each trainer keeps two (the newest complete one and the one it writes
next, `trainer/snapshot_file.py`): 24 bytes a parameter, ~168 GiB for a 7B policy trained in full.
Where that does not fit in the snapshot directory's filesystem (/dev/shm: half the machine's memory
by default) or beside the state the run offloads to host memory,
the run goes without snapshots, says so, and recovers a lost trainer from its checkpoints instead.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from rolefleet.app.memory import GIB, NEAR, host_capacity, node_host_bytes, plan, snapshot_bytes
from rolefleet.common.config import ConfigError, RoleFleetConfig


def free_bytes(path: Path) -> Optional[float]:
    """Free bytes of the filesystem `path` is (or would be) on: its nearest existing ancestor's."""
    for where in (path, *path.parents):
        if where.exists():
            return float(shutil.disk_usage(where).free)
    return None


def offloaded_bytes(cfg: RoleFleetConfig) -> float:
    """Host memory the run's offloading takes on this machine (0 with no GPU work planned)."""
    try:
        return node_host_bytes(plan(cfg)).get("", 0.0)
    except ConfigError:
        return 0.0


def snapshot_problem(cfg: RoleFleetConfig, host: Optional[float], free: Optional[float],
                     offloaded: float) -> Optional[str]:
    """Why the run's snapshots do not fit (None: they do, or cannot be sized here)."""
    need = snapshot_bytes(cfg)
    if need is None:
        return None
    over = []
    if free is not None and need > free:
        over.append(f"{cfg.checkpoint.snapshot.root(cfg.run)} has {free / GIB:.1f} GiB free")
    if host is not None and need + offloaded > NEAR * host:
        over.append(f"with the {offloaded / GIB:.1f} GiB of offloaded state over {NEAR:.0%} of this machine's {host / GIB:.1f} GiB")
    if not over:
        return None
    return (f"two snapshots of the trainers' state take {need / GIB:.1f} GiB ({'; '.join(over)}): a lost actor or "
            f"critic goes back to the newest checkpoint instead (checkpoint.every_minutes="
            f"{cfg.checkpoint.every_minutes:g}; checkpoint.every=N bounds the loss to N steps, at a save's cost each)")


def fitting_snapshots(cfg: RoleFleetConfig, host: Optional[float] = None, free: Optional[float] = None,
                      offloaded: Optional[float] = None) -> RoleFleetConfig:
    """`cfg`, with snapshots turned off (and said so, once) where they would not fit on this
    machine; `host`, `free`, `offloaded`: this machine's figures unless given."""
    snapshot = cfg.checkpoint.snapshot
    if not snapshot.enabled:
        return cfg
    problem = snapshot_problem(cfg, host_capacity() if host is None else host,
                               free_bytes(snapshot.root(cfg.run)) if free is None else free,
                               offloaded_bytes(cfg) if offloaded is None else offloaded)
    if problem is None:
        return cfg
    print(f"rolefleet: checkpoint.snapshot is off for this run: {problem}", flush=True)
    off = cfg.checkpoint.model_copy(update={"snapshot": snapshot.model_copy(update={"enabled": False})})
    return cfg.model_copy(update={"checkpoint": off})
