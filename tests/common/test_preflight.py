"""preflight: what a valid config needs from this machine, found before any role starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from rolefleet.app import preflight as pf
from rolefleet.app.preflight import preflight
from rolefleet.common.config import ConfigError, parse_config


def problems(cfg, roles=None, command="up") -> str:
    """The preflight message, or '' when the config passes."""
    try:
        preflight(cfg, roles or cfg.roles(), command=command)
    except ConfigError as e:
        return str(e)
    return ""


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees `n` GPUs."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(pf, "gpu_count", lambda: n)
    set_count(0)
    return set_count


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty local hub cache, offline."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cache_model(cache: Path, repo_id: str, model_dir: str) -> None:
    """Lay `model_dir`'s config.json out as the hub client caches a download of `repo_id`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copy(Path(model_dir) / "config.json", snapshot / "config.json")


def test_a_run_with_a_local_model_and_default_limits_passes(make_config, gpus):
    cfg = make_config()
    assert problems(cfg) == ""
    assert cfg.run.out.is_dir(), "preflight creates run.output_dir"
    assert list(cfg.run.out.iterdir()) == [], "the write probe is removed"


def test_a_typo_under_an_existing_directory_is_a_missing_directory_not_a_hub_id(
        make_config, tmp_path, monkeypatch, gpus):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    message = problems(make_config("model.model_name_or_path=runs/demo-modle"))
    assert ("actor.model_name_or_path, actor.ref_model_name_or_path, critic.model_name_or_path "
            "(from model.model_name_or_path): model directory runs/demo-modle does not exist") in message


@pytest.mark.parametrize("path", ["./nope", "/no/such/model", "~/no-such-model-dir", "a/b/c", "bad name"])
def test_paths_that_cannot_be_hub_ids_do_not_exist(make_config, gpus, path):
    # The reference model defaults to the actor's, so both keys are named, in one line; `~` is
    # expanded by the config (common/config/paths.py) before the check.
    path = os.path.expanduser(path)
    assert (f"actor.model_name_or_path, actor.ref_model_name_or_path: model directory {path} does not exist"
            in problems(make_config(f"actor.model_name_or_path={path}")))


def test_a_directory_without_config_json_is_not_a_model(make_config, tmp_path, gpus):
    (tmp_path / "empty").mkdir()
    message = problems(make_config(f"actor.ref_model_name_or_path={tmp_path / 'empty'}"))
    assert f"actor.ref_model_name_or_path: model directory {tmp_path / 'empty'} has no config.json" in message
    assert "actor.model_name_or_path" not in message


def test_a_file_is_not_a_model_directory(make_config, tmp_path, gpus):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "is a file, not a model directory" in problems(
        make_config(f"actor.model_name_or_path={tmp_path / 'weights.bin'}"))


def test_offline_a_hub_id_must_be_in_the_local_cache(make_config, hub_cache, tiny_model_dir, gpus):
    message = problems(make_config("actor.model_name_or_path=someorg/somemodel"))
    assert "actor.ref_model_name_or_path: someorg/somemodel is not a local directory" in message
    assert "not in the local hub cache while HF_HUB_OFFLINE is set" in message
    cache_model(hub_cache, "someorg/somemodel", tiny_model_dir)
    assert problems(make_config("actor.model_name_or_path=someorg/somemodel")) == ""


def test_online_a_hub_id_is_left_to_the_hub(make_config, monkeypatch, gpus):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert problems(make_config("actor.model_name_or_path=someorg/somemodel")) == ""


def test_the_critic_model_is_checked_only_when_the_critic_runs(make_config, gpus):
    ppo = make_config("critic.model_name_or_path=/no/critic")
    assert "critic.model_name_or_path: model directory /no/critic does not exist" in problems(ppo)
    grpo = make_config("critic.model_name_or_path=/no/critic", "algorithm=grpo", "train.samples_per_prompt=2")
    assert problems(grpo) == ""
    assert problems(ppo, ["actor", "reward", "coordinator"]) == "", "up without the critic role"


def test_responses_must_fit_the_models_positions(make_config, gpus):
    # The tiny model has 128 positions: a 127-token response after a 1-token prompt is the most.
    assert problems(make_config("sampling.max_new_tokens=127")) == ""
    message = problems(make_config("sampling.max_new_tokens=128"))
    assert ("sampling.max_new_tokens: 128 plus at least one prompt token exceeds the 128 positions "
            "(max_position_embeddings) of model") in message
    assert "; set it <= 127 (actor.model_name_or_path, actor.ref_model_name_or_path, critic" in message


def test_the_prompt_limit_and_the_response_must_fit_the_positions_together(make_config, gpus):
    assert problems(make_config("data.max_prompt_tokens=96", "sampling.max_new_tokens=32")) == ""
    message = problems(make_config("data.max_prompt_tokens=100", "sampling.max_new_tokens=32"))
    assert "data.max_prompt_tokens: 100 + sampling.max_new_tokens 32 exceed the 128 positions of model" in message


@pytest.mark.multiturn
def test_a_whole_conversation_must_fit_the_positions(make_config, gpus):
    multi = ("actor.rollout.max_turns=3", "reward.env.name=feedback", "sampling.max_new_tokens=32")
    assert problems(make_config(*multi, "actor.rollout.max_total_tokens=127")) == ""
    message = problems(make_config(*multi))  # 3 x 32 = 96: fits; with a 40-token prompt limit it does not
    assert message == ""
    message = problems(make_config(*multi, "data.max_prompt_tokens=40"))
    assert "data.max_prompt_tokens: 40 + actor.rollout.max_total_tokens 96 exceed the 128 positions" in message
    message = problems(make_config(*multi, "actor.rollout.max_total_tokens=200"))
    assert "actor.rollout.max_total_tokens: 200 plus at least one prompt token exceeds the 128 positions" in message


def test_positions_are_read_from_a_cached_hub_model_too(make_config, hub_cache, tiny_model_dir, gpus):
    cache_model(hub_cache, "someorg/somemodel", tiny_model_dir)
    message = problems(make_config("model.model_name_or_path=someorg/somemodel", "sampling.max_new_tokens=500"))
    assert "exceeds the 128 positions (max_position_embeddings) of model someorg/somemodel" in message


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "gpt2", "n_positions": 1024}, 1024),  # the names transformers maps to max_position_embeddings
    ({"model_type": "mpt", "max_seq_len": 2048}, 2048),
    ({"model_type": "llava", "text_config": {"max_position_embeddings": 4096}}, 4096),  # composite: the LM's
    ({"model_type": "llama", "max_position_embeddings": 0}, None),  # nonsense: no check, the loader decides
    ({"model_type": "llama", "max_position_embeddings": True}, None),
    ({"model_type": "llama"}, 2048),  # not in the file: transformers' class default, as the actor will load it
])
def test_positions_from_the_config_file_as_transformers_reads_them(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert pf.max_positions(str(tmp_path)) == expected


@pytest.mark.procs
def test_up_reads_the_positions_without_importing_transformers(tiny_model_dir):
    """The check runs in `rolefleet up` before any role starts: transformers' import would cost
    seconds every time."""
    code = ("import sys; from rolefleet.app.preflight import max_positions; "
            f"print(max_positions({tiny_model_dir!r}), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["128", "False"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["actor.max_sequences_per_request=15"],
         "actor.max_sequences_per_request=15 is below one step's train.prompts_per_step x "
         "train.samples_per_prompt = 8 x 2 = 16 sequences"),
        (["critic.max_sequences_per_request=15"], "critic.max_sequences_per_request=15 is below"),
        (["reward.max_items_per_request=15"], "reward.max_items_per_request=15 is below one step's "
         "train.prompts_per_step x train.samples_per_prompt = 8 x 2 = 16 samples"),
        # 16 sequences x (4 new tokens + 1 prompt token) = 80 tokens at least.
        (["actor.max_tokens_per_request=79"],
         "actor.max_tokens_per_request=79 is below one step's train.prompts_per_step x "
         "train.samples_per_prompt x (sampling.max_new_tokens + 1) = 8 x 2 x 5 = 80 tokens"),
        (["critic.max_tokens_per_request=79"], "critic.max_tokens_per_request=79 is below"),
    ],
)
def test_one_step_must_fit_every_per_request_limit(make_config, gpus, overrides, expected):
    cfg = make_config("train.samples_per_prompt=2", *overrides)
    assert expected in problems(cfg)
    at_limit = [o.rsplit("=", 1)[0] + ("=80" if "tokens" in o else "=16") for o in overrides]
    assert problems(make_config("train.samples_per_prompt=2", *at_limit)) == ""


def test_critic_limits_do_not_apply_without_a_critic(make_config, gpus):
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "critic.max_sequences_per_request=1",
                      "critic.max_tokens_per_request=1")
    assert problems(cfg) == ""


def test_the_output_dir_must_be_creatable(make_config, tmp_path, gpus):
    (tmp_path / "a-file").write_text("x")
    message = problems(make_config(f"run.output_dir={tmp_path / 'a-file' / 'run'}"))
    assert f"run.output_dir: {tmp_path / 'a-file' / 'run'} is not writable (Not a directory)" in message
    message = problems(make_config(f"run.output_dir={tmp_path / 'a-file'}"))
    assert f"run.output_dir: {tmp_path / 'a-file'} exists and is not a directory" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_the_output_dir_must_be_writable(make_config, tmp_path, gpus):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert "run.output_dir: " in problems(make_config(f"run.output_dir={locked}"))
    assert "Permission denied" in problems(make_config(f"run.output_dir={locked}"))


def test_only_the_coordinator_needs_the_output_dir(make_config, tmp_path, gpus):
    (tmp_path / "a-file").write_text("x")
    cfg = make_config(f"run.output_dir={tmp_path / 'a-file'}")
    assert problems(cfg, ["actor"], command="serve") == ""
    assert "run.output_dir" in problems(cfg, ["coordinator"], command="train")


def test_up_needs_every_gpu_of_its_groups_on_this_machine(make_config, gpus):
    gpus(2)
    assert problems(make_config("devices.actor=[0, 1]", "devices.rollout=[1]")) == ""
    message = problems(make_config("devices.actor=[0, 7]", "devices.reward=[2, 3]"))
    assert "devices.actor: GPU 7 does not exist on this machine (it has 2 GPUs)" in message
    assert "devices.reward: GPUs 2, 3 do not exist on this machine (it has 2 GPUs)" in message
    gpus(0)
    assert "devices.actor: GPU 0 does not exist on this machine (it has 0 GPUs)" in problems(
        make_config("devices.actor=[0]"))


def test_up_checks_only_the_groups_of_the_roles_it_starts(make_config, gpus):
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "devices.critic=[5]")
    assert problems(cfg) == ""
    assert "devices.critic: GPU 5 does not exist" in problems(make_config("devices.critic=[5]"))


@pytest.mark.multinode
def test_up_runs_node_entries_on_this_machine_unless_two_nodes_share_a_gpu(make_config, gpus):
    gpus(8)
    # Each node's entries are this machine's GPUs of those indices: `up` runs every node here.
    assert problems(make_config("devices.actor=['node0:0', 'node0:1', 'node1:2', 'node1:3']",
                                "devices.reward=['node1:4']", "devices.critic=['node2:5']")) == ""
    message = problems(make_config("devices.actor=['node0:0', 'node1:0']"))
    assert ("devices.actor: node0:0 and devices.actor: node1:0 would both be GPU 0 of this machine under "
            "`rolefleet up`") in message
    message = problems(make_config("devices.actor=['node0:0']", "devices.critic=['node1:0']"))
    assert "devices.actor: node0:0 and devices.critic: node1:0 would both be GPU 0" in message
    declared = make_config("devices.actor=['node0:0']", "devices.critic=['node1:0']", "devices.colocate=[[actor, critic]]")
    assert problems(declared) == ""
    assert "devices.actor: GPU 9 does not exist on this machine (it has 8 GPUs)" in problems(
        make_config("devices.actor=['node0:0', 'node1:9']"))


def test_serve_needs_as_many_visible_gpus_as_its_group_lists(make_config, gpus, monkeypatch):
    cfg = make_config("devices.actor=['node1:4', 'node1:5']")
    gpus(2)
    assert problems(cfg, ["actor"], command="serve") == "", "node entries are fine where Helm placed the role"
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert ("devices.actor: lists 2 GPUs but this process sees 1 (CUDA_VISIBLE_DEVICES is '4'"
            in problems(cfg, ["actor"], command="serve"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "(CUDA_VISIBLE_DEVICES is not set" in problems(cfg, ["actor"], command="serve")


def test_the_coordinator_never_needs_a_gpu(make_config, gpus):
    cfg = make_config("devices.actor=[0]", "devices.reward=[1]", "devices.critic=[2]",
                      "actor.address=a:1", "reward.address=r:1", "critic.address=c:1")
    assert problems(cfg, ["coordinator"], command="serve") == ""
    assert problems(cfg, ["coordinator"], command="train") == ""


def test_the_coordinator_outside_up_needs_the_role_addresses(make_config, gpus):
    message = problems(make_config(), ["coordinator"], command="train")
    assert "set actor.address (or a fixed actor.port)" in message and "critic.address" in message
    assert problems(make_config("actor.port=5000", "reward.address=r:1", "critic.address=c:1"),
                    ["coordinator"], command="train") == ""


def test_every_problem_is_reported_at_once(make_config, gpus):
    message = problems(make_config("actor.model_name_or_path=/no/model", "devices.actor=[3]",
                                   "reward.max_items_per_request=1"))
    assert message.startswith("config check failed:\n  ")
    assert len(message.splitlines()) == 4
    for key in ("actor.model_name_or_path", "devices.actor", "reward.max_items_per_request"):
        assert key in message


def test_parse_config_itself_does_not_touch_the_filesystem():
    cfg = parse_config({"model": {"model_name_or_path": "/no/such/dir"}})
    assert cfg.actor.model_name_or_path == "/no/such/dir"


def idle_warnings(caplog, cfg, roles=None, command="up") -> list[str]:
    """The warnings preflight logs about GPUs without work, once the config has passed."""
    caplog.clear()
    with caplog.at_level("WARNING", logger=pf.log.name):
        assert problems(cfg, roles, command) == ""
    return [r.getMessage() for r in caplog.records if "will idle" in r.getMessage()]


def test_a_reward_that_runs_a_cpu_rule_on_gpus_is_a_warning_that_says_how_to_silence_it(make_config, gpus, caplog,
                                                                                        tmp_path):
    gpus(8)
    [warning] = idle_warnings(caplog, make_config("devices.actor=[0, 1, 2, 3]", "devices.reward=[4, 5]"))
    assert warning.startswith("devices.reward: GPUs [4, 5] go to the reward role, but its sources run on the CPU "
                              "(exact_match: a built-in function)")
    assert "set devices.reward=[]" in warning and "ignore this warning" in warning
    # `serve reward` (compose, Helm) warns the same, and a user function is no GPU work either.
    (tmp_path / "score.py").write_text("def score(response): return 0.0\n")
    user = make_config("devices.reward=[0]", f"reward.sources=[{{kind: user, path: '{tmp_path}/score.py:score'}}]")
    [warning] = idle_warnings(caplog, user, ["reward"], "serve")
    assert "(score: a user function)" in warning


def test_a_reward_model_or_a_reward_on_the_cpu_is_no_warning(make_config, gpus, caplog, tiny_model_dir):
    gpus(8)
    with_model = make_config("devices.reward=[4]", f"reward.sources=[{{kind: model, path: '{tiny_model_dir}'}}]")
    assert idle_warnings(caplog, with_model) == []
    assert idle_warnings(caplog, make_config("devices.actor=[0, 1]")) == []  # the reward on the CPU
    assert idle_warnings(caplog, make_config("devices.actor=[0]", "devices.reward=[4]"), ["actor"], "serve") == []


def test_critic_gpus_of_an_algorithm_without_a_critic_are_a_warning(make_config, gpus, caplog):
    gpus(8)
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "devices.critic=[1]")
    [warning] = idle_warnings(caplog, cfg)
    assert warning.startswith("devices.critic: GPUs [1] go to the critic, but algorithm grpo has none")
    assert idle_warnings(caplog, make_config("devices.critic=[1]")) == []  # ppo: the critic trains on it
