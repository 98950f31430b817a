"""The `rolefleet` command. See README "How users drive it"."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import yaml

from rolefleet import __version__
from rolefleet.app.preflight import preflight
from rolefleet.app.shapes import SHAPES
from rolefleet.common.config import ROLES, ConfigError, RoleFleetConfig, load_config, overridden
from rolefleet.tasks import TASKS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
CERTS_HELP = "a run over TLS: the directory `rolefleet certs` wrote (its CA and `client` certificate)"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # transformers and grpc are chatty at INFO; their warnings still show.
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def checked_config(args, command: str, roles: list[str] | None = None) -> RoleFleetConfig:
    """The config of `args`, validated and preflighted for `roles` (default: every role of the run)
    before anything starts, so a bad config never costs a model load."""
    cfg = load_config(args.config, args.overrides)
    preflight(cfg, roles or cfg.roles(), command=command)
    return cfg


def cmd_up(args) -> int:
    from rolefleet.app.placement import placed

    cfg = placed(load_config(args.config, args.overrides))  # devices: auto becomes this machine's map, said
    preflight(cfg, cfg.roles(), command="up")
    from rolefleet.up import RoleFailed, up

    try:
        return up(cfg)
    except RoleFailed as e:
        print(f"rolefleet: {e}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    import os

    from rolefleet.rpc.server import StartupError
    from rolefleet.serve import node_rank_of, run

    try:
        node = node_rank_of(args.node_rank, dict(os.environ))
    except StartupError as exc:
        print(f"rolefleet: {exc}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    preflight(cfg, [args.role], command="serve", node=node)
    return run(args.role, cfg, args.ready_file, node)


def cmd_train(args) -> int:
    cfg = checked_config(args, "train", ["coordinator"])
    from rolefleet.serve import run

    return run("coordinator", cfg)


def operator_security(args):
    """What the CLI presents to a run: the token of `--token-file`, else of the run `--run DIR`
    names (the one `rolefleet up` made there), else of ROLEFLEET_TOKEN; and with `--certs DIR` (what
    `rolefleet certs` wrote) TLS: the run's CA and the `client` certificate."""
    from rolefleet.common.config import SecuritySection, TlsSection
    from rolefleet.rpc.run_files import run_token_file
    from rolefleet.rpc.security import Security

    certs = args.certs
    tls = TlsSection(cert_file=f"{certs}/client.pem", key_file=f"{certs}/client-key.pem",
                     ca_file=f"{certs}/ca.pem") if certs else TlsSection()
    token_file = args.token_file or (args.run and run_token_file(Path(args.run)))
    return Security.of(SecuritySection(tls=tls, token_file=str(token_file) if token_file else None), "client")


def where_to_ask(args) -> None:
    """Without --address / --http, the coordinator of the run `--run DIR` names: its gRPC address
    (`status`) or its control plane (`scale`)."""
    from rolefleet.rpc.run_files import read_endpoints

    wants_grpc = hasattr(args, "address")
    if (wants_grpc and args.address) or args.http:
        return
    if not args.run:
        raise ValueError("say which run: --run DIR (its run.output_dir)"
                         + (", --address HOST:PORT" if wants_grpc else "") + " or --http URL")
    endpoints = read_endpoints(Path(args.run))
    if wants_grpc:
        args.address = endpoints["address"]
        return
    args.http = endpoints["http"]
    if not args.http:
        raise ValueError(f"the run in {args.run} has no HTTP control plane (coordinator.http_enabled=false)")


UNAUTHENTICATED_HINT = ("the run refuses calls without its token: `rolefleet up` made one in <run.output_dir>/token "
                        "(--run DIR presents it); or pass --token-file FILE, or set ROLEFLEET_TOKEN")


def _explained(error: Exception) -> str:
    """The error, and how to present the token when the run refused the call for want of it."""
    import urllib.error

    refused = (isinstance(error, urllib.error.HTTPError) and error.code == 401) or \
        str(error).startswith("UNAUTHENTICATED")
    return f"{error}; {UNAUTHENTICATED_HINT}" if refused else str(error)


def http_call(url: str, security, certs: str | None, body: dict | None = None):
    """GET `url` (POST `body` as JSON) with the operator's token and `--certs`; the JSON answer."""
    import json
    import ssl
    import urllib.request

    headers = {"Content-Type": "application/json"} if body is not None else {}
    if security.token:
        headers["Authorization"] = f"Bearer {security.token}"
    context = None
    if certs:
        context = ssl.create_default_context(cafile=f"{certs}/ca.pem")
        context.load_cert_chain(f"{certs}/client.pem", f"{certs}/client-key.pem")  # for mutual TLS
    request = urllib.request.Request(url, method="GET" if body is None else "POST", headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30, context=context) as reply:
        return json.load(reply)


def cmd_status(args) -> int:
    from rolefleet.common.errors import RoleFleetError
    from rolefleet.rpc.roles import use_security

    try:
        where_to_ask(args)
        security = operator_security(args)
        use_security(security)  # a run with a token or TLS answers only to calls that present them
        status, roles = (_http_status(args.http, security, args.certs) if args.http
                         else asyncio.run(_grpc_status(args.address)))
    except (RoleFleetError, OSError, ValueError) as e:  # no coordinator there (yet, or any more)
        print(f"rolefleet: no run status from {args.http or args.address or args.run}: {_explained(e)}",
              file=sys.stderr)
        return 1
    print(f"run {status['run_name']}: {status['state']}, step {status['step']}/{status['total_steps']}, "
          f"policy version {status['policy_version']}, last mean reward {status['last_reward_mean']:.3f}"
          + (f", error: {status['error']}" if status["error"] else ""))
    for r in roles:
        if r.get("workers") is None:
            print(f"  {r['role']:<7} {r['address']:<21} not answering ({r['error']})")
            continue
        gpus = "no GPU" if r["devices"] == "" else f"CUDA_VISIBLE_DEVICES={r['devices']}"
        print(f"  {r['role']:<7} {r['address']:<21} {gpus}, {r['workers']} worker{'s' if r['workers'] != 1 else ''}"
              + (f", version {r['model_version']}, last step {r['last_step']}" if r["role"] in ("actor", "critic") else "")
              + (f", rollout engine {r['engine']}" if r.get("engine") else "")
              + (f", broken: {r['broken']}" if r["broken"] else "")
              + (f", health {r['health']}" if r.get("health", "SERVING") != "SERVING" else ""))
    return 0


async def _grpc_status(address: str) -> tuple[dict, list[dict]]:
    from rolefleet.coordinator.client import run_status
    from rolefleet.coordinator.state import RunState

    s = await run_status(address)
    status = {"run_name": s.run_name, "state": RunState(s.state).name, "step": s.step, "total_steps": s.total_steps,
              "policy_version": s.policy_version, "last_reward_mean": s.last_reward_mean, "error": s.error}
    roles = []
    for view in s.roles:
        if view.HasField("status"):
            r = view.status
            roles.append({"role": r.role, "address": view.address, "devices": r.devices, "workers": r.workers,
                          "model_version": r.model_version, "last_step": r.last_step, "broken": r.broken,
                          "engine": r.engine})
        else:
            roles.append({"role": view.error.split(":", 1)[0], "address": view.address, "error": view.error})
    return status, roles


def _http_status(url: str, security, certs: str | None) -> tuple[dict, list[dict]]:
    """The same view from the HTTP control plane (`/v1/status`, `/v1/roles`)."""
    return tuple(http_call(url.rstrip("/") + path, security, certs) for path in ("/v1/status", "/v1/roles"))


def cmd_scale(args) -> int:
    """Add or remove a reward replica of a running run, through its HTTP control plane."""
    import json
    import urllib.error

    change, address = ("add", args.add) if args.add else ("remove", args.remove)
    try:
        where_to_ask(args)
        replicas = http_call(f"{args.http.rstrip('/')}/v1/reward/replicas/{change}", operator_security(args),
                             args.certs, {"address": address})["replicas"]
    except urllib.error.HTTPError as e:  # the control plane's JSON error says why
        reason = json.load(e).get("error", e.reason)
        print(f"rolefleet: {reason}" + (f"; {UNAUTHENTICATED_HINT}" if e.code == 401 else ""), file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"rolefleet: no answer from {args.http or args.run}: {e}", file=sys.stderr)
        return 1
    print(f"reward replicas in use: {', '.join(replicas)}")
    return 0


def cmd_deploy(args) -> int:
    """Deployment files from a run config's devices map (one source of truth with `up`)."""
    cfg = load_config(args.config, args.overrides)
    try:
        if args.target == "compose":
            from rolefleet.deploy.compose import render_compose

            sys.stdout.write(render_compose(cfg, args.config, args.overrides))
        else:
            from rolefleet.deploy.helm import render_values

            sys.stdout.write(render_values(cfg))
            if args.overrides:  # the chart reads the config from its values: this one, overrides applied
                text = yaml.safe_dump(overridden(args.config, args.overrides), sort_keys=False)
                sys.stdout.write("# The run config with the overrides applied (no --set-file config= needed).\n"
                                 "config: |\n" + "".join(f"  {line}\n" for line in text.splitlines()))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return 0


def cmd_plan(args) -> int:
    """Every GPU of the config's device map with what its roles will need; 1 if one will not fit."""
    from rolefleet.app.memory import GIB, describe, gpu_capacity, host_capacity, plan
    from rolefleet.app.placement import NothingFits, placed, visible_gpus

    cfg = load_config(args.config, args.overrides)
    if args.gpus is not None and not cfg.devices.auto:  # it would be ignored: the map names its own GPUs
        given = "cpu" if cfg.devices.is_cpu else "a map"
        raise ConfigError(f"plan --gpus: applies to devices: auto only (the map it chooses on N GPUs), and this "
                          f"config's devices is {given}, planned as it is: leave --gpus out (--gpu-gib still sets "
                          "the GPU size), or add devices=auto")
    capacity = args.gpu_gib * GIB if args.gpu_gib else gpu_capacity()
    if cfg.devices.auto:  # the map `up` would choose: on this machine's GPUs, or on --gpus of --gpu-gib
        gpus = [capacity] * args.gpus if args.gpus is not None else [capacity or g for g in visible_gpus()]
        try:
            cfg = placed(cfg, gpus, say=print)
        except NothingFits as e:  # the error points here for the itemized figures: the closest map's plan
            print("devices: auto: no map fits; the closest one tried:")
            print(describe(e.closest, e.plans, host_capacity()))
            print(f"rolefleet: {e}", file=sys.stderr)
            return 1
        if not gpus:
            print("(give --gpus N --gpu-gib G for the map devices: auto chooses on a machine of N such GPUs)")
    plans = plan(cfg, capacity)
    print(describe(cfg, plans, host_capacity()))
    if capacity is None and plans:
        print("(no GPU here to compare with: give --gpu-gib)")
    return 1 if any(g.verdict == "over" for g in plans) else 0


def cmd_env(args) -> int:
    """The report a bug needs (as `trl env`): every probe is guarded, so a broken install still exits 0."""
    from rolefleet.app.environment import as_json, as_text, report

    rows = report()
    print(as_json(rows) if args.json else as_text(rows))
    return 0


def cmd_data(args) -> int:
    from rolefleet.tasks.gsm8k_prep import prepare

    try:
        written = prepare(args.out, args.source, args.name, args.test_source)
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"data {args.dataset}: cannot write {args.out}: {e.strerror or e}") from None
    for w in written:
        print(f"{w.path}: {w.rows} rows ({w.source})")
    train, test = (w.path for w in written)
    print(f"train on them: rolefleet up configs/gsm8k.yaml data.path={train} eval.path={test}")
    return 0


def cmd_tiny_model(args) -> int:
    from rolefleet.app.tiny_model import make_tiny_model

    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)  # before the warm start, not after it
        path = make_tiny_model(args.out, task=args.task, warm_start_steps=args.warm_start_steps, shape=args.shape,
                               hidden=args.hidden, layers=args.layers, seed=args.seed)
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"tiny-model: cannot write {args.out}: {e.strerror or e}") from None
    print(path)
    return 0


def cmd_export(args) -> int:
    from rolefleet.export import ExportError, export_checkpoint

    try:
        path = export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype, args.base,
                                 Path(args.adapter_out) if args.adapter_out else None)
    except ExportError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unreadable checkpoint or an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"export: {e}") from None
    print(path)
    return 0


def cmd_import_gguf(args) -> int:
    from rolefleet.export import ExportError
    from rolefleet.gguf_import import import_gguf

    try:
        done = import_gguf(Path(args.file), Path(args.out), args.dtype)
    except ExportError as e:  # GgufImportError, and an OUT that must not be written
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"import-gguf: {e}") from None
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"{done.out}: {done.architecture}, {done.parameters / 1e6:.1f}M parameters, eos {done.eos_token!r}, "
          f"responses stop at ids {list(done.stop_ids)}", file=sys.stderr)
    print(done.out)
    return 0


def cmd_certs(args) -> int:
    from rolefleet.certs import CertsError, make_certs

    try:
        paths = make_certs(args.out, hosts=args.host, days=args.days, force=args.force)
    except CertsError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"certs: cannot write {args.out}: {e.strerror or e}") from None
    for path in paths:
        print(path)
    return 0


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
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("serve", help="run one role server (what compose and Helm start)")
    p.add_argument("role", choices=ROLES)
    p.add_argument("--config", required=True)
    p.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
    p.add_argument("--node-rank", type=int, metavar="K",
                   help="a role whose workers span nodes: start node K's ranks (1 .. nodes-1) and join the group at "
                   "its first node (<role>.rendezvous); 0, the default, is the role's server. Also "
                   "ROLEFLEET_NODE_RANK, or the ordinal ending ROLEFLEET_POD_NAME")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("train", help="run the coordinator against role servers already running")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("status", help="show a running coordinator's run status")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="coordinator gRPC address (printed when the run starts)")
    where.add_argument("--http", help="coordinator HTTP control plane URL, e.g. http://127.0.0.1:8080")
    _run_options(p)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("scale", help="add or remove a reward replica of a running run")
    p.add_argument("role", choices=["reward"])
    change = p.add_mutually_exclusive_group(required=True)
    change.add_argument("--add", metavar="HOST:PORT", help="a running reward server to give work to")
    change.add_argument("--remove", metavar="HOST:PORT", help="a replica to give no new work (its calls finish)")
    p.add_argument("--http", help="coordinator HTTP control plane URL, e.g. http://127.0.0.1:8080")
    _run_options(p)
    p.set_defaults(fn=cmd_scale)

    p = sub.add_parser("deploy", help="print deployment files generated from a config's devices map")
    p.add_argument("target", choices=["compose", "helm-values"],
                   help="compose: docker-compose.yml for one node; helm-values: the chart's values for the run (placement, "
                        "requests, runs volume, and each role's paths on the model and inputs volumes)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(fn=cmd_deploy)

    p = sub.add_parser("plan", help="the GPU memory each role of a config will need, and whether it fits")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--gpu-gib", type=float, default=None, help="memory of one GPU in GiB (default: this machine's)")
    p.add_argument("--gpus", type=_at_least(0), default=None, help="devices: auto: choose the map for this many "
                   "GPUs (default: this machine's)")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("env", help="this machine for a bug report: the stack's versions, GPUs and driver, NCCL, "
                       "flash kernels, and the rollout engine `actor.rollout.backend: auto` would pick")
    p.add_argument("--json", action="store_true", help="one JSON object of the same keys, for machines")
    p.set_defaults(fn=cmd_env)

    p = sub.add_parser("data", help="prepare a dataset's train and test splits as a shipped config reads them")
    p.add_argument("dataset", choices=["gsm8k"], help="gsm8k: train.parquet and test.parquet for configs/gsm8k.yaml")
    p.add_argument("out", help="the directory to write them into")
    p.add_argument("--source", default="openai/gsm8k", metavar="PATH_OR_ID",
                   help="a hub dataset id, read from the local cache or the hub (default openai/gsm8k), or a local "
                   "copy: a save_to_disk directory, or a JSONL, JSON or Parquet file of the training split")
    p.add_argument("--name", help="the hub dataset's configuration (default for openai/gsm8k: main)")
    p.add_argument("--test-source", metavar="PATH_OR_ID", help="the test split's own source, when --source has "
                   "none (a file, a saved Dataset)")
    p.set_defaults(fn=cmd_data)

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
    p.set_defaults(fn=cmd_tiny_model)

    p = sub.add_parser("export", help="write a checkpoint's actor as a Hugging Face model directory")
    p.add_argument("checkpoint", help="a run checkpoint (.../checkpoints/step-XXXXXXXX) or its actor/ directory")
    p.add_argument("out", help="the model directory to create (new, or empty)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="dtype of the written weights (default auto: the model config's, else float32)")
    p.add_argument("--base", help="a LoRA checkpoint's base model, instead of the one its hf/adapter_config.json "
                   "names (moved, say)")
    p.add_argument("--adapter-out", help="a LoRA checkpoint: also write peft's adapter directory here (new, or "
                   "empty)")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("import-gguf", help="write a GGUF checkpoint as a Hugging Face model directory")
    p.add_argument("file", help="the .gguf file (quantized tensors are dequantized)")
    p.add_argument("out", help="the model directory to create (new, or empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the written weights (default float32: the trainer's master weights)")
    p.set_defaults(fn=cmd_import_gguf)

    p = sub.add_parser("certs", help="make a development CA and a TLS certificate per role (and client)")
    p.add_argument("out", help="the directory to write ca.pem, N.pem and N-key.pem into (created 0700)")
    p.add_argument("--host", action="append", default=[], metavar="H",
                   help="another name or IP address in every certificate (repeatable; '*.' wildcards allowed)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="replace certificates and keys already in OUT")
    p.set_defaults(fn=cmd_certs)
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
        return args.fn(args)
    except ConfigError as e:
        print(f"rolefleet: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
