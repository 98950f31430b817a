"""`devices: auto`: the devices map `rolefleet up` (and `rolefleet plan`) chooses from the config and
the GPUs of the machine, so that a config without a map trains on the GPUs that are there instead of
on the CPU beside them.

`choose_devices(cfg, gpus)` is a pure function of the config and each GPU's memory. Only roles with
GPU work get GPUs (DESIGN, "Deploy"): the actor, the critic when the algorithm has one, the reward
role for a reward model (`kind: model`; functions run on the CPU); never the coordinator. On one
GPU they all share it. On several, the roles get GPUs of their own while the actor keeps most: a
reward model one, the critic a quarter of the rest (one at least), the actor what is left, training
and generating on each of them (with `actor.rollout.backend: vllm` or engines over several GPUs, the
first half of them generate and the rest train: vLLM runs apart from the trainer; an actor with no
GPU left to train beside its engines is refused). Where that does not fit by the memory planner's
estimate (`app/memory.py`), or there are too few GPUs, the roles spread over every GPU together.
When nothing fits, the choice fails with the planner's figures and the closest map it tried
(`NothingFits`, which `rolefleet plan` itemizes) rather than go to the CPU. No GPU: the CPU. A CPU
worker group over nodes (`<role>.nodes`, `actor.rollout.workers`) is a CPU setting the config asks
for: the CPU too.

GPUs of different sizes are planned as the smallest of them. The chosen map is written into the
run's saved config, so restarts and `serve` read that map, not the word.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import yaml

from rolefleet.app.memory import GIB, GpuPlan, plan, settings_that_help
from rolefleet.common.config import ConfigError, DevicesSection, RoleFleetConfig


@dataclass(frozen=True)
class Placement:
    devices: DevicesSection
    gpus: int  # GPUs the choice was made for
    capacity: Optional[float]  # bytes of the smallest of them; None: not known
    why: str  # what the choice rests on, for the line that announces it
    plans: list[GpuPlan] = field(default_factory=list)  # the planner's view of the map; [] on the CPU


class NothingFits(ConfigError):
    """No map of `devices: auto` fits: the planner's figures in the message, and the map that came
    closest (`closest`, the config with that map, and its `plans`) for `rolefleet plan` to itemize."""

    def __init__(self, message: str, closest: RoleFleetConfig, plans: list[GpuPlan]):
        super().__init__(message)
        self.closest = closest
        self.plans = plans


def gpu_roles(cfg: RoleFleetConfig) -> list[str]:
    """The run's roles that have GPU work, in the order they are given GPUs."""
    reward_model = any(s.kind == "model" for s in cfg.reward.scoring_sources())
    return ["actor", *(["critic"] if cfg.preset.uses_critic else []), *(["reward"] if reward_model else [])]


def choose_devices(cfg: RoleFleetConfig, gpus: Sequence[Optional[float]]) -> Placement:
    """The devices map for `cfg` on GPUs of `gpus` bytes each (None: not known; [] no GPU). Raises
    NothingFits, with the planner's figures and the closest map, when no map fits; ConfigError when
    the actor's GPUs are too few for its rollout engines."""
    if not gpus:
        return Placement(DevicesSection.of("cpu"), 0, None, "no CUDA GPU here")
    if (reason := cpu_group_setting(cfg)) is not None:
        return Placement(DevicesSection.of("cpu"), len(gpus), None, f"{reason} asks for a CPU worker group")
    known = [g for g in gpus if g is not None]
    capacity = min(known) if len(known) == len(gpus) else None
    tried: list[tuple[str, RoleFleetConfig, list[GpuPlan]]] = []
    for name, devices in candidates(cfg, len(gpus)):
        trial = cfg.model_copy(update={"devices": devices})
        try:
            plans = plan(trial, capacity)
        except ConfigError as exc:  # a model's config.json unreadable here: preflight names it
            return Placement(devices, len(gpus), capacity, f"memory not estimated: {exc}")
        if not any(g.verdict == "over" for g in plans):
            return Placement(devices, len(gpus), capacity, _fit(plans, name), plans)
        tried.append((name, trial, plans))
    name, trial, plans = min(tried, key=lambda t: max(g.total for g in t[2]))
    raise NothingFits(nothing_fits(cfg, len(gpus), capacity, name, trial, plans), trial, plans)


def cpu_group_setting(cfg: RoleFleetConfig) -> Optional[str]:
    """The setting that lays a role out as a CPU worker group (over nodes, or split by workers),
    which a devices map would contradict; None if there is none."""
    for key, value in (("actor.nodes", cfg.actor.nodes), ("critic.nodes", cfg.critic.nodes)):
        if value is not None and value > 1 and (key == "actor.nodes" or cfg.preset.uses_critic):
            return f"{key}={value}"
    if cfg.actor.rollout.workers is not None:
        return f"actor.rollout.workers={cfg.actor.rollout.workers}"
    return None


def candidates(cfg: RoleFleetConfig, n: int) -> list[tuple[str, DevicesSection]]:
    """The maps worth trying on `n` GPUs, best first: roles on GPUs of their own where there are
    enough, then every role over all of them."""
    roles = gpu_roles(cfg)
    out = [("apart", _apart(cfg, roles, n))] if n > 1 and len(roles) > 1 else []
    out.append(("together" if len(roles) > 1 else "alone", _together(cfg, roles, n)))
    kept = [(name, d) for name, d in out if engines_problem(cfg, len(d.actor)) is None]
    if not kept:  # the last map gives the actor the most GPUs: name its count
        raise ConfigError(engines_problem(cfg, len(out[-1][1].actor)))
    return kept


def engines_problem(cfg: RoleFleetConfig, gpus: int) -> Optional[str]:
    """Why an actor of `gpus` GPUs cannot run its vLLM engines of several GPUs, or None. They generate
    apart from training, so at least one GPU must be left to train: on fewer, the actor's GPUs would
    all train and generate, which `backend_problem` (actor/rollout.py) refuses for vLLM."""
    size = cfg.actor.rollout.vllm.tensor_parallel_size
    if size == 1 or gpus > size:
        return None
    workers = " (actor.workers sets its GPU count)" if cfg.actor.workers else ""
    return (f"devices: auto: vLLM with actor.rollout.vllm.tensor_parallel_size={size} needs {size + 1} GPUs for "
            f"the actor in this layout ({size} to generate apart from training, one at least to train), and it has "
            f"{gpus} here{workers}: lower tensor_parallel_size, set actor.rollout.backend=hf with "
            "tensor_parallel_size=1, or set devices to a map of your own")


def _apart(cfg: RoleFleetConfig, roles: list[str], n: int) -> DevicesSection:
    critic = "critic" in roles
    reward_own = "reward" in roles and n >= 2 + critic
    trainers = n - reward_own  # GPUs for the actor and the critic
    critic_n = min(cfg.critic.workers or max(1, trainers // 4), trainers - 1) if critic else 0
    actor_n = min(cfg.actor.workers or trainers - critic_n, trainers - critic_n)
    groups = {"actor": list(range(actor_n)), "critic": list(range(trainers - critic_n, trainers))}
    if "reward" in roles:  # a GPU of its own, else beside the trainer on the last GPU
        groups["reward"] = [n - 1]
    colocate = [] if reward_own or "reward" not in roles else [["critic" if critic else "actor", "reward"]]
    return _section(cfg, roles, groups, colocate)


def _together(cfg: RoleFleetConfig, roles: list[str], n: int) -> DevicesSection:
    groups = {"actor": list(range(min(n, cfg.actor.workers or n))),
              "critic": list(range(min(n, cfg.critic.workers or n))), "reward": [n - 1]}
    return _section(cfg, roles, groups, [roles] if len(roles) > 1 else [])


def _section(cfg: RoleFleetConfig, roles: list[str], groups: dict[str, list[int]], colocate) -> DevicesSection:
    actor = groups["actor"]
    return DevicesSection.of({**{role: groups[role] for role in roles}, "rollout": _rollout(cfg, actor),
                              "colocate": colocate})


def _rollout(cfg: RoleFleetConfig, actor: list[int]) -> list[int]:
    """The actor's generating GPUs: all of them, or the first half where vLLM must run apart from
    the trainer (several GPUs with the vllm backend, or engines of several GPUs)."""
    size = cfg.actor.rollout.vllm.tensor_parallel_size
    if len(actor) < 2 or (cfg.actor.rollout.backend != "vllm" and size == 1):
        return actor
    generating = max(size, len(actor) // 2 // size * size)
    return actor[:generating] if generating < len(actor) else actor


def _fit(plans: list[GpuPlan], name: str) -> str:
    if not plans or plans[0].capacity is None:
        return "GPU memory not known here, so not checked"
    fullest = max(plans, key=lambda g: g.total)
    return (f"{_layout(name)}, which fits by the memory planner's estimate (the fullest, GPU {fullest.gpu}: "
            f"{fullest.total / GIB:.1f} GiB)")


def _layout(name: str) -> str:
    return {"apart": "roles on GPUs of their own", "together": "the roles sharing the GPUs",
            "alone": "the actor, the only role with GPU work, on every GPU"}[name]


def nothing_fits(cfg: RoleFleetConfig, n: int, capacity: float, name: str, trial: RoleFleetConfig,
                 plans: list[GpuPlan]) -> str:
    """Why no map was chosen: the over-full GPUs of the map that came closest (`name`: its layout;
    `trial`: the config with it), each role's estimate there, and what would lower the largest."""
    over = [g for g in plans if g.verdict == "over"]
    same: dict[str, list[str]] = {}  # GPUs of one group over by the same figures, named together
    for g in over:
        parts = " + ".join(f"{e.role} {e.total / GIB:.1f}" for e in g.estimates)
        same.setdefault(parts + (f" = {g.total / GIB:.1f}" if len(g.estimates) > 1 else ""), []).append(g.gpu)
    figures = "; ".join(f"GPUs {', '.join(ids)}: {text} GiB each" if len(ids) > 1 else f"GPU {ids[0]}: {text} GiB"
                        for text, ids in same.items())
    largest = max((e for g in over for e in g.estimates), key=lambda e: e.total)
    # Every GPU here is placed already: more of them is not a setting of this machine.
    helps = [h for h in settings_that_help(trial, largest) if not h.startswith("more GPUs")]
    return (f"devices: auto: no map of {', '.join(gpu_roles(cfg))} on {n} GPU{'s' if n > 1 else ''} "
            f"of {capacity / GIB:.1f} GiB fits the memory planner's estimate. The closest ({_layout(name)}) "
            f"needs {figures} "
            f"(`rolefleet plan CONFIG --gpus {n} --gpu-gib {capacity / GIB:.1f}` itemizes it). Would help: "
            f"{'; '.join(helps)}; or set devices to a map of your own, or devices: cpu")


def announce(cfg: RoleFleetConfig, placement: Placement) -> list[str]:
    """The lines that say what `devices: auto` chose: what it rests on, one line per role, and the
    map to paste into the config."""
    d = placement.devices
    if d.is_cpu:
        lines = [f"devices: auto: every role on the CPU ({placement.why}); set devices to a map to use GPUs"]
    else:
        size = f" of {placement.capacity / GIB:.0f} GiB" if placement.capacity else ""
        lines = [f"devices: auto: placed on {placement.gpus} GPU{'s' if placement.gpus > 1 else ''}"
                 f"{size}; {placement.why}. Set devices to a map to choose yourself, or devices: cpu"]
    lines += [f"  {role}: {_where(cfg, d, role)}" for role in cfg.roles()]
    if not d.is_cpu:
        chosen = {k: v for k, v in d.model_dump().items() if v}
        flow = yaml.safe_dump(chosen, default_flow_style=True, sort_keys=False, width=10**6).strip()
        lines.append(f"  as a map: devices: {flow}")
    return lines


def _where(cfg: RoleFleetConfig, d: DevicesSection, role: str) -> str:
    gpus = getattr(d, role, []) if role != "coordinator" else []
    if not gpus:
        if role == "reward" and "reward" not in gpu_roles(cfg):
            return "the CPU (its reward functions run there; only a reward model takes a GPU)"
        return "the CPU (it holds no GPU)" if role == "coordinator" else "the CPU"
    text = f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}"
    if role == "actor" and d.rollout and d.rollout != d.actor:
        rest = [g for g in d.actor if g not in d.rollout]
        text += f" (generates on {', '.join(map(str, d.rollout))}, trains on {', '.join(map(str, rest))})"
    shared = sorted({r for group in d.colocate if role in group for r in group if r != role
                     and set(map(str, getattr(d, r))) & set(map(str, gpus))})
    return text + (f", shared with {' and '.join(shared)}" if shared else "")


def require_map(cfg: RoleFleetConfig, what: str) -> None:
    """Raise ValueError when `what` (a deployment file) would have to read `devices: auto`: a file
    for other machines cannot choose on this one, and an empty map there would mean the CPU."""
    if cfg.devices.auto:
        raise ValueError(f"devices: auto stands for the map `rolefleet up` chooses on the machine it runs on, and "
                         f"{what} needs the map itself: set devices to a map (`rolefleet plan CONFIG --gpus N "
                         "--gpu-gib G` prints the one auto picks on N GPUs of G GiB), or devices: cpu for roles on "
                         "the CPU")


def visible_gpus() -> list[float]:
    """Memory in bytes of each GPU this process sees; [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [float(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())]


def placed(cfg: RoleFleetConfig, gpus: Optional[Sequence[Optional[float]]] = None,
           say: Callable[[str], None] = lambda line: print(f"rolefleet: {line}", flush=True)) -> RoleFleetConfig:
    """`cfg` with `devices: auto` resolved for `gpus` (default: this machine's) and the choice
    said line by line; `cfg` itself when its devices are given."""
    if not cfg.devices.auto:
        return cfg
    placement = choose_devices(cfg, visible_gpus() if gpus is None else gpus)
    for line in announce(cfg, placement):
        say(line)
    return cfg.model_copy(update={"devices": placement.devices})
