from pathlib import Path

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
        ("reward.function=fuzzy", "unknown reward function 'fuzzy'; valid: exact_match, format, length_penalty, math, none, numeric_match, regex"),
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


def test_load_config_names_the_file_it_cannot_read(tmp_path, monkeypatch):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run:\n  name: café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"config file .*latin1.yaml is not UTF-8 text \(byte 0xe9 at offset 16\)"):
        load_config(latin1)
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_config(tmp_path)
    good = tmp_path / "good.yaml"
    good.write_text("model: {model_name_or_path: m}\n")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # root reads through file modes, so simulate it
    with pytest.raises(ConfigError, match="config file .*good.yaml cannot be read: Permission denied"):
        load_config(good)


def test_load_config_accepts_a_utf8_byte_order_mark(tmp_path):
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfmodel: {model_name_or_path: m}\nrun: {name: bom}\n")
    assert load_config(bom).run.name == "bom"


@pytest.mark.parametrize("override", ["actor.lr=[1,", "run.name={", "run.name='x", "devices.actor=[0, 1"])
def test_an_override_value_that_is_not_yaml_names_the_override(override):
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, [override])
    assert str(err.value).startswith(f"override {override!r}: the value ")
    assert "is not valid YAML (" in str(err.value)


@pytest.mark.parametrize("override", ["actor.lr=.inf", "actor.lr=.nan", "train.kl_coef=.inf",
                                      "critic.max_grad_norm=.inf", "actor.clip_ratio=.nan"])
def test_inf_and_nan_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: Input should be a finite number"):
        parse_config(BASE, [override])


def test_per_request_limits_are_positive_integers():
    cfg = parse_config(BASE, ["actor.max_tokens_per_request=4096", "reward.max_items_per_request=8"])
    assert (cfg.actor.max_tokens_per_request, cfg.reward.max_items_per_request) == (4096, 8)
    with pytest.raises(ConfigError, match="critic.max_sequences_per_request: Input should be greater than or equal to 1"):
        parse_config(BASE, ["critic.max_sequences_per_request=0"])


def test_the_config_floor_of_the_temperature_passes_the_wire_check():
    """0.01 travels as float32 (0.0099999998): what the config accepts, every role must accept."""
    import struct

    from rolefleet.actor.types import SamplingParams
    from rolefleet.common.modeling import require_temperature

    cfg = parse_config(BASE, ["sampling.temperature=0.01"])
    on_the_wire = struct.unpack("<f", struct.pack("<f", cfg.sampling.temperature))[0]
    assert on_the_wire < 0.01
    SamplingParams(temperature=on_the_wire).validate()
    assert require_temperature(on_the_wire) == on_the_wire
    with pytest.raises(ConfigError, match="sampling.temperature"):
        parse_config(BASE, ["sampling.temperature=0.0099"])


def test_roles_sharing_gpus_must_say_so():
    with pytest.raises(ConfigError, match=r"devices\.actor and devices\.critic share GPUs \[1\]: declare it with "
                                          r"devices\.colocate: \[\[actor, critic\]\]"):
        parse_config(BASE, ["devices.actor=[0, 1]", "devices.critic=[1]"])
    cfg = parse_config(BASE, ["devices.actor=[0, 1]", "devices.critic=[1]", "devices.colocate=[[actor, critic]]"])
    assert cfg.devices.colocate == [["actor", "critic"]]
    parse_config(BASE, ["devices.actor=[0]", "devices.critic=['node1:0']"])  # another node's GPU 0


def test_multi_turn_keys_are_checked_together(make_config):
    import pytest as _pytest

    from rolefleet.common.config import ConfigError

    with _pytest.raises(ConfigError, match="max_turns > 1 needs an environment"):
        make_config("actor.rollout.max_turns=3")
    cfg = make_config("actor.rollout.max_turns=3", "reward.env.name=tools", "sampling.max_new_tokens=10")
    assert cfg.actor.rollout.max_total_tokens == 30  # max_turns x max_new_tokens by default
    with _pytest.raises(ConfigError, match="not both"):
        make_config("reward.env.name=tools", "reward.env.path=x.py:step")
    with _pytest.raises(ConfigError, match="unknown tool"):
        make_config("reward.env.name=tools", "reward.env.options={tools: [browser]}")
    with _pytest.raises(ConfigError, match="data.tools"):
        make_config("data.tools=[calculator]", "data.chat_template=false")
    # Overlong shaping of a conversation measures it against the conversation's cap.
    cfg = make_config("actor.rollout.max_turns=2", "reward.env.name=tools", "train.overlong.mode=penalty",
                      "sampling.max_new_tokens=10", "actor.rollout.max_total_tokens=40")
    assert cfg.episode_cap == 40 and cfg.train.overlong.buffer_tokens == 10
    with _pytest.raises(ConfigError, match="episode's cap of 40 tokens"):
        make_config("actor.rollout.max_turns=2", "reward.env.name=tools", "train.overlong.mode=penalty",
                    "sampling.max_new_tokens=10", "actor.rollout.max_total_tokens=40", "train.overlong.buffer_tokens=41")


@pytest.mark.parametrize("field,registry", [
    ("TrainSection.kl_estimator", "KL_ESTIMATORS"), ("ActorSection.kl_loss_estimator", "KL_ESTIMATORS"),
    ("ActorSection.policy_loss", "POLICY_LOSSES"), ("ActorSection.teacher_kl", "TEACHER_KL")])
def test_a_field_s_description_lists_its_registry_s_names(field, registry):
    """The descriptions name the choices without importing the maths (the config imports no torch):
    a name registered or removed must show here too."""
    import rolefleet.algos
    import rolefleet.common.config as config

    section, name = field.split(".")
    description = getattr(config, section).model_fields[name].description
    assert " | ".join(getattr(rolefleet.algos, registry).names()) in description, description
