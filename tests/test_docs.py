"""Docs stay current: every config key is documented in docs/config.md."""

from pathlib import Path

from pydantic import BaseModel

from rolefleet.common.config import RoleFleetConfig

DOC = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += leaf_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_every_config_key_is_documented():
    endpoint = {"host", "port", "metrics_port", "address", "num_threads"}
    missing = []
    for key in leaf_keys(RoleFleetConfig):
        section, _, leaf = key.rpartition(".")
        if leaf in endpoint and f"`<role>.{leaf}`" in DOC:
            continue
        if f"`{key}`" not in DOC:
            missing.append(key)
    assert not missing, f"undocumented config keys: {missing}"
