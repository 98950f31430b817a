"""The `rolefleet` command. See README "How users drive it"."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from collections.abc import Callable

from rolefleet import __version__
from rolefleet.app.shapes import SHAPES
from rolefleet.common.config import ROLES, ConfigError
from rolefleet.tasks import TASKS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
CERTS_HELP = "a run over TLS: the directory `rolefleet certs` wrote (its CA and `client` certificate)"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # transformers and grpc are chatty at INFO; their warnings still show.
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# Each command's work, as "module:function", imported when that command runs: `rolefleet --help` and an
# argument error load none of it, and a command loads only its own (`certs` no model library).
COMMANDS = {
    "up": "rolefleet.app.commands.run:cmd_up",
    "serve": "rolefleet.app.commands.run:cmd_serve",
    "train": "rolefleet.app.commands.run:cmd_train",
    "status": "rolefleet.app.commands.remote:cmd_status",
    "scale": "rolefleet.app.commands.remote:cmd_scale",
    "deploy": "rolefleet.app.commands.local:cmd_deploy",
    "plan": "rolefleet.app.commands.local:cmd_plan",
    "env": "rolefleet.app.commands.local:cmd_env",
    "data": "rolefleet.app.commands.local:cmd_data",
    "certs": "rolefleet.app.commands.certs:cmd_certs",
    "tiny-model": "rolefleet.app.commands.models:cmd_tiny_model",
    "export": "rolefleet.app.commands.models:cmd_export",
    "import-gguf": "rolefleet.app.commands.models:cmd_import_gguf",
}


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that does command `name`'s work (its module imported now)."""
    module, function = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), function)


def _at_least(low: int, multiple_of: int = 1):
    """An argparse type: an int >= low (and a multiple of `multiple_of`), else a usage error (exit 2)
    instead of a traceback from the model builder later."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or value % multiple_of:
            extra = f" and a multiple of {multiple_of}" if multiple_of > 1 else ""
            raise argparse.ArgumentTypeError(f"must be >= {low}{extra}, got {value}")
        return value

    return parse


def _run_options(p: argparse.ArgumentParser) -> None:
    """How `status` and `scale` find a run and present what it demands."""
    p.add_argument("--run", metavar="DIR", help="the run's run.output_dir (runs/NAME): its coordinator's "
                   "address when none is given, and the token `rolefleet up` made there")
    p.add_argument("--token-file", metavar="FILE", help="a file whose first line is the run's token")
    p.add_argument("--certs", metavar="DIR", help=CERTS_HELP)


def build_parser() -> argparse.ArgumentParser:
    # Long by nature: every command and its flags, declared in one place so `--help` and this read
    # the same; each command's work is in a function of its own.
    parser = argparse.ArgumentParser(prog="rolefleet", description="RL post-training on role servers.")
    parser.add_argument("--log-level", default="warning", type=str.lower, choices=LOG_LEVELS,
                        help="python logging level (default: warning)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start every role locally as its own process, run, stop them all")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")

    p = sub.add_parser("serve", help="run one role server (what compose and Helm start)")
    p.add_argument("role", choices=ROLES)
    p.add_argument("--config", required=True)
    p.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
    p.add_argument("--node-rank", type=int, metavar="K",
                   help="a role whose workers span nodes: start node K's ranks (1 .. nodes-1) and join the group at "
                   "its first node (<role>.rendezvous); 0, the default, is the role's server. Also "
                   "ROLEFLEET_NODE_RANK, or the ordinal ending ROLEFLEET_POD_NAME")
    p.add_argument("overrides", nargs="*", metavar="key=value")

    p = sub.add_parser("train", help="run the coordinator against role servers already running")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")

    p = sub.add_parser("status", help="show a running coordinator's run status")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="coordinator gRPC address (printed when the run starts)")
    where.add_argument("--http", help="coordinator HTTP control plane URL, e.g. http://127.0.0.1:8080")
    _run_options(p)

    p = sub.add_parser("scale", help="add or remove a reward replica of a running run")
    p.add_argument("role", choices=["reward"])
    change = p.add_mutually_exclusive_group(required=True)
    change.add_argument("--add", metavar="HOST:PORT", help="a running reward server to give work to")
    change.add_argument("--remove", metavar="HOST:PORT", help="a replica to give no new work (its calls finish)")
    p.add_argument("--http", help="coordinator HTTP control plane URL, e.g. http://127.0.0.1:8080")
    _run_options(p)

    p = sub.add_parser("deploy", help="print deployment files generated from a config's devices map")
    p.add_argument("target", choices=["compose", "helm-values"],
                   help="compose: docker-compose.yml for one node; helm-values: the chart's values for the run (placement, "
                        "requests, runs volume, and each role's paths on the model and inputs volumes)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")

    p = sub.add_parser("plan", help="the GPU memory each role of a config will need, and whether it fits")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--gpu-gib", type=float, default=None, help="memory of one GPU in GiB (default: this machine's)")
    p.add_argument("--gpus", type=_at_least(0), default=None, help="devices: auto: choose the map for this many "
                   "GPUs (default: this machine's)")

    p = sub.add_parser("env", help="this machine for a bug report: the stack's versions, GPUs and driver, NCCL, "
                       "flash kernels, and the rollout engine `actor.rollout.backend: auto` would pick")
    p.add_argument("--json", action="store_true", help="one JSON object of the same keys, for machines")

    p = sub.add_parser("data", help="prepare a dataset's train and test splits as a shipped config reads them")
    p.add_argument("dataset", choices=["gsm8k"], help="gsm8k: train.parquet and test.parquet for configs/gsm8k.yaml")
    p.add_argument("out", help="the directory to write them into")
    p.add_argument("--source", default="openai/gsm8k", metavar="PATH_OR_ID",
                   help="a hub dataset id, read from the local cache or the hub (default openai/gsm8k), or a local "
                   "copy: a save_to_disk directory, or a JSONL, JSON or Parquet file of the training split")
    p.add_argument("--name", help="the hub dataset's configuration (default for openai/gsm8k: main)")
    p.add_argument("--test-source", metavar="PATH_OR_ID", help="the test split's own source, when --source has "
                   "none (a file, a saved Dataset)")

    p = sub.add_parser("tiny-model", help="build a tiny model + tokenizer directory offline")
    p.add_argument("out")
    p.add_argument("--task", default=None, choices=sorted(TASKS), help="built-in task for a supervised warm start")
    p.add_argument("--warm-start-steps", type=_at_least(0), default=0)
    p.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="model dimensions: tiny (default) or a real model's, with random weights")
    p.add_argument("--hidden", type=_at_least(8, multiple_of=4), default=None,
                   help="tiny shape's hidden size (default 64): >= 8 and a multiple of the 4 attention heads")
    p.add_argument("--layers", type=_at_least(1), default=None, help="layers (default: the shape's)")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("export", help="write a checkpoint's actor as a Hugging Face model directory")
    p.add_argument("checkpoint", help="a run checkpoint (.../checkpoints/step-XXXXXXXX) or its actor/ directory")
    p.add_argument("out", help="the model directory to create (new, or empty)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="dtype of the written weights (default auto: the model config's, else float32)")
    p.add_argument("--base", help="a LoRA checkpoint's base model, instead of the one its hf/adapter_config.json "
                   "names (moved, say)")
    p.add_argument("--adapter-out", help="a LoRA checkpoint: also write peft's adapter directory here (new, or "
                   "empty)")

    p = sub.add_parser("import-gguf", help="write a GGUF checkpoint as a Hugging Face model directory")
    p.add_argument("file", help="the .gguf file (quantized tensors are dequantized)")
    p.add_argument("out", help="the model directory to create (new, or empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the written weights (default float32: the trainer's master weights)")

    p = sub.add_parser("certs", help="make a development CA and a TLS certificate per role (and client)")
    p.add_argument("out", help="the directory to write ca.pem, N.pem and N-key.pem into (created 0700)")
    p.add_argument("--host", action="append", default=[], metavar="H",
                   help="another name or IP address in every certificate (repeatable; '*.' wildcards allowed)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="replace certificates and keys already in OUT")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Overrides may come anywhere after the subcommand: argparse hands the positional `overrides`
    an empty list as soon as an option follows the first positional (`serve actor --config C k=v`),
    so the `key=value` words it leaves over are overrides too; any other leftover is an error."""
    parser = build_parser()
    args, leftover = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    stray = [a for a in leftover if not (takes_overrides and _is_override(a))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if leftover:
        args.overrides = [*args.overrides, *leftover]
    return args


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return command(args.command)(args)
    except ConfigError as e:
        print(f"rolefleet: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = main()
    # The process ends here (`up` starts every role this way): the interpreter's last garbage
    # collection would walk every object the imports made (torch, transformers: about 400k) for
    # most of a second, to free what the ending process frees anyway. Only __main__: tests call
    # main() in their own process, which goes on.
    gc.freeze()
    sys.exit(code)
