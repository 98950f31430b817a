"""`run.startup_timeout_s`: set, it is the limit of every role; unset, the limit grows with the
weights the role loads (a 70B policy gets far longer than a 135M one)."""

import json

import pytest

from rolefleet.app.startup import (
    STARTUP_BASE_S,
    STARTUP_S_PER_GB,
    default_startup_timeout_s,
    role_weight_bytes,
    startup_limit,
)
from rolefleet.common.config import ConfigError, parse_config

# SmolLM2-135M and Llama-3-70B, as their config.json give them.
SMOLLM2_135M = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "model_type": "llama"}
LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False, "model_type": "llama"}


def model(path, dims: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dims))
    return str(path)


def test_the_default_is_a_base_plus_seconds_per_gb():
    assert default_startup_timeout_s(0) == STARTUP_BASE_S == 300
    assert default_startup_timeout_s(10e9) == 300 + 10 * STARTUP_S_PER_GB == 350


def test_a_70b_model_gets_more_time_than_a_135m_one(tmp_path):
    small = parse_config({"model": {"model_name_or_path": model(tmp_path / "small", SMOLLM2_135M)}})
    large = parse_config({"model": {"model_name_or_path": model(tmp_path / "large", LLAMA_70B)}})
    # The actor loads its policy and its reference: two copies of the weights, in bf16.
    assert role_weight_bytes(small, "actor") == pytest.approx(2 * 2 * 134.5e6, rel=0.01)
    assert role_weight_bytes(large, "actor") == pytest.approx(2 * 2 * 70.55e9, rel=0.01)
    assert startup_limit(small, "actor").seconds == pytest.approx(302.7, abs=0.1)  # 0.54 GB
    assert startup_limit(large, "actor").seconds == pytest.approx(300 + 5 * 282.2, abs=1)
    assert startup_limit(large, "critic").seconds == pytest.approx(300 + 5 * 141.1, abs=1)
    assert startup_limit(large, "reward").seconds == 300  # rule-based: no model to load
    assert startup_limit(large, "actor").why == ("run.startup_timeout_s unset: 300 s + 5 s a GB, for 282.2 GB of "
                                                 "model weights")


def test_a_set_limit_is_every_roles_and_says_where_it_comes_from(tmp_path):
    cfg = parse_config({"model": {"model_name_or_path": model(tmp_path / "large", LLAMA_70B)}},
                       ["run.startup_timeout_s=60"])
    for role in ("actor", "critic", "reward"):
        assert startup_limit(cfg, role).seconds == 60
        assert startup_limit(cfg, role).why == "run.startup_timeout_s, set in the config"
    with pytest.raises(ConfigError, match="run.startup_timeout_s: Input should be greater than 0"):
        parse_config({"model": {"model_name_or_path": "m"}}, ["run.startup_timeout_s=0"])


def test_a_model_not_readable_here_gets_the_base(tmp_path):
    cfg = parse_config({"model": {"model_name_or_path": "someone/not-downloaded"}})
    assert role_weight_bytes(cfg, "actor") is None
    limit = startup_limit(cfg, "actor")
    assert limit.seconds == 300 and limit.why.endswith("(a hub model still to download: the download counts too)")
