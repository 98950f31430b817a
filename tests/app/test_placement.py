"""`devices: auto`: the map chosen for 1, 2 and 8 GPUs with and without a critic or a reward model,
a model too big for any map, the CPU where there is no GPU or the config says so, the lines that
announce the choice, the map saved in the run's config, and the places that must not read `auto` as
the CPU (deploy files, a role started alone). The GPUs are given as a list of their memory: no test
needs CUDA."""

import json

import pytest
import yaml

from rolefleet.app.memory import GIB, plan
from rolefleet.app.placement import NothingFits, announce, candidates, choose_devices, placed, require_map
from rolefleet.app.shapes import SHAPES
from rolefleet.common.config import ConfigError, load_config, parse_config

H100 = 80 * GIB


def model(path, shape: str) -> str:
    """A model directory holding only the config.json of `shape` (all the planner reads)."""
    s = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "intermediate_size": s.intermediate, "vocab_size": s.vocab or 100,
        "tie_word_embeddings": s.tied, "model_type": "qwen2"}))
    return str(path)


@pytest.fixture
def small(tmp_path) -> str:
    return model(tmp_path / "small", "qwen2-0.5b")


def config(policy: str, algorithm: str = "grpo", reward_model: str | None = None, **more):
    raw = {"algorithm": algorithm, "model": {"model_name_or_path": policy}, "train": {"samples_per_prompt": 4},
           "actor": {"gradient_checkpointing": True}, "critic": {"gradient_checkpointing": True}, **more}
    if reward_model:
        raw["reward"] = {"sources": [{"kind": "function", "function": "exact_match"},
                                     {"kind": "model", "path": reward_model, "name": "rm"}]}
    return parse_config(raw)


def chosen(cfg, gpus: int) -> dict:
    """The chosen map as it is saved, without its empty groups."""
    dumped = choose_devices(cfg, [H100] * gpus).devices.model_dump()
    return dumped if isinstance(dumped, str) else {k: v for k, v in dumped.items() if v}


def test_a_config_without_devices_is_auto_and_cpu_is_a_word_of_its_own(small):
    assert config(small).devices.auto
    cpu = config(small, devices="cpu").devices
    assert not cpu.auto and cpu.is_cpu and cpu.model_dump() == "cpu"
    given = config(small, devices={"actor": [0]}).devices
    assert not given.auto and given.actor == [0]
    with pytest.raises(ConfigError, match=r"devices: 'gpu' is not a devices map nor one of its words: auto"):
        config(small, devices="gpu")
    # A dotted override inside the word starts a map: the demo's `devices: cpu` with the actor on GPU 0.
    moved = parse_config({"model": {"model_name_or_path": small}, "devices": "cpu"}, ["devices.actor=[0]"])
    assert moved.devices.actor == [0] and not moved.devices.auto


@pytest.mark.parametrize(("algorithm", "with_rm", "gpus", "expected"), [
    # One GPU: every role with GPU work shares GPU 0; rule-based rewards stay on the CPU.
    ("grpo", False, 1, {"actor": [0], "rollout": [0]}),
    ("ppo", False, 1, {"actor": [0], "critic": [0], "rollout": [0], "colocate": [["actor", "critic"]]}),
    ("ppo", True, 1, {"actor": [0], "reward": [0], "critic": [0], "rollout": [0],
                      "colocate": [["actor", "critic", "reward"]]}),
    # Two: the critic or the reward model on the second; both: they share it.
    ("grpo", False, 2, {"actor": [0, 1], "rollout": [0, 1]}),
    ("ppo", False, 2, {"actor": [0], "critic": [1], "rollout": [0]}),
    ("grpo", True, 2, {"actor": [0], "reward": [1], "rollout": [0]}),
    ("ppo", True, 2, {"actor": [0], "reward": [1], "critic": [1], "rollout": [0], "colocate": [["critic", "reward"]]}),
    # Eight: the actor on most, the critic on a quarter of the rest, a reward model on one.
    ("grpo", False, 8, {"actor": list(range(8)), "rollout": list(range(8))}),
    ("ppo", False, 8, {"actor": list(range(6)), "critic": [6, 7], "rollout": list(range(6))}),
    ("ppo", True, 8, {"actor": list(range(6)), "reward": [7], "critic": [6], "rollout": list(range(6))}),
])
def test_the_map_chosen_for_the_gpus_there_are(small, tmp_path, algorithm, with_rm, gpus, expected):
    rm = model(tmp_path / "rm", "qwen2-0.5b") if with_rm else None
    assert chosen(config(small, algorithm, rm), gpus) == expected


def test_vllm_on_several_gpus_generates_apart_from_training(small):
    cfg = config(small, actor={"rollout": {"backend": "vllm"}})
    assert chosen(cfg, 8) == {"actor": list(range(8)), "rollout": [0, 1, 2, 3]}
    assert chosen(cfg, 1) == {"actor": [0], "rollout": [0]}  # one worker runs vLLM beside its trainer


@pytest.mark.parametrize("gpus", [1, 2])
def test_vllm_engines_that_would_leave_no_gpu_to_train_are_refused(small, gpus):
    """Engines of two GPUs on an actor of two: every GPU would train and generate, the layout
    `backend_problem` refuses for vLLM; auto says so instead of choosing it."""
    cfg = config(small, actor={"rollout": {"backend": "vllm", "vllm": {"tensor_parallel_size": 2}}})
    with pytest.raises(ConfigError, match=rf"vLLM with actor.rollout.vllm.tensor_parallel_size=2 needs 3 GPUs for the actor in this "
                                          rf"layout \(2 to generate apart from training, one at least to train\), "
                                          rf"and it has {gpus} here: .*actor.rollout.backend=hf"):
        choose_devices(cfg, [H100] * gpus)
    assert chosen(cfg, 3) == {"actor": [0, 1, 2], "rollout": [0, 1]}  # one GPU left to train


def test_a_layout_too_small_for_the_engines_gives_way_to_one_that_is_not(small):
    """PPO on four GPUs with engines of three: on GPUs of its own the actor has three, none left
    to train; sharing all four with the critic leaves one."""
    from rolefleet.actor.placement import ActorPlacement, rollout_ranks
    from rolefleet.actor.rollout import backend_problem

    cfg = config(small, "ppo", actor={"rollout": {"backend": "vllm", "vllm": {"tensor_parallel_size": 3}}})
    assert [name for name, _ in candidates(cfg, 4)] == ["together"]
    placed_cfg = cfg.model_copy(update={"devices": choose_devices(cfg, [H100] * 4).devices})
    assert placed_cfg.devices.rollout == [0, 1, 2] and placed_cfg.devices.actor == [0, 1, 2, 3]
    split = ActorPlacement(4, rollout_ranks(placed_cfg)).split
    assert backend_problem("vllm", True, True, 4, split) is None  # the config's own check accepts it


def test_roles_share_the_gpus_when_gpus_of_their_own_would_not_fit(tmp_path):
    """PPO of a 7B model on four GPUs: on GPUs of its own (three) the actor's shard is larger than
    sharded over all four beside the critic's quarter; on GPUs between the two figures only the
    shared map fits, and it is the one chosen."""
    settings = {"gradient_checkpointing": True, "max_tokens_per_micro_batch": 2048, "offload": "optimizer"}
    cfg = config(model(tmp_path / "7b", "qwen2.5-7b"), "ppo", actor={**settings, "ref_offload": True},
                 critic=settings)
    fullest = {name: max(g.total for g in plan(cfg.model_copy(update={"devices": d}), H100))
               for name, d in candidates(cfg, 4)}
    assert fullest["together"] < fullest["apart"]
    placement = choose_devices(cfg, [(fullest["together"] + fullest["apart"]) / 2] * 4)
    assert {k: v for k, v in placement.devices.model_dump().items() if v} == {
        "actor": [0, 1, 2, 3], "critic": [0, 1, 2, 3], "rollout": [0, 1, 2, 3], "colocate": [["actor", "critic"]]}
    assert "the roles sharing the GPUs, which fits by the memory planner's estimate" in placement.why
    assert all(g.verdict != "over" for g in placement.plans)
    with pytest.raises(ConfigError, match=r"The closest \(the roles sharing the GPUs\) needs GPUs 0, 1, 2, 3: "
                                          r"actor [0-9.]+ \+ critic [0-9.]+ = [0-9.]+ GiB each"):
        choose_devices(cfg, [fullest["together"] * 0.9] * 4)


def test_a_model_too_big_for_any_map_is_refused_with_the_planners_figures(tmp_path):
    cfg = config(model(tmp_path / "7b", "qwen2.5-7b"), "ppo")
    with pytest.raises(ConfigError) as refused:
        choose_devices(cfg, [24 * GIB])
    message = str(refused.value)
    assert message.startswith("devices: auto: no map of actor, critic on 1 GPU of 24.0 GiB fits the memory "
                              "planner's estimate. The closest (the roles sharing the GPUs) needs GPU 0: actor ")
    assert " + critic " in message and "`rolefleet plan CONFIG --gpus 1 --gpu-gib 24.0` itemizes it" in message
    assert "actor.offload=optimizer" in message and "devices: cpu" in message
    assert "more GPUs" not in message  # every GPU of the machine is in the map already
    # The closest map comes with the error, for `rolefleet plan` to itemize.
    assert isinstance(refused.value, NothingFits)
    assert refused.value.closest.devices.actor == [0] and refused.value.closest.devices.critic == [0]
    assert [g.gpu for g in refused.value.plans] == ["0"] and refused.value.plans[0].verdict == "over"


def test_no_gpu_or_a_cpu_worker_group_is_the_cpu(small):
    assert choose_devices(config(small), []).devices.model_dump() == "cpu"
    over_nodes = config(small, actor={"workers": 4, "nodes": 2})
    placement = choose_devices(over_nodes, [H100] * 8)
    assert placement.devices.is_cpu and placement.why == "actor.nodes=2 asks for a CPU worker group"


def test_devices_cpu_stays_on_the_cpu_where_there_are_gpus(small):
    cfg = config(small, devices="cpu")
    assert placed(cfg, [H100] * 8, say=pytest.fail) is cfg  # nothing chosen, nothing said


def test_a_machine_without_cuda_places_on_the_cpu_in_one_line(small, monkeypatch, capsys):
    monkeypatch.setattr("rolefleet.app.placement.visible_gpus", lambda: [])
    cfg = placed(config(small, "ppo"))
    assert cfg.devices.is_cpu and not cfg.devices.auto
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("rolefleet: devices: auto: every role on the CPU (no CUDA GPU here); set devices to a map to "
                      "use GPUs")
    assert out[1:] == ["rolefleet:   actor: the CPU",
                       "rolefleet:   reward: the CPU (its reward functions run there; only a reward model takes a GPU)",
                       "rolefleet:   critic: the CPU", "rolefleet:   coordinator: the CPU (it holds no GPU)"]


def test_the_chosen_map_is_printed_a_line_per_role_and_as_a_map(small, monkeypatch, capsys):
    monkeypatch.setattr("rolefleet.app.placement.visible_gpus", lambda: [H100])
    cfg = placed(config(small, "ppo"))
    assert cfg.devices.actor == [0] and cfg.devices.critic == [0]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rolefleet: devices: auto: placed on 1 GPU of 80 GiB; the roles sharing the GPUs, "
                             "which fits by the memory planner's estimate (the fullest, GPU 0: ")
    assert out[0].endswith("GiB). Set devices to a map to choose yourself, or devices: cpu")
    assert out[1:] == [
        "rolefleet:   actor: GPU 0, shared with critic",
        "rolefleet:   reward: the CPU (its reward functions run there; only a reward model takes a GPU)",
        "rolefleet:   critic: GPU 0, shared with actor",
        "rolefleet:   coordinator: the CPU (it holds no GPU)",
        "rolefleet:   as a map: devices: {actor: [0], critic: [0], rollout: [0], colocate: [[actor, critic]]}"]
    pasted = yaml.safe_load(out[-1].split("as a map: ")[1])  # the line pastes into a config as it is
    assert parse_config({"model": {"model_name_or_path": small}, "algorithm": "ppo", **pasted}).devices == cfg.devices


def test_a_split_actor_is_announced_with_its_generating_gpus(small):
    cfg = config(small, actor={"rollout": {"backend": "vllm"}})
    lines = announce(cfg, choose_devices(cfg, [H100] * 4))
    assert "  actor: GPUs 0, 1, 2, 3 (generates on 0, 1, trains on 2, 3)" in lines


def test_up_saves_the_chosen_map_in_the_runs_config(small, tmp_path, monkeypatch):
    """What restarts, a resumed run and `serve` read: the map, never the word again."""
    from rolefleet import up as up_module

    monkeypatch.setattr("rolefleet.app.placement.visible_gpus", lambda: [H100, H100])
    started = []

    def stop_before_any_process(self, role, overrides, log_to_file):
        started.append(role)
        raise up_module.RoleFailed("no processes in this test")

    monkeypatch.setattr(up_module.Supervisor, "start", stop_before_any_process)
    cfg = config(small, "ppo", run={"output_dir": str(tmp_path / "run")})
    with pytest.raises(up_module.RoleFailed):
        up_module.up(cfg)
    assert started == ["actor"]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["devices"]
    assert {k: v for k, v in saved.items() if v} == {"actor": [0], "critic": [1], "rollout": [0]}
    again = load_config(tmp_path / "run" / "config.yaml")
    assert not again.devices.auto and again.devices.critic == [1]


def test_plan_shows_the_map_auto_chooses(small, tmp_path, capsys):
    from rolefleet.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "ppo", "model": {"model_name_or_path": small},
                                    "actor": {"gradient_checkpointing": True},
                                    "critic": {"gradient_checkpointing": True}}))
    assert main(["plan", str(path), "--gpus", "2", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "devices: auto: placed on 2 GPUs of 80 GiB; roles on GPUs of their own" in out
    assert "  critic: GPU 1\n" in out and "GPU 1: " in out and "(fits)" in out  # and the plan of that map
    assert main(["plan", str(path), "--gpus", "0"]) == 0
    assert "devices: auto: every role on the CPU (no CUDA GPU here)" in capsys.readouterr().out


def test_plan_itemizes_the_closest_map_when_none_fits(tmp_path, capsys):
    """The error of `devices: auto` sends the user to `rolefleet plan` for the figures: plan prints
    them for the map that came closest, then the error, and exits 1 (a plan that does not fit)."""
    from rolefleet.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "ppo", "model": {"model_name_or_path": model(tmp_path / "7b",
                                                                                            "qwen2.5-7b")}}))
    assert main(["plan", str(path), "--gpus", "1", "--gpu-gib", "24"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "devices: auto: no map fits; the closest one tried:" in out
    assert "GPU 0: " in out and "(over)" in out and "  actor: " in out and "  critic: " in out
    assert "    held  " in out  # itemized: each role's parts, not only its total
    assert "rolefleet: devices: auto: no map of actor, critic on 1 GPU of 24.0 GiB fits" in captured.err


def test_deploy_files_and_a_role_started_alone_refuse_auto(small, monkeypatch):
    from rolefleet.app.preflight import check_visible_gpus
    from rolefleet.deploy.compose import render_compose
    from rolefleet.deploy.helm import placement_values

    auto = config(small, "ppo")
    for what, call in (("a compose file", lambda: render_compose(auto, "configs/run.yaml")),
                       ("the chart's placement", lambda: placement_values(auto))):
        with pytest.raises(ValueError, match=f"devices: auto stands for the map `rolefleet up` chooses on the machine "
                                             f"it runs on, and {what} needs the map itself"):
            call()
    require_map(config(small, devices="cpu"), "a compose file")  # the CPU said explicitly: fine
    monkeypatch.setattr("rolefleet.app.preflight.gpu_count", lambda: 2)
    [problem] = check_visible_gpus(auto, ["actor"])
    assert problem.startswith("devices: auto, and this process sees 2 GPUs: a role started by itself is given no map")
    assert check_visible_gpus(auto, ["coordinator"]) == []  # it never holds a GPU
    assert check_visible_gpus(auto, ["reward"]) == []  # rule-based: the CPU is its place anyway
    monkeypatch.setattr("rolefleet.app.preflight.gpu_count", lambda: 0)
    assert check_visible_gpus(auto, ["actor"]) == []  # nothing to be silent about: the CPU is all there is
