"""Checks a validated config against this machine before any role starts.

`parse_config` checks what a config says; `preflight` checks whether this machine can run it: model
directories exist (or name a hub model), responses fit the model's positions, a step fits the
per-request limits, the output directory is writable and the device groups name GPUs that exist.
Each finding is found in seconds instead of minutes into a run (a model load, a traceback at step
1), and all of them are reported at once as one ConfigError, a line per problem naming its key.
What may be meant but usually is a slip (a GPU estimate near the GPU's memory, a role given GPUs it
has no work for) is a warning in the log instead, and the run goes on. Nothing here loads a model or
reaches the network.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from rolefleet.actor import rollout as actor_rollout
from rolefleet.actor.placement import ActorPlacement, engine_size, rollout_ranks
from rolefleet.app import memory
from rolefleet.app.placement import gpu_roles
from rolefleet.common.config import ConfigError, RoleFleetConfig, split_device
from rolefleet.common.model_paths import max_positions, model_problem
from rolefleet.coordinator.data import PromptDataset
from rolefleet.coordinator.trackers import missing_backends
from rolefleet.reward.sources import check_sources
from rolefleet.tasks import DataError
from rolefleet.tasks.files import Columns, read_prompts
from rolefleet.trainer.nodes import layout_for, worker_count

log = logging.getLogger(__name__)
COMMANDS = ("up", "serve", "train")
MODEL_KEYS = {"actor": ("actor.model_name_or_path", "actor.ref_model_name_or_path"),
              "critic": ("critic.model_name_or_path",),
              # The teacher's model, and the student's (its tokenizer, which the teacher's must equal).
              "teacher": ("teacher.model_name_or_path", "actor.model_name_or_path")}
GPU_ROLES = ("actor", "reward", "critic", "teacher")


def preflight(cfg: RoleFleetConfig, roles: list[str], *, command: str, node: int = 0) -> None:
    """Raise ConfigError listing every problem that would stop `roles` of `cfg` on this machine.

    `command` is the CLI command: `up` runs every role here, so its device groups must name local
    GPUs; `serve` runs one role whose GPUs were chosen by CUDA_VISIBLE_DEVICES (compose, Helm), or
    with `node` >= 1 one node's part of a role that spans nodes.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; valid: {', '.join(COMMANDS)}")
    problems = [*check_models(cfg, roles), *check_request_limits(cfg)]
    if "coordinator" in roles:  # the coordinator reads the data, writes the outputs, dials the roles
        problems += check_data(cfg) + check_output_dir(cfg) + check_tracking(cfg)
        if command != "up":  # `up` fills the addresses in once the roles have bound their ports
            problems += check_role_addresses(cfg)
        elif cfg.reward.replicas:
            problems.append("reward.replicas: `rolefleet up` starts one reward server of its own; replicas are "
                            "for `rolefleet train` / `serve coordinator` against running servers (compose, Helm)")
    problems += check_local_devices(cfg, roles) if command == "up" else check_visible_gpus(cfg, roles, node)
    problems += check_rollout_backend(cfg, roles, command) + check_workers(cfg, roles)
    problems += check_memory(cfg, roles) + check_adapters(cfg, roles)
    for warning in idle_gpu_warnings(cfg, roles):
        log.warning("%s", warning)
    if "reward" in roles:
        problems += check_sources(cfg)
    if problems:
        raise ConfigError("config check failed:\n  " + "\n  ".join(problems))


def check_memory(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """The roles' estimated GPU memory (`app/memory.py`) against this machine's GPUs, and what they
    offload against its memory: over is a problem, near a warning."""
    problems, warnings = memory.memory_problems(cfg, roles, memory.gpu_capacity(), memory.host_capacity())
    for warning in warnings:
        log.warning("%s", warning)
    return problems


def idle_gpu_warnings(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """Roles of `roles` given GPUs they have no work for: GPUs that idle through the whole run while
    the roles with work go short. Warnings, not problems: a user reward function may use a GPU of
    its own accord, which nothing here can see."""
    warnings = []
    if "reward" in roles and cfg.devices.reward:
        sources = cfg.reward.scoring_sources()
        if not any(s.kind == "model" for s in sources):
            kinds = {"function": "a built-in function", "user": "a user function"}
            names = ", ".join(f"{s.name}: {kinds[s.kind]}" for s in sources)
            warnings.append(
                f"devices.reward: GPUs {cfg.devices.reward} go to the reward role, but its sources run on the CPU "
                f"({names}); only a `kind: model` source uses a GPU (environments run on the CPU too), so these "
                "GPUs will idle. Give them to the actor or the critic and set devices.reward=[]; if a reward "
                "function of yours uses the GPU itself, keep them and ignore this warning")
    if "coordinator" in roles and cfg.devices.critic and not cfg.preset.uses_critic:
        warnings.append(f"devices.critic: GPUs {cfg.devices.critic} go to the critic, but algorithm "
                        f"{cfg.algorithm} has none and no critic starts: they will idle. Set devices.critic=[] "
                        "or give them to the actor")
    return warnings


def check_adapters(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """`<role>.lora.target_modules` name layers of the role's model (checked on a skeleton of its
    config on the meta device: nothing is loaded)."""
    # check_models reports a model that is not there
    wanted = [r for r in ("actor", "critic") if r in roles and getattr(cfg, r).lora.enabled
              and model_problem(getattr(cfg, r).model_name_or_path) is None]
    if not wanted:
        return []
    # Only for a LoRA config: transformers and peft take seconds to import, on every `rolefleet up` else.
    from transformers import AutoConfig

    from rolefleet.trainer.lora import merged_shapes  # imports peft and transformers: as above

    problems = []
    for role in wanted:
        section = getattr(cfg, role)
        lora, path = section.lora, section.model_name_or_path
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True,
                                                trust_remote_code=bool(section.trust_remote_code))
        except Exception:  # noqa: BLE001 - an unreadable config: the role's own load says what is wrong
            continue
        try:
            merged_shapes(config, lora)
        except ValueError as exc:
            problems.append(f"{role}.lora.target_modules={lora.target_modules!r}: {exc} (model {path})")
    return problems


# --- tracking -----------------------------------------------------------------------------------

def check_tracking(cfg: RoleFleetConfig) -> list[str]:
    """A chosen tracker must be importable: found missing after the models loaded, it would end the run."""
    return [f"tracking.backends: {m} is not installed" for m in missing_backends(cfg.tracking.backends)]


# --- data ---------------------------------------------------------------------------------------

SFT_RECORDS_CHECKED = 256


def check_data(cfg: RoleFleetConfig) -> list[str]:
    """The prompts load as the coordinator will load them: the file parses, the chat template and
    the token limit apply (otherwise the coordinator would fail at step 1, after every role has
    loaded its models). The tokenizer is read only from a local model directory: a missing one
    is check_models' finding, and a hub id would mean the network (the coordinator checks it)."""
    d = cfg.data
    local = Path(cfg.actor.model_name_or_path).expanduser()
    try:
        if local.is_dir() and model_problem(str(local)) is None:
            dataset = PromptDataset.for_run(cfg)
            if cfg.preset.supervised:  # the first records have what sft trains (the coordinator checks them all)
                from rolefleet.coordinator.supervised import fitted, supervised_examples

                dataset.records = dataset.records[:SFT_RECORDS_CHECKED]
                made = supervised_examples(cfg, dataset)
                if d.overlong == "error":  # (dropped and cut ones are the coordinator's to count and say)
                    fitted(cfg, dataset, made)
            if cfg.eval.enabled:
                PromptDataset.for_eval(cfg)
        elif d.path:
            read_prompts(d.path, d.format, Columns(d.prompt_key, d.answer_key,
                                                   None if d.extra_keys is None else tuple(d.extra_keys)),
                         split=d.split, name=d.name)
    except DataError as e:
        return [str(e)]  # it names its key
    except (OSError, ValueError) as e:
        return [f"data.path: {e}"]
    return []


# --- models -------------------------------------------------------------------------------------

def check_models(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """Every model the roles load exists, and `sampling.max_new_tokens` fits its positions."""
    problems = []
    for path, keys in _models_of(cfg, roles).items():
        where = ", ".join(keys)
        if path == cfg.model.model_name_or_path:
            where += " (from model.model_name_or_path)"
        if (problem := model_problem(path)) is not None:
            problems.append(f"{where}: {problem}")
            continue
        positions = max_positions(path)
        if cfg.preset.supervised and not cfg.eval.enabled:
            continue  # nothing is generated: the examples are fitted to the positions as they load (data.max_example_tokens)
        # A multi-turn response is the whole conversation after the prompt.
        rollout = cfg.actor.rollout
        key, response = (("actor.rollout.max_total_tokens", rollout.max_total_tokens) if rollout.max_turns > 1
                         else ("sampling.max_new_tokens", cfg.sampling.max_new_tokens))
        if (problem := positions_problem(response, path, positions)) is not None:
            problems.append(f"{key}: {problem} ({where})")
        elif (limit := cfg.data.max_prompt_tokens) and positions is not None and limit + response > positions:
            # Known before any load: a prompt at the limit plus a full response would be refused at step 1.
            problems.append(f"data.max_prompt_tokens: {limit} + {key} "
                            f"{response} exceed the {positions} positions of model {path} ({where})")
    return problems


def _models_of(cfg: RoleFleetConfig, roles: list[str]) -> dict[str, list[str]]:
    """Model path -> the keys that name it, so a path shared by several keys is checked once."""
    models: dict[str, list[str]] = {}
    for role in roles:
        for key in MODEL_KEYS.get(role, ()):
            section, field = key.split(".")
            models.setdefault(getattr(getattr(cfg, section), field), []).append(key)
    return models


def positions_problem(max_new_tokens: int, path: str, limit: Optional[int]) -> Optional[str]:
    """A response of max_new_tokens after a prompt of at least one token must fit the positions
    (`limit`: `max_positions(path)`)."""
    if limit is None or max_new_tokens + 1 <= limit:
        return None
    return (f"{max_new_tokens} plus at least one prompt token exceeds the {limit} positions "
            f"(max_position_embeddings) of model {path}; set it <= {limit - 1}")


# --- request limits -----------------------------------------------------------------------------

def check_request_limits(cfg: RoleFleetConfig) -> list[str]:
    """One step's batch must fit one request of every role it is sent to; otherwise step 1 fails
    with RESOURCE_EXHAUSTED after the models have loaded."""
    t = cfg.train
    sequences = t.prompts_per_step * t.samples_per_prompt
    # A lower bound of a step's tokens once responses reach their cap (prompts of one token).
    tokens = sequences * (cfg.sampling.max_new_tokens + 1)
    seq_step = (f"train.prompts_per_step x train.samples_per_prompt = {t.prompts_per_step} x "
                f"{t.samples_per_prompt} = {sequences}")
    token_step = (f"train.prompts_per_step x train.samples_per_prompt x (sampling.max_new_tokens + 1) = "
                  f"{t.prompts_per_step} x {t.samples_per_prompt} x {cfg.sampling.max_new_tokens + 1} = "
                  f"{tokens} tokens once responses reach their cap")
    problems = []
    trainers = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.preset.uses_critic else [])
    for role, section in trainers:
        if sequences > section.max_sequences_per_request:
            problems.append(f"{role}.max_sequences_per_request={section.max_sequences_per_request} is below "
                            f"one step's {seq_step} sequences")
        if tokens > section.max_tokens_per_request:
            problems.append(f"{role}.max_tokens_per_request={section.max_tokens_per_request} is below "
                            f"one step's {token_step}")
    if sequences > cfg.reward.max_items_per_request:
        problems.append(f"reward.max_items_per_request={cfg.reward.max_items_per_request} is below "
                        f"one step's {seq_step} samples")
    e = cfg.eval
    evaluated = e.max_prompts * e.samples_per_prompt  # an evaluation is one Generate and one Score
    for key, limit in (("actor.max_sequences_per_request", cfg.actor.max_sequences_per_request),
                       ("reward.max_items_per_request", cfg.reward.max_items_per_request)):
        if e.enabled and evaluated > limit:
            problems.append(f"{key}={limit} is below an evaluation's eval.max_prompts x eval.samples_per_prompt = "
                            f"{e.max_prompts} x {e.samples_per_prompt} = {evaluated} samples")
    return problems


# --- output directory and addresses -------------------------------------------------------------

def check_output_dir(cfg: RoleFleetConfig) -> list[str]:
    """Create run.output_dir and prove it writable now, not when the first metrics line is written."""
    out = cfg.run.out
    if out.exists() and not out.is_dir():
        return [f"run.output_dir: {out} exists and is not a directory"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rolefleet-write-probe-", dir=out)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        return [f"run.output_dir: {out} is not writable ({e.strerror or e})"]
    return []


def check_role_addresses(cfg: RoleFleetConfig) -> list[str]:
    """The coordinator dials every role from the config; port 0 without an address cannot work."""
    problems = []
    for role in cfg.roles():
        if role == "coordinator" or (role == "reward" and cfg.reward.replicas):
            continue
        try:
            getattr(cfg, role).dial_address(role)
        except ConfigError as e:
            problems.append(str(e))  # it names the key already
    return problems


# --- devices ------------------------------------------------------------------------------------

def gpu_count() -> int:
    """GPUs this process can use (CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_devices(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """`rolefleet up`: every GPU of every device group it starts must exist on this machine. It runs
    a role's every node here too, as processes of their own: a "node:i" entry is this machine's GPU
    i, and two nodes' entries must not land on one GPU."""
    groups = [g for g in GPU_ROLES if g in roles] + (["rollout"] if "actor" in roles else [])
    entries = {g: [split_device(e) for e in getattr(cfg.devices, g)] for g in groups}
    count = gpu_count() if any(entries.values()) else 0
    problems = []
    for group, devices in entries.items():
        missing = sorted({gpu for _, gpu in devices if gpu >= count})
        if missing:
            problems.append(f"devices.{group}: {_gpus(missing)} on this machine (it has {count} GPUs)"
                            + _visible_note())
    return problems + _same_local_gpu(cfg, [g for g in groups if g != "rollout"])


def _same_local_gpu(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """Entries that `up` would put on one local GPU although they name different nodes (of a role,
    or of two roles not declared in devices.colocate)."""
    users: dict[int, list[tuple[str, str]]] = {}
    for role in roles:
        for entry in getattr(cfg.devices, role):
            users.setdefault(split_device(entry)[1], []).append((role, str(entry)))
    problems = []
    for gpu, named in sorted(users.items()):
        for i, (role_a, a) in enumerate(named):
            for role_b, b in named[i + 1:]:
                shared = role_a != role_b and any(role_a in g and role_b in g for g in cfg.devices.colocate)
                if a != b and not shared:
                    problems.append(f"devices.{role_a}: {a} and devices.{role_b}: {b} would both be GPU {gpu} of this "
                                    "machine under `rolefleet up`, which runs every node's processes here: give "
                                    "them different GPU indices (or use `rolefleet serve` on each node)")
    return problems


def _gpus(missing: list[int]) -> str:
    if len(missing) == 1:
        return f"GPU {missing[0]} does not exist"
    return f"GPUs {', '.join(map(str, missing))} do not exist"


def _visible_note() -> str:
    # up gives each role its own CUDA_VISIBLE_DEVICES, but the count is of what `up` itself sees.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f"; this process sees only CUDA_VISIBLE_DEVICES={visible!r}"


def check_workers(cfg: RoleFleetConfig, roles: list[str]) -> list[str]:
    """A role on GPUs runs one worker per GPU of its group: `<role>.workers` may only repeat that."""
    problems = []
    for role in ("actor", "critic"):
        workers, gpus = getattr(cfg, role).workers, len(getattr(cfg.devices, role))
        if role in roles and workers is not None and gpus and workers != gpus:
            problems.append(f"{role}.workers: {workers} workers, but devices.{role} lists {gpus} GPUs "
                            "(one worker per GPU; leave it unset)")
    rollout = cfg.actor.rollout.workers
    if "actor" in roles and rollout is not None:
        if cfg.devices.actor:
            problems.append("actor.rollout.workers: the actor has GPUs; devices.rollout names the ones that "
                            "generate (leave it unset)")
        elif rollout >= (total := worker_count("actor", cfg)):
            problems.append(f"actor.rollout.workers: {rollout} of the actor's {total} workers would generate, "
                            "leaving none to train; at most actor.workers - 1")
    return problems


def check_rollout_backend(cfg: RoleFleetConfig, roles: list[str], command: str) -> list[str]:
    """`actor.rollout.backend=vllm` needs vllm installed and a GPU for the actor (`up`: its device
    group; `serve`: what the process sees)."""
    if "actor" not in roles:
        return []
    has_gpu = bool(cfg.devices.actor) if command == "up" else gpu_count() > 0
    backend, installed, workers = cfg.actor.rollout.backend, actor_rollout.vllm_installed(), worker_count("actor", cfg)
    placement = ActorPlacement(workers, rollout_ranks(cfg))  # devices.rollout is within devices.actor (config)
    if (problem := actor_rollout.backend_problem(backend, has_gpu, installed, workers, placement.split)) is not None:
        return [f"actor.rollout.backend: {problem}"]
    chosen = actor_rollout.choose_backend(backend, has_gpu, installed, workers, placement.split)
    try:
        size = engine_size(cfg.actor, chosen, placement)
    except ValueError as exc:
        return [str(exc)]
    if (problem := engine_nodes_problem(cfg, replace(placement, engine_size=size))) is not None:
        return [problem]
    truncating = [k for k, on in (("top_k", cfg.sampling.top_k > 0), ("top_p", cfg.sampling.top_p < 1)) if on]
    if truncating and chosen == "vllm":
        chosen = "" if backend == "vllm" else " (auto chose it: vllm is installed and the actor has a GPU)"
        return [f"sampling.{truncating[0]}: the vllm rollout backend{chosen} cannot record the untruncated "
                "logprob the project's convention needs (docs/algorithms.md) when top-k or top-p truncates; "
                "set actor.rollout.backend=hf or turn truncation off"]
    return []


def engine_nodes_problem(cfg: RoleFleetConfig, placement) -> str | None:
    """A vLLM engine runs its tensor-parallel workers on the GPUs of one node."""
    layout = layout_for("actor", cfg)
    for rank in placement.engine_ranks if placement.engine_size > 1 else []:
        members = placement.engine_members(rank)
        if not layout.same_node(members):
            nodes = sorted({layout.name(layout.node_of(r)) for r in members})
            return (f"actor.rollout.vllm.tensor_parallel_size: the engine of actor ranks {members} would span nodes "
                    f"{', '.join(nodes)}; an engine's GPUs must be on one node (devices.rollout)")
    return None


def check_visible_gpus(cfg: RoleFleetConfig, roles: list[str], node: int = 0) -> list[str]:
    """`rolefleet serve ROLE` (compose, Helm): the process must see as many GPUs as its group lists
    (on its node, for a group over several); otherwise the role would silently run on fewer GPUs,
    or on the CPU."""
    problems = []
    if cfg.devices.auto and set(roles) & set(gpu_roles(cfg)) and (seen := gpu_count()):
        # The map `auto` stands for is chosen by `up` for the whole run; one role alone cannot.
        problems.append(f"devices: auto, and this process sees {seen} GPU{'s' if seen > 1 else ''}: a role started "
                        "by itself is given no map (`rolefleet up` chooses one and saves it in the run's config.yaml); "
                        "set devices to a map (`rolefleet plan CONFIG` shows the one auto picks here), or devices: cpu")
    for role in roles:
        by_node = cfg.devices.by_node(role) if role in GPU_ROLES else []  # coordinator: no GPU
        wanted = len(by_node[node][1]) if node < len(by_node) else 0
        if wanted and (seen := gpu_count()) < wanted:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            how = "is not set" if visible is None else f"is {visible!r}"
            problems.append(f"devices.{role}: lists {wanted} GPUs but this process sees {seen} "
                            f"(CUDA_VISIBLE_DEVICES {how}; compose's device reservations and Helm's "
                            "nvidia.com/gpu requests give a role its GPUs)")
    return problems
