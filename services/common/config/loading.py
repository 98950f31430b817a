"""From a YAML file and dotted overrides to a validated RoleFleetConfig, and back to YAML: every
problem on the way (an unreadable file, an override that is not key=value, a value the schema
refuses) becomes a ConfigError naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rolefleet.common.config.base import ConfigError
from rolefleet.common.config.cluster import DEVICE_WORDS
from rolefleet.common.config.root import RoleFleetConfig

# Sections that also take a word in place of their mapping; a dotted override inside one starts a map.
SECTION_WORDS = {"devices": DEVICE_WORDS}


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so 1e-6, true, [0, 1] work)."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if i == 0 and child in SECTION_WORDS.get(part, ()):
            # `devices: cpu` with devices.actor=[0]: the word's map (no groups) with the actor's GPUs.
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = _override_value(override, text)


def _override_value(override: str, text: str) -> Any:
    if not text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        # Quote a value that is meant as a string: run.name="'{x}'".
        raise ConfigError(f"override {override!r}: the value {text!r} is not valid YAML "
                          f"({_yaml_problem(e)})") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The YAML error without its source excerpt (which would repeat the override)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return problem
    where = f"column {mark.column + 1}" if mark.line == 0 else f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{problem} at {where}"


def _describe(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif isinstance(e.get("input"), dict):
            lines.append(f"{key}: {message}")
        else:
            lines.append(f"{key}: {message} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_config(raw: dict[str, Any], overrides: list[str] = ()) -> RoleFleetConfig:
    raw = yaml.safe_load(yaml.safe_dump(raw)) or {}  # deep copy; the caller's dict stays as it was
    for override in overrides:
        apply_override(raw, override)
    try:
        return RoleFleetConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RoleFleetConfig:
    return parse_config(_read_mapping(Path(path)), overrides)


def overridden(path: str | Path, overrides: list[str] = ()) -> dict[str, Any]:
    """The config file's own mapping with `overrides` applied, unvalidated and without defaults: what
    a deployment passes on as the run's config."""
    raw = _read_mapping(Path(path))
    for override in overrides:
        apply_override(raw, override)
    return raw


def _read_mapping(path: Path) -> dict[str, Any]:
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (run, actor, ...)")
    return raw


def _read_yaml(path: Path) -> Any:
    """The parsed file, or a ConfigError naming it: missing, a directory, unreadable, not UTF-8,
    not YAML."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                          f"offset {e.start})") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None


def dump_config(config: RoleFleetConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
