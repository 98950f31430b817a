"""The `rolefleet` command: every config and CLI error exits 2 at once, naming the key, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rolefleet import cli

# Far below a model load: a config error must be found before any role starts.
FAST_S = 20.0


def rolefleet(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "rolefleet.cli", *args], env=env, cwd=cwd,
                                capture_output=True, text=True, timeout=3 * FAST_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rolefleet {' '.join(args)} was still running after {3 * FAST_S:.0f}s: it started")
    result.elapsed = time.monotonic() - start
    return result


def assert_config_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    for text in expected:
        assert text in result.stderr, output
    assert result.elapsed < FAST_S, f"took {result.elapsed:.1f}s: something started"


@pytest.fixture
def config_file(tiny_model_dir, tmp_path) -> Path:
    """A valid run config: the tiny model, a small step, outputs under tmp_path."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"name": "cli", "output_dir": str(tmp_path / "out")},
        "model": {"model_name_or_path": tiny_model_dir},
        "sampling": {"max_new_tokens": 4},
        "train": {"total_steps": 1, "prompts_per_step": 4},
    }))
    return path


@pytest.fixture
def nothing_starts(monkeypatch):
    """In-process commands fail the test at once if they get past the config instead of starting
    a cluster."""
    def started(*args, **kwargs):
        pytest.fail("a role or cluster was started")
    monkeypatch.setattr("rolefleet.serve.run", started)
    monkeypatch.setattr("rolefleet.up.up", started)


@pytest.mark.procs
def test_a_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: café\n".encode("latin-1"))
    assert_config_error(rolefleet("up", str(path)), f"config file {path} is not UTF-8 text")


@pytest.mark.procs
def test_a_config_path_that_is_a_directory_or_missing(tmp_path):
    assert_config_error(rolefleet("train", str(tmp_path)), f"config file {tmp_path} is a directory")
    assert_config_error(rolefleet("up", str(tmp_path / "nope.yaml")), "nope.yaml does not exist")


@pytest.mark.procs
@pytest.mark.parametrize("override", ["actor.lr=[1,", "run.name={"])
def test_an_override_that_is_not_yaml(config_file, override):
    assert_config_error(rolefleet("up", str(config_file), override),
                        f"override {override!r}: the value", "is not valid YAML")


@pytest.mark.procs
def test_an_unwritable_output_dir(config_file, tmp_path):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "run"
    assert_config_error(rolefleet("up", str(config_file), f"run.output_dir={out}"),
                        f"run.output_dir: {out} is not writable (Not a directory)")


@pytest.mark.procs
def test_a_missing_model_directory_is_found_before_serve_loads_anything(config_file, tmp_path):
    (tmp_path / "runs").mkdir()  # so `runs/demo-modle` is a typo of a local path, not a hub id
    result = rolefleet("serve", "actor", "--config", str(config_file), "model.model_name_or_path=runs/demo-modle",
                       cwd=tmp_path)
    assert_config_error(result, "actor.model_name_or_path, actor.ref_model_name_or_path",
                        "model directory runs/demo-modle does not exist")


@pytest.mark.procs
def test_up_refuses_a_gpu_this_machine_does_not_have(config_file):
    assert_config_error(rolefleet("up", str(config_file), "devices.actor=[7]"),
                        "devices.actor: GPU 7 does not exist on this machine (it has 0 GPUs)")


@pytest.mark.procs
def test_serve_refuses_a_group_larger_than_the_gpus_it_sees(config_file):
    assert_config_error(rolefleet("serve", "actor", "--config", str(config_file), "devices.actor=[0, 1]"),
                        "devices.actor: lists 2 GPUs but this process sees 0 (CUDA_VISIBLE_DEVICES is '';")


@pytest.mark.procs
def test_an_infinite_learning_rate(config_file):
    assert_config_error(rolefleet("up", str(config_file), "actor.lr=.inf"),
                        "actor.lr: Input should be a finite number")


@pytest.mark.procs
def test_responses_longer_than_the_models_positions(config_file):
    assert_config_error(rolefleet("up", str(config_file), "sampling.max_new_tokens=500"),
                        "sampling.max_new_tokens: 500 plus at least one prompt token exceeds the 128 positions")


@pytest.mark.procs
def test_a_step_larger_than_a_request_may_carry(config_file):
    result = rolefleet("train", str(config_file), "train.samples_per_prompt=4", "actor.max_sequences_per_request=8",
                       "reward.max_items_per_request=8", "actor.address=a:1", "reward.address=r:1",
                       "critic.address=c:1")
    assert_config_error(result, "actor.max_sequences_per_request=8 is below one step's train.prompts_per_step x "
                        "train.samples_per_prompt = 4 x 4 = 16 sequences", "reward.max_items_per_request=8")


@pytest.mark.procs
def test_serve_applies_the_overrides_after_config(config_file):
    # The override reaches the config: its unknown key is what fails, not the command line.
    assert_config_error(rolefleet("serve", "reward", "--config", str(config_file), "reward.bogus=1"),
                        "reward.bogus: unknown key")


@pytest.mark.parametrize("form", [
    ["serve", "reward", "reward.bogus=1", "--config", "{config}"],
    ["serve", "reward", "--config", "{config}", "--ready-file", "{ready}", "reward.bogus=1"],
    ["serve", "reward", "x.y=1", "--config", "{config}", "reward.bogus=1"],
    ["up", "{config}", "reward.bogus=1"],
    ["train", "{config}", "--", "reward.bogus=1"],
    ["train", "{config}", "reward.bogus=1"],
])
def test_every_command_applies_the_overrides_wherever_they_stand(config_file, tmp_path, capsys, nothing_starts,
                                                                form):
    args = [a.format(config=config_file, ready=tmp_path / "ready.json") for a in form]
    assert cli.main(args) == 2
    assert "reward.bogus: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["serve", "reward", "--config", "{config}", "--bogus"],
    ["serve", "reward", "--config", "{config}", "not-an-override"],
    ["status", "--address", "127.0.0.1:1", "actor.lr=1"],
    ["tiny-model", "out", "actor.lr=1"],
])
def test_anything_else_left_over_is_still_an_error(config_file, capsys, nothing_starts, args):
    with pytest.raises(SystemExit) as exit_:
        cli.main([a.format(config=config_file) for a in args])
    assert exit_.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--log-level", "loud", "up", "{config}"],
    ["tiny-model", "out", "--task", "sums"],
])
def test_a_bad_option_value_is_a_usage_error(config_file, capsys, nothing_starts, args):
    with pytest.raises(SystemExit) as exit_:
        cli.main([a.format(config=config_file) for a in args])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_serve_starts_the_role_with_the_overrides_after_config(config_file, monkeypatch):
    started = {}

    def fake_run(role, cfg, ready_file=None, node_rank=0):
        started.update(role=role, cfg=cfg, ready_file=ready_file, node_rank=node_rank)
        return 0

    monkeypatch.setattr("rolefleet.serve.run", fake_run)
    monkeypatch.delenv("ROLEFLEET_NODE_RANK", raising=False)
    monkeypatch.delenv("ROLEFLEET_POD_NAME", raising=False)
    argv = ["serve", "reward", "--config", str(config_file), "--ready-file", "r.json",
            "reward.function=numeric_match", "reward.num_threads=1"]
    assert cli.main(argv) == 0
    assert started["role"] == "reward" and started["ready_file"] == "r.json" and started["node_rank"] == 0
    assert (started["cfg"].reward.function, started["cfg"].reward.num_threads) == ("numeric_match", 1)


@pytest.mark.multinode
def test_serve_takes_its_node_rank_from_the_flag_or_the_environment(config_file, monkeypatch, capsys):
    started = {}
    monkeypatch.setattr("rolefleet.serve.run", lambda role, cfg, ready_file=None, node_rank=0:
                        started.update(node_rank=node_rank) or 0)
    argv = ["serve", "actor", "--config", str(config_file), "actor.workers=4", "actor.nodes=2"]
    assert cli.main([*argv, "--node-rank", "1"]) == 0 and started["node_rank"] == 1
    monkeypatch.setenv("ROLEFLEET_POD_NAME", "run1-rolefleet-actor-1")  # a StatefulSet pod's ordinal
    assert cli.main(argv) == 0 and started["node_rank"] == 1
    monkeypatch.setenv("ROLEFLEET_NODE_RANK", "0")  # before the pod name
    assert cli.main(argv) == 0 and started["node_rank"] == 0
    monkeypatch.setenv("ROLEFLEET_NODE_RANK", "one")
    assert cli.main(argv) == 2
    assert "ROLEFLEET_NODE_RANK='one' is not a node rank: a whole number from 0" in capsys.readouterr().err


@pytest.mark.parametrize("devices", [["devices.actor=[0]"], ["devices=cpu"]])
def test_plan_refuses_gpus_for_a_config_whose_devices_are_given(config_file, capsys, devices):
    """--gpus N chooses the map of devices: auto; with a map or cpu it would be silently ignored."""
    assert cli.main(["plan", str(config_file), *devices, "--gpus", "2", "--gpu-gib", "80"]) == 2
    captured = capsys.readouterr()
    assert "rolefleet: plan --gpus: applies to devices: auto only" in captured.err
    assert captured.out == ""  # no plan printed for a map the user may think was placed on 2 GPUs
    assert cli.main(["plan", str(config_file), *devices, "--gpu-gib", "80"]) == 0  # the map, planned as it is


def test_train_preflights_before_the_coordinator_starts(config_file, capsys, nothing_starts):
    assert cli.main(["train", str(config_file)]) == 2  # no role addresses in the config
    assert "set actor.address (or a fixed actor.port)" in capsys.readouterr().err


def test_tiny_model_into_an_unwritable_place(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    assert cli.main(["tiny-model", str(tmp_path / "a-file" / "model"), "--task", "addition",
                     "--warm-start-steps", "100000"]) == 2  # found before the warm start, or this never ends
    assert f"tiny-model: cannot write {tmp_path / 'a-file' / 'model'}: Not a directory" in capsys.readouterr().err


def test_status_without_a_coordinator_says_so(capsys, tmp_path):
    assert cli.main(["status", "--address", "127.0.0.1:1"]) == 1  # port 1: nothing listens
    assert "rolefleet: no run status from 127.0.0.1:1: " in capsys.readouterr().err
    assert cli.main(["status", "--run", str(tmp_path)]) == 1  # no coordinator of a run there has started
    assert f"{tmp_path / 'coordinator.json'} does not exist: no coordinator of a run in" in capsys.readouterr().err
    assert cli.main(["status"]) == 1
    assert "say which run: --run DIR (its run.output_dir), --address HOST:PORT or --http URL" in capsys.readouterr().err


@pytest.mark.procs
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "actor.example.internal"])
def test_serve_beyond_loopback_refuses_to_start_without_a_token_or_mutual_tls(config_file, monkeypatch, host):
    monkeypatch.delenv("ROLEFLEET_TOKEN", raising=False)
    result = rolefleet("serve", "reward", "--config", str(config_file), f"reward.host={host}", "reward.port=0")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"rolefleet: reward: reward.host={host} is reachable beyond this machine, and the run has no token" \
        in result.stderr
    for key in ("security.token_file", "$ROLEFLEET_TOKEN", "mutual: true", "security.allow_unauthenticated=true"):
        assert key in result.stderr
    assert result.elapsed < FAST_S, "the reward loaded before the refusal"


def test_the_coordinators_control_plane_beyond_loopback_needs_the_token_too(config_file, monkeypatch):
    from rolefleet.common.config import load_config
    from rolefleet.rpc.server import StartupError
    from rolefleet.serve import run_security

    monkeypatch.delenv("ROLEFLEET_TOKEN", raising=False)
    cfg = load_config(config_file, ["coordinator.http_enabled=true", "coordinator.http_host=0.0.0.0"])
    with pytest.raises(StartupError, match=r"coordinator: coordinator\.http_host=0\.0\.0\.0 is reachable beyond"):
        run_security(cfg, "coordinator")
    monkeypatch.setenv("ROLEFLEET_TOKEN", "a-token-of-this-run-0123456789")
    assert run_security(cfg, "coordinator").token == "a-token-of-this-run-0123456789"
    monkeypatch.delenv("ROLEFLEET_TOKEN")
    open_on_purpose = load_config(config_file, ["coordinator.http_enabled=true", "coordinator.http_host=0.0.0.0",
                                                "security.allow_unauthenticated=true"])
    assert run_security(open_on_purpose, "coordinator").token is None
    assert run_security(load_config(config_file), "coordinator").token is None  # loopback: open is fine


@pytest.mark.parametrize("args, message", [
    (["--hidden", "-1"], "--hidden: must be >= 8 and a multiple of 4, got -1"),
    (["--hidden", "10"], "--hidden: must be >= 8 and a multiple of 4, got 10"),
    (["--layers", "0"], "--layers: must be >= 1, got 0"),
    (["--warm-start-steps", "x"], "--warm-start-steps: 'x' is not an integer"),
])
def test_tiny_model_sizes_are_checked_before_building(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tiny-model", str(tmp_path / "m"), *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("content, message", [
    ("", "holds no records"),
    ("not json\n", ":1: not JSON"),
    ('{"prompt": "1+1=", "ground_truth": "2"}\n[1, 2]\n', ":2: expected a JSON object"),
    ('{"prompt": 1}\n', "'prompt' must be a non-empty string, got 1"),
    ('{"prompt": "q", "ground_truth": null}\n', "'ground_truth' must be a string or a number"),
    (b"\xff\xfe{}\n", "is not UTF-8"),
])
@pytest.mark.procs
def test_a_bad_data_file_is_found_before_any_role_starts(config_file, tmp_path, content, message, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    if content == "":  # one case through the real command (a process): exit 2 at once, nothing started
        assert_config_error(rolefleet("up", str(config_file), f"data.path={data}"), "data.path: ", message)
        return
    # The rest in-process, through the same entry point: preflight refuses before `up` starts a role.
    assert cli.main(["up", str(config_file), f"data.path={data}"]) == 2
    err = capsys.readouterr().err
    assert "data.path: " in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("overrides, threads", [((), 1), (("coordinator.num_threads=3",), 3)])
def test_the_coordinator_runs_torch_on_one_thread_unless_told(config_file, monkeypatch, overrides, threads):
    """Its per-step tensor work is small; a thread per core stalled it on a shared GPU node."""
    import asyncio

    import torch

    from rolefleet.common.config import load_config
    from rolefleet.serve import serve_role

    async def no_coordinator(cfg, ready_file, security):
        return None

    seen = []
    monkeypatch.setattr("rolefleet.coordinator.server.run_coordinator", no_coordinator)
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    asyncio.run(serve_role("coordinator", load_config(config_file, list(overrides))))
    assert seen == [threads]


@pytest.mark.parametrize("num_threads, gpu, expected", [(None, True, [1]), (None, False, []), (3, True, [3]),
                                                        (3, False, [3])])
def test_a_role_that_drives_a_gpu_runs_torch_on_one_thread_unless_told(monkeypatch, num_threads, gpu, expected):
    """`<role>.num_threads` unset: one thread where the process drives a GPU (its CPU work is batch
    glue), torch's default (untouched) where the role computes on the CPU."""
    import torch

    from rolefleet.trainer.threads import set_threads

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    set_threads(num_threads)
    assert seen == expected
