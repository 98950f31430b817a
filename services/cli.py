"""The `rolefleet` command. See README "How users drive it"."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from rolefleet.common.config import ROLES, ConfigError, load_config


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # transformers and grpc are chatty at INFO; their warnings still show.
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_up(args) -> int:
    from rolefleet.up import RoleFailed, up

    try:
        return up(load_config(args.config, args.overrides))
    except RoleFailed as e:
        print(f"rolefleet: {e}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    from rolefleet.serve import run

    return run(args.role, load_config(args.config, args.overrides), args.ready_file)


def cmd_train(args) -> int:
    from rolefleet.serve import run

    return run("coordinator", load_config(args.config, args.overrides))


def cmd_status(args) -> int:
    from rolefleet.coordinator.client import run_status
    from rolefleet.coordinator.state import RunState

    s = asyncio.run(run_status(args.address))
    print(f"run {s.run_name}: {RunState(s.state).name}, step {s.step}/{s.total_steps}, "
          f"policy version {s.policy_version}, last mean reward {s.last_reward_mean:.3f}"
          + (f", error: {s.error}" if s.error else ""))
    return 0


def cmd_tiny_model(args) -> int:
    from rolefleet.common.tiny_model import make_tiny_model

    path = make_tiny_model(args.out, task=args.task, warm_start_steps=args.warm_start_steps,
                           hidden=args.hidden, layers=args.layers, seed=args.seed)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolefleet", description="RL post-training on role servers.")
    parser.add_argument("--log-level", default="warning", help="python logging level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start every role locally as its own process, run, stop them all")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("serve", help="run one role server (what compose and Helm start)")
    p.add_argument("role", choices=ROLES)
    p.add_argument("--config", required=True)
    p.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("train", help="run the coordinator against role servers already running")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("status", help="show a running coordinator's run status")
    p.add_argument("--address", required=True, help="coordinator gRPC address (printed when the run starts)")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("tiny-model", help="build a tiny model + tokenizer directory offline")
    p.add_argument("out")
    p.add_argument("--task", default=None, help="built-in task for a supervised warm start")
    p.add_argument("--warm-start-steps", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"rolefleet: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
