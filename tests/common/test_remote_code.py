"""`model.trust_remote_code`: a model whose architecture lives in its own Python files loads only when
the config says so, in every way a role loads it (whole, or as a skeleton read by shard)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.config import parse_config
from rolefleet.common.modeling import load_causal_lm, load_tokenizer
from rolefleet.trainer.loading import build_on_meta

CONFIGURATION = '''
from transformers import LlamaConfig


class ShippedConfig(LlamaConfig):
    model_type = "rolefleet_shipped"
'''
MODELING = '''
from transformers import LlamaForCausalLM

from .configuration_shipped import ShippedConfig


class ShippedForCausalLM(LlamaForCausalLM):
    config_class = ShippedConfig
'''


@pytest.fixture(scope="module")
def shipped_model(tmp_path_factory) -> Path:
    """The tiny model, its architecture named by files of its own (as hub models with `auto_map` do)."""
    out = make_tiny_model(tmp_path_factory.mktemp("shipped") / "model")
    (out / "configuration_shipped.py").write_text(CONFIGURATION)
    (out / "modeling_shipped.py").write_text(MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="rolefleet_shipped", architectures=["ShippedForCausalLM"], auto_map={
        "AutoConfig": "configuration_shipped.ShippedConfig",
        "AutoModelForCausalLM": "modeling_shipped.ShippedForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_model_with_its_own_code_loads_only_when_trusted(shipped_model):
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(str(shipped_model), torch.device("cpu"))
    model = load_causal_lm(str(shipped_model), torch.device("cpu"), trust_remote_code=True)
    assert type(model).__name__ == "ShippedForCausalLM"
    assert load_tokenizer(str(shipped_model), trust_remote_code=True).pad_token_id is not None
    skeleton = build_on_meta(AutoModelForCausalLM, str(shipped_model), trust_remote_code=True)
    assert type(skeleton).__name__ == "ShippedForCausalLM" and all(p.is_meta for p in skeleton.parameters())


def test_the_model_sections_setting_is_the_trainers_default(shipped_model):
    cfg = parse_config({"model": {"model_name_or_path": str(shipped_model), "trust_remote_code": True}}, [])
    assert cfg.actor.trust_remote_code and cfg.critic.trust_remote_code
    own = parse_config({"model": {"model_name_or_path": str(shipped_model), "trust_remote_code": True},
                        "critic": {"trust_remote_code": False}}, [])
    assert own.actor.trust_remote_code and not own.critic.trust_remote_code
    assert not parse_config({"model": {"model_name_or_path": str(shipped_model)}}, []).actor.trust_remote_code
