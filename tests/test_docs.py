"""Docs stay current: every config key is documented in docs/config.md with the schema's own default,
and described in the schema itself (what `--help`-like tooling and the JSON schema show)."""

import re
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rolefleet.common.config import RoleFleetConfig

DOC = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()


def leaf_fields(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    fields = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            fields |= leaf_fields(ann, f"{prefix}{name}.")
        else:
            fields[f"{prefix}{name}"] = field
    return fields


def test_every_config_key_is_documented():
    endpoint = {"host", "port", "metrics_port", "address", "num_threads"}
    missing = []
    for key in leaf_fields(RoleFleetConfig):
        section, _, leaf = key.rpartition(".")
        if leaf in endpoint and f"`<role>.{leaf}`" in DOC:
            continue
        if f"`{key}`" not in DOC:
            missing.append(key)
    assert not missing, f"undocumented config keys: {missing}"


def test_every_config_key_is_described_in_the_schema():
    missing = [key for key, field in leaf_fields(RoleFleetConfig).items() if not field.description]
    assert not missing, f"config keys without a description: {missing}"


def _same(documented: str, default) -> bool:
    if isinstance(default, bool):
        return documented == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(documented) == float(default)
        except ValueError:
            return False
    return documented == str(default)


def test_the_documented_defaults_are_the_schemas():
    """Each table row `| `key` | `literal` |` whose key has a scalar default must give that default."""
    fields = leaf_fields(RoleFleetConfig)
    rows = re.findall(r"^\| `([a-z_.]+)` \| `([^`|]*)` \|", DOC, re.MULTILINE)
    checked, wrong = 0, []
    for key, documented in rows:
        field = fields.get(key)
        default = field.default if field is not None else None
        if default is None or default is PydanticUndefined or isinstance(default, (list, dict)):
            continue
        checked += 1
        if not _same(documented, default):
            wrong.append(f"{key}: documented {documented!r}, the schema's {default!r}")
    assert checked > 100  # the pattern still finds the tables
    assert not wrong, wrong
