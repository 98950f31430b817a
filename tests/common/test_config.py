import pytest

from rolefleet.common.config import ConfigError, apply_override, load_config, parse_config

BASE = {"model": {"model_name_or_path": "some/model"}}


def test_defaults_fill_role_models_from_model_section():
    cfg = parse_config(BASE)
    assert cfg.actor.model_name_or_path == "some/model"
    assert cfg.actor.ref_model_name_or_path == "some/model"
    assert cfg.critic.model_name_or_path == "some/model"
    assert str(cfg.run.out) == "runs/rolefleet"
    assert cfg.roles() == ["actor", "reward", "critic", "coordinator"]


def test_dotted_overrides_parse_yaml_values():
    cfg = parse_config(BASE, ["actor.lr=1e-6", "algorithm=grpo", "train.samples_per_prompt=4",
                              "devices.actor=[0, 1]", "run.output_dir=runs/try1"])
    assert cfg.actor.lr == 1e-6
    assert cfg.algorithm == "grpo" and "critic" not in cfg.roles()
    assert cfg.devices.actor == [0, 1]
    assert str(cfg.run.out) == "runs/try1"


def test_override_leaves_the_callers_dict_alone():
    raw = {"model": {"model_name_or_path": "m"}, "actor": {"lr": 1.0}}
    parse_config(raw, ["actor.lr=2.0"])
    assert raw["actor"]["lr"] == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.lrr=1", "actor.lrr: unknown key"),
        ("actor.lr=-1", "actor.lr: Input should be greater than 0"),
        ("train.kl_estimator=k9", "train.kl_estimator"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("devices.rollout=[5]", "not in the actor's group"),
        ("devices.reward=['nodeA:x']", "is not a GPU index"),
        ("devices.critic=[1, 1]", "duplicate GPUs"),
        ("run.name=has space", "run.name"),
        ("algorithm=ppo2", "unknown algorithm 'ppo2'; valid: ppo, grpo, drgrpo, rloo"),
        ("actor.policy_loss=foo", "unknown policy loss 'foo'; valid: gspo, ppo_clip"),
        ("actor.loss_agg_mode=mean", "valid: seq-mean-token-mean, seq-mean-token-sum"),
        ("actor.is_correction=tis", "valid: none, seq_mask, seq_truncate, token_mask, token_truncate"),
        ("train.kl_controller=pid", "valid: adaptive, fixed"),
        ("actor.dual_clip=0.5", "actor.dual_clip: Input should be greater than 1"),
        ("algorithm=rloo", "set train.samples_per_prompt >= 2"),
        ("train.kl_controller=adaptive", "kl_controller adaptive scales kl_coef, which is 0"),
        ("data.task=sums", "unknown task 'sums'; built-in tasks: addition"),
        ("data.path=/no/such.jsonl", "data.path /no/such.jsonl is not a file"),
        ("reward.function=fuzzy", "unknown reward function 'fuzzy'; valid: exact_match, numeric_match"),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, [override])
    assert message in str(err.value)


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_override({}, "actor.lr")
    with pytest.raises(ConfigError, match="is not a section"):
        apply_override({"run": 3}, "run.name=x")


def test_model_path_is_required():
    with pytest.raises(ConfigError, match="model_name_or_path"):
        parse_config({})


def test_device_groups_in_verl_form_with_nodes():
    cfg = parse_config(BASE, ["devices.actor=[0, 1, 2, 3]", "devices.rollout=[0, 1]",
                              "devices.reward=['node1:4', 'node1:5']"])
    assert cfg.devices.local_indices("actor") == [0, 1, 2, 3]
    assert cfg.devices.local_indices("reward") == [4, 5]


def test_load_config_reports_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(listy)


def test_shipped_demo_config_validates():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    assert cfg.algorithm == "ppo" and "critic" in cfg.roles()


def test_algorithm_presets_fill_defaults_the_user_did_not_set():
    ppo = parse_config(BASE)
    assert ppo.train.whiten_advantages is True and ppo.actor.loss_agg_mode == "token-mean"
    dr = parse_config(BASE, ["algorithm=drgrpo", "train.samples_per_prompt=4", "sampling.max_new_tokens=7"])
    assert dr.actor.loss_agg_mode == "seq-mean-token-sum-norm" and dr.train.norm_adv_by_std is False
    assert dr.actor.loss_norm_length == 7 and dr.roles() == ["actor", "reward", "coordinator"]
    mine = parse_config(BASE, ["algorithm=drgrpo", "train.samples_per_prompt=4", "actor.loss_agg_mode=token-mean",
                               "actor.clip_ratio=0.1"])
    assert mine.actor.loss_agg_mode == "token-mean" and mine.actor.clip_ratio_high == 0.1
    with pytest.raises(ConfigError, match="dual_clip is not defined for policy_loss gspo"):
        parse_config(BASE, ["actor.policy_loss=gspo", "actor.dual_clip=3"])


def test_clip_range_defaults_follow_the_policy_loss():
    gspo = parse_config(BASE, ["actor.policy_loss=gspo"])
    assert (gspo.actor.clip_ratio, gspo.actor.clip_ratio_high) == (3e-4, 4e-4)
    ppo = parse_config(BASE, ["actor.clip_ratio_high=0.28"])
    assert (ppo.actor.clip_ratio, ppo.actor.clip_ratio_high) == (0.2, 0.28)
    mine = parse_config(BASE, ["actor.policy_loss=gspo", "actor.clip_ratio=1e-3"])
    assert (mine.actor.clip_ratio, mine.actor.clip_ratio_high) == (1e-3, 1e-3)


def test_a_role_on_port_0_needs_an_address_to_be_dialled():
    cfg = parse_config(BASE)
    with pytest.raises(ConfigError, match="set actor.address"):
        cfg.actor.dial_address("actor")
    assert parse_config(BASE, ["actor.port=5000"]).actor.dial_address("actor") == "127.0.0.1:5000"
    assert parse_config(BASE, ["actor.address=actor:7"]).actor.dial_address("actor") == "actor:7"
