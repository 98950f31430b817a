"""`rolefleet up` turns the per-step snapshots off, saying why, where two of the trainers' state do
not fit in the snapshot directory or beside the offloaded state; where they fit it leaves them on."""

import json

from rolefleet.app.memory import GIB, ModelDims
from rolefleet.app.snapshot_budget import fitting_snapshots
from rolefleet.common.config import parse_config

# Qwen2.5-7B's dimensions: 7.6B parameters, 12 bytes each of trainer state.
QWEN_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False, "model_type": "qwen2"}


def config_for(tmp_path, *overrides, model=QWEN_7B):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(model))
    return parse_config({"algorithm": "grpo", "train": {"samples_per_prompt": 2},
                         "model": {"model_name_or_path": str(tmp_path / "model")},
                         "run": {"output_dir": str(tmp_path / "run")}}, list(overrides))


def test_snapshots_that_do_not_fit_in_their_directory_are_turned_off_with_the_reason(tmp_path, capsys):
    cfg = config_for(tmp_path)
    need = 2 * 12 * ModelDims.read(cfg.actor.model_name_or_path).params  # GRPO: the actor alone
    off = fitting_snapshots(cfg, host=1024 * GIB, free=100 * GIB, offloaded=0.0)
    assert not off.checkpoint.snapshot.enabled and cfg.checkpoint.snapshot.enabled  # a copy; the given one unchanged
    said = capsys.readouterr().out
    assert said.startswith("rolefleet: checkpoint.snapshot is off for this run: two snapshots of the trainers' "
                           f"state take {need / GIB:.1f} GiB")
    assert "has 100.0 GiB free" in said and "checkpoint.every_minutes=30" in said
    kept = fitting_snapshots(cfg, host=1024 * GIB, free=need + GIB, offloaded=0.0)
    assert kept.checkpoint.snapshot.enabled and capsys.readouterr().out == ""


def test_snapshots_count_beside_the_offloaded_state_in_host_memory(tmp_path, capsys):
    cfg = config_for(tmp_path)
    state = 12 * ModelDims.read(cfg.actor.model_name_or_path).params
    host = 3 * state  # two copies of the state fit within 90% of it, with a little offloaded state
    assert fitting_snapshots(cfg, host=host, free=10 * state, offloaded=0.5 * state).checkpoint.snapshot.enabled
    off = fitting_snapshots(cfg, host=host, free=10 * state, offloaded=state)
    assert not off.checkpoint.snapshot.enabled
    assert f"with the {state / GIB:.1f} GiB of offloaded state over 90%" in capsys.readouterr().out


def test_snapshots_turned_off_by_the_config_or_not_sizable_here_are_left_as_they_are(tmp_path):
    off = config_for(tmp_path, "checkpoint.snapshot.enabled=false")
    assert fitting_snapshots(off, host=1.0, free=1.0, offloaded=0.0) is off
    tiny = config_for(tmp_path, model={"model_type": "llama"})  # no dimensions to size it by
    assert fitting_snapshots(tiny, host=1.0, free=1.0, offloaded=0.0) is tiny
