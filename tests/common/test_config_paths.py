"""`~` and environment variables in every path key (common/config/paths.py): expanded before the
checks that open the file, kept expanded in the config a run writes; an unset variable is an error
naming the key and the variable; hub ids and the `{role}` placeholder are left as they are."""

from pathlib import Path

import pytest
import yaml

from rolefleet.common.config import ConfigError, dump_config, parse_config

BASE = {"model": {"model_name_or_path": "some/model"}}
RECORD = '{"prompt": "1+1=", "ground_truth": "2"}\n'


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home directory of its own, holding ~/data/{train,test}.jsonl."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    for name in ("train.jsonl", "test.jsonl"):
        (home / "data" / name).write_text(RECORD)
    monkeypatch.setenv("HOME", str(home))
    return home


def test_a_tilde_in_data_and_eval_paths_is_the_home_directory(home):
    # Unexpanded, both would fail as "is not a file" (the verl guides' ~/data/gsm8k/train.parquet).
    cfg = parse_config(BASE, ["data.path=~/data/train.jsonl", "eval.path=~/data/test.jsonl", "eval.every=1",
                              "run.output_dir=~/runs/one", "checkpoint.dir=~/ckpt"])
    assert cfg.data.path == str(home / "data" / "train.jsonl")
    assert cfg.eval.path == str(home / "data" / "test.jsonl")
    assert cfg.eval_data().path == cfg.eval.path
    assert cfg.run.out == home / "runs" / "one"
    assert cfg.checkpoint.root(cfg.run) == home / "ckpt"


def test_the_resolved_config_a_run_writes_holds_the_expanded_paths(home, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(home / "data"))
    cfg = parse_config(BASE, ["data.path=$DATA_DIR/train.jsonl", "eval.path=~/data/test.jsonl"])
    written = yaml.safe_load(dump_config(cfg))  # what `rolefleet up` writes as <run dir>/config.yaml
    assert written["data"]["path"] == str(home / "data" / "train.jsonl")
    assert written["eval"]["path"] == str(home / "data" / "test.jsonl")
    # The roles read it where the variable may be unset and HOME another: it needs neither.
    monkeypatch.delenv("DATA_DIR")
    monkeypatch.setenv("HOME", "/nonexistent")
    assert dump_config(parse_config(written)) == dump_config(cfg)


def test_dollar_name_and_braced_variables(home, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(home / "data"))
    monkeypatch.setenv("MODELS", "/models")
    monkeypatch.setenv("RUNS", "/scratch/runs")
    cfg = parse_config(BASE, ["data.path=$DATA_DIR/train.jsonl", "eval.path=${DATA_DIR}/test.jsonl",
                              "model.model_name_or_path=${MODELS}/qwen-0.5b", "actor.ref_model_name_or_path=$MODELS/ref",
                              "run.output_dir=$RUNS/a", "checkpoint.dir=${RUNS}/a/ckpt",
                              "actor.profile_dir=$RUNS/prof", "critic.profile_dir=${RUNS}_critic/prof"])
    assert (cfg.data.path, cfg.eval.path) == (str(home / "data" / "train.jsonl"), str(home / "data" / "test.jsonl"))
    # model.model_name_or_path is expanded once, and the trainers' defaults come from it.
    assert cfg.model.model_name_or_path == cfg.actor.model_name_or_path == cfg.critic.model_name_or_path \
        == "/models/qwen-0.5b"
    assert cfg.actor.ref_model_name_or_path == "/models/ref"
    assert (cfg.run.output_dir, cfg.checkpoint.dir) == ("/scratch/runs/a", "/scratch/runs/a/ckpt")
    assert (cfg.actor.profile_dir, cfg.critic.profile_dir) == ("/scratch/runs/prof", "/scratch/runs_critic/prof")


@pytest.mark.parametrize("override", [
    "data.path=$ROLEFLEET_UNSET_VAR/train.parquet",
    "eval.path=${ROLEFLEET_UNSET_VAR}/test.parquet",
    "model.model_name_or_path=$ROLEFLEET_UNSET_VAR/model",
    "critic.model_name_or_path=${ROLEFLEET_UNSET_VAR}",
    "run.output_dir=runs/$ROLEFLEET_UNSET_VAR",
    "checkpoint.dir=$ROLEFLEET_UNSET_VAR",
    "actor.profile_dir=$ROLEFLEET_UNSET_VAR/p",
    "security.token_file=$ROLEFLEET_UNSET_VAR/token",
    "reward.env.path=$ROLEFLEET_UNSET_VAR/env.py:step",
])
def test_an_unset_variable_is_an_error_naming_the_key_and_the_variable(override, monkeypatch):
    monkeypatch.delenv("ROLEFLEET_UNSET_VAR", raising=False)
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, [override])
    assert f"{key}: environment variable ROLEFLEET_UNSET_VAR is not set (got {value!r})" in str(err.value)


def test_a_malformed_brace_is_an_error_not_text(home):
    for value in ("${DATA/train.jsonl", "${}/train.jsonl", "${DATA DIR}/train.jsonl"):
        with pytest.raises(ConfigError, match=r"data\.path: '\$\{.*' is not an environment variable: write \$NAME"):
            parse_config(BASE, [f"data.path={value}"])


@pytest.mark.parametrize("path", ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "runs/my-model", "./models/a~b",
                                  "models/a$/b", "/opt/m/$1"])
def test_hub_ids_and_paths_without_tilde_or_variables_stay_as_written(path):
    cfg = parse_config({"model": {"model_name_or_path": path}})
    assert cfg.actor.model_name_or_path == cfg.critic.model_name_or_path == path


def test_the_role_placeholder_of_tls_and_token_paths_is_kept(home, monkeypatch):
    monkeypatch.setenv("CERTS", "/etc/certs")
    cfg = parse_config(BASE, ["security.tls.cert_file=$CERTS/{role}.pem", "security.tls.key_file=~/certs/{role}-key.pem",
                              "security.tls.ca_file=${CERTS}/ca.pem", "security.token_file=~/tokens/{role}"])
    tls = cfg.security.tls
    assert (tls.cert_file, tls.key_file, tls.ca_file) == ("/etc/certs/{role}.pem", f"{home}/certs/{{role}}-key.pem",
                                                          "/etc/certs/ca.pem")
    assert tls.paths("actor") == {"cert_file": "/etc/certs/actor.pem", "key_file": f"{home}/certs/actor-key.pem",
                                  "ca_file": "/etc/certs/ca.pem"}
    assert cfg.security.token_file == f"{home}/tokens/{{role}}"


def test_file_function_keys_and_a_builtins_tokenizer(home, monkeypatch):
    monkeypatch.setenv("ENVS", "/srv/envs")
    sources = [{"kind": "user", "path": "~/rewards/mine.py:score"},
               {"kind": "model", "path": "${ENVS}/rm", "name": "rm"},
               {"kind": "model", "path": "OpenAssistant/reward-model-deberta-v3-large-v2", "name": "hub"},
               {"kind": "function", "function": "length_penalty", "target": 8, "tokenizer": "~/tok"}]
    cfg = parse_config(BASE, ["reward.sources=" + yaml.safe_dump(sources, default_flow_style=True).strip(),
                              "reward.env.path=$ENVS/env.py:step"])
    user, model, hub, builtin = cfg.reward.sources
    assert user.path == f"{home}/rewards/mine.py:score"
    assert user.user_function() == (f"{home}/rewards/mine.py", "score") and user.name == "mine"
    assert (model.path, hub.path) == ("/srv/envs/rm", "OpenAssistant/reward-model-deberta-v3-large-v2")
    assert builtin.options == {"target": 8, "tokenizer": f"{home}/tok"}
    assert cfg.reward.env.path == "/srv/envs/env.py:step"


def test_an_unset_variable_in_a_builtins_tokenizer_names_the_option(monkeypatch):
    monkeypatch.delenv("ROLEFLEET_UNSET_VAR", raising=False)
    source = "{kind: function, function: length_penalty, target: 8, tokenizer: $ROLEFLEET_UNSET_VAR/tok}"
    with pytest.raises(ConfigError, match=r"reward\.sources\.0: option tokenizer: environment variable "
                                          "ROLEFLEET_UNSET_VAR is not set"):
        parse_config(BASE, [f"reward.sources=[{source}]"])
