"""`rolefleet up`, `serve` and `train`: a run's processes."""

from __future__ import annotations

import os
import sys

from rolefleet import serve, up
from rolefleet.app.placement import placed
from rolefleet.app.preflight import preflight
from rolefleet.common.config import RoleFleetConfig, load_config
from rolefleet.rpc.server import StartupError


def checked_config(args, command: str, roles: list[str] | None = None) -> RoleFleetConfig:
    """The config of `args`, validated and preflighted for `roles` (default: every role of the run)
    before anything starts, so a bad config never costs a model load."""
    cfg = load_config(args.config, args.overrides)
    preflight(cfg, roles or cfg.roles(), command=command)
    return cfg


def cmd_up(args) -> int:
    cfg = placed(load_config(args.config, args.overrides))  # devices: auto becomes this machine's map, said
    preflight(cfg, cfg.roles(), command="up")
    try:
        return up.up(cfg)
    except up.RoleFailed as e:
        print(f"rolefleet: {e}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    try:
        node = serve.node_rank_of(args.node_rank, dict(os.environ))
    except StartupError as exc:
        print(f"rolefleet: {exc}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    preflight(cfg, [args.role], command="serve", node=node)
    return serve.run(args.role, cfg, args.ready_file, node)


def cmd_train(args) -> int:
    cfg = checked_config(args, "train", ["coordinator"])
    return serve.run("coordinator", cfg)
