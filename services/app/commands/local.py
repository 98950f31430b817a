"""`rolefleet deploy`, `plan`, `env` and `data`: files and reports made on this machine, with no model
loaded."""

from __future__ import annotations

import sys

import yaml

from rolefleet.app import environment, memory, placement
from rolefleet.common.config import ConfigError, load_config, overridden
from rolefleet.deploy.compose import render_compose
from rolefleet.deploy.helm import render_values
from rolefleet.tasks.gsm8k_prep import prepare


def cmd_deploy(args) -> int:
    """Deployment files from a run config's devices map (one source of truth with `up`)."""
    cfg = load_config(args.config, args.overrides)
    try:
        if args.target == "compose":
            sys.stdout.write(render_compose(cfg, args.config, args.overrides))
        else:
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
    cfg = load_config(args.config, args.overrides)
    if args.gpus is not None and not cfg.devices.auto:  # it would be ignored: the map names its own GPUs
        given = "cpu" if cfg.devices.is_cpu else "a map"
        raise ConfigError(f"plan --gpus: applies to devices: auto only (the map it chooses on N GPUs), and this "
                          f"config's devices is {given}, planned as it is: leave --gpus out (--gpu-gib still sets "
                          "the GPU size), or add devices=auto")
    capacity = args.gpu_gib * memory.GIB if args.gpu_gib else memory.gpu_capacity()
    if cfg.devices.auto:  # the map `up` would choose: on this machine's GPUs, or on --gpus of --gpu-gib
        gpus = [capacity] * args.gpus if args.gpus is not None else [capacity or g for g in placement.visible_gpus()]
        try:
            cfg = placement.placed(cfg, gpus, say=print)
        except placement.NothingFits as e:  # the error points here for the itemized figures: the closest map's plan
            print("devices: auto: no map fits; the closest one tried:")
            print(memory.describe(e.closest, e.plans, memory.host_capacity()))
            print(f"rolefleet: {e}", file=sys.stderr)
            return 1
        if not gpus:
            print("(give --gpus N --gpu-gib G for the map devices: auto chooses on a machine of N such GPUs)")
    plans = memory.plan(cfg, capacity)
    print(memory.describe(cfg, plans, memory.host_capacity()))
    if capacity is None and plans:
        print("(no GPU here to compare with: give --gpu-gib)")
    return 1 if any(g.verdict == "over" for g in plans) else 0


def cmd_env(args) -> int:
    """The report a bug needs: every probe is guarded, so a broken install still exits 0."""
    rows = environment.report()
    print(environment.as_json(rows) if args.json else environment.as_text(rows))
    return 0


def cmd_data(args) -> int:
    try:
        written = prepare(args.out, args.source, args.name, args.test_source)
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"data {args.dataset}: cannot write {args.out}: {e.strerror or e}") from None
    for w in written:
        print(f"{w.path}: {w.rows} rows ({w.source})")
    train, test = (w.path for w in written)
    print(f"train on them: rolefleet up configs/gsm8k.yaml data.path={train} eval.path={test}")
    return 0
