"""What each role of a run reads from disk: the models it loads and the files it opens.

A deployment puts every one of them into the role's container (compose mounts, the Helm chart's
volumes), and a role that lacks one fails at start, far from the config line that named it. This is
the one answer to "what does role R read", used by `rolefleet deploy compose`, by the chart's checks
and by the test that walks every shipped config. Security files (TLS, token) are not listed here:
every role reads them, and each deployment has its own secret mechanism for them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from rolefleet.app.preflight import MODEL_KEYS
from rolefleet.common.config import RoleFleetConfig
from rolefleet.tasks.files import source_format
from rolefleet.tasks.hf import local_copy_hint

ALL_ROLES = ("actor", "reward", "critic", "teacher", "coordinator")
# Where a deployment's containers see what a run reads: the models directory (./models beside the
# deploy files, the Helm chart's model volume) at /models and, in the chart, the other files
# (./inputs, the chart's inputs volume) at /inputs. Compose mounts a file's own directory at
# /inputs/<n> instead (deploy/compose.py).
HOST_MODELS_DIR, MODELS_DIR = "models", "/models"
HOST_INPUTS_DIR, INPUTS_DIR = "inputs", "/inputs"


@dataclass(frozen=True)
class Input:
    """One thing a role reads. `key` names it in the config (a list entry by its index:
    reward.sources.0.path); `path` is as the config gives it, for code the file of file.py:function."""

    key: str
    path: str
    kind: Literal["model", "file"]
    # A directory the file needs whole (the package an OpenEnv environment's module belongs to, for
    # its relative imports): a deployment mounts it and sees the file under it; "" the file's own.
    root: str = ""


def role_inputs(cfg: RoleFleetConfig, role: str) -> list[Input]:
    """What `role` of `cfg` reads, in a fixed order (the same config gives the same list)."""
    if role not in ALL_ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ALL_ROLES)})")
    # Every role validates the whole config at start, and that opens the prompt files.
    inputs = [Input(f"{key}.path", _local_data(key, section), "file") for key, section in (("data", cfg.data),
                                                                                            ("eval", cfg.eval))
              if section.path]
    # ... and the files of the user's tools (data.tools): it builds their schemas from the source.
    inputs += [Input(f"data.tools.{i}", entry.rpartition(":")[0], "file") for i, entry in enumerate(cfg.data.tools)
               if ":" in entry]
    if role in MODEL_KEYS:  # the trainer roles: each loads its own models (weights and tokenizer)
        inputs += [Input(key, _get(cfg, key), "model") for key in MODEL_KEYS[role]]
    elif role == "coordinator":
        # The actor model's tokenizer renders the prompts (chat template) and counts their tokens.
        inputs.append(Input("actor.model_name_or_path", cfg.actor.model_name_or_path, "model"))
    elif role == "reward":
        inputs += _reward_inputs(cfg)
    return [i for i in inputs if i.path]


def _local_data(key: str, section) -> str:
    if source_format(section.path, section.format, key) == "hub":  # nothing on disk to mount, and no hub to read
        raise ValueError(f"{key}.path: {section.path!r} is a hub dataset id, and a deployment's roles read no hub "
                         f"(HF_HUB_OFFLINE=1 in the image): {local_copy_hint(section.path, section.name)}")
    return section.path


def _reward_inputs(cfg: RoleFleetConfig) -> list[Input]:
    inputs = []
    for i, source in enumerate(cfg.reward.sources):
        if source.kind == "model":
            inputs.append(Input(f"reward.sources.{i}.path", source.path, "model"))
        elif source.kind == "user":
            inputs.append(Input(f"reward.sources.{i}.path", source.user_function()[0], "file"))
        elif source.options.get("tokenizer"):  # a built-in that counts tokens (length_penalty)
            inputs.append(Input(f"reward.sources.{i}.tokenizer", source.options["tokenizer"], "model"))
    for key, path in (("reward.env.path", cfg.reward.env.path), ("reward.agent.path", cfg.reward.agent.path)):
        if path:
            inputs.append(Input(key, path.rpartition(":")[0], "file"))
    if cfg.reward.agent.openenv and (file := cfg.reward.agent.openenv.environment_file):
        inputs.append(Input(CODE_KEYS[-1], file, "file", _package_root(file)))
    return inputs


# Code keys (path/to/file.py:name): a deployment rewrites the file's path and keeps the name.
CODE_KEYS = ("reward.env.path", "reward.agent.path", "reward.agent.openenv.environment")


def _package_root(file: str) -> str:
    """The directory above the outermost package holding `file` (as the agent workers import it:
    reward/openenv_env.py), or "" where the file is in no package."""
    path = PurePosixPath(file)
    root = path.parent
    while Path(root, "__init__.py").is_file():
        root = root.parent
    return "" if root == path.parent else str(root)


def _get(cfg: RoleFleetConfig, key: str) -> str:
    return functools.reduce(getattr, key.split("."), cfg)


def path_overrides(cfg: RoleFleetConfig, inside: dict[str, str]) -> list[str]:
    """key=<path> for every input of `inside` ({key: where a container sees it}): what a deployment
    passes a role so that it reads each model and file at its path in the container. Code keeps its
    `:function`; reward sources and data.tools are lists, which an override sets whole, with every
    path and tokenizer rewritten."""
    overrides, sources, tools = [], {}, {}
    for key, path in inside.items():
        if key.startswith("reward.sources."):
            sources[key] = path
        elif key.startswith("data.tools."):
            tools[int(key.rpartition(".")[2])] = path
        elif key in CODE_KEYS:  # code: its function stays
            overrides.append(f"{key}={path}:{_get(cfg, key).rpartition(':')[2]}")
        else:
            overrides.append(f"{key}={path}")
    if tools:
        entries = [f"{tools[i]}:{entry.rpartition(':')[2]}" if i in tools else entry
                   for i, entry in enumerate(cfg.data.tools)]
        overrides.append("data.tools=" + json.dumps(entries, separators=(",", ":")))
    if sources:
        entries = []
        for i, source in enumerate(cfg.reward.sources):
            entry = source.model_dump(mode="json", exclude_none=True)
            if path := sources.get(f"reward.sources.{i}.path"):
                entry["path"] = path + (f":{source.user_function()[1]}" if source.kind == "user" else "")
            if path := sources.get(f"reward.sources.{i}.tokenizer"):
                entry["tokenizer"] = path
            entries.append(entry)
        overrides.append("reward.sources=" + json.dumps(entries, separators=(",", ":")))
    return overrides


def mounted_path(path: str, host_dir: str, mount: str) -> str | None:
    """Where `path`, as the config names it, is seen in a container that has the directory `host_dir`
    (relative to where the deployment is generated, `models` or `./configs`, or absolute) mounted at
    `mount` (/models):
    `host_dir/<rest>` is `mount/<rest>`, a path already under `mount` stays as it is, and anything
    else (another directory, an absolute host path, a hub id, a climb out with ..) is None."""
    mount = mount.rstrip("/") or "/"
    if path == mount or path.startswith(mount + "/"):
        return path  # already a container path
    host = PurePosixPath(host_dir.removeprefix("./") or ".").parts
    parts = PurePosixPath(path).parts
    if len(parts) > len(host) and parts[:len(host)] == host and ".." not in parts:
        return str(PurePosixPath(mount, *parts[len(host):]))
    return None
