"""Step records reach the experiment trackers chosen in `tracking.backends`: MLflow (read back from
its store) and Weights & Biases in offline mode (no network), besides metrics.jsonl; a backend that
is not installed is a config error naming the key."""

import pytest

from rolefleet.app.preflight import check_tracking
from rolefleet.common.config import ConfigError, parse_config
from rolefleet.coordinator.logger import RunLogger
from rolefleet.coordinator.trackers import missing_backends, open_trackers

MODEL = {"model": {"model_name_or_path": "unused"}}
RECORDS = [{"step": 1, "reward/mean": 0.25, "kl": 0.01, "timing/step_s": 1.5, "note": "text is skipped"},
           {"step": 2, "reward/mean": 0.75, "kl": 0.02, "timing/step_s": 1.25, "note": "text is skipped"}]


def run_with(backends, tmp_path, **options):
    trackers = open_trackers(backends, tmp_path, "try1", "proj", {"algorithm": "grpo", "actor": {"lr": 1e-6}},
                             **options)
    logger = RunLogger(tmp_path, len(RECORDS), progress=False, trackers=trackers)
    for record in RECORDS:
        logger.log(record)
    logger.close()
    return trackers


@pytest.mark.procs
def test_mlflow_gets_every_numeric_key_at_its_step_and_the_config(tmp_path):
    from mlflow import MlflowClient

    [tracker] = run_with(["mlflow"], tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the default store: in the run dir
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "try1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    history = client.get_metric_history(tracker.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    assert "note" not in run.data.metrics and run.data.params["actor.lr"] == "1e-06"


@pytest.mark.procs
def test_wandb_offline_keeps_the_run_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    [tracker] = run_with(["wandb"], tmp_path, wandb_mode="offline")
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()  # wandb's own record format: the logged keys and values are in it
    assert b"reward/mean" in data and b"0.75" in data and b"timing/step_s" in data


@pytest.mark.procs
def test_tensorboard_by_default_and_several_at_once(tmp_path):
    cfg = parse_config(MODEL, [])
    assert cfg.tracking.backends == ["tensorboard"]
    run_with(["tensorboard", "mlflow"], tmp_path)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "mlflow.db").exists()


def test_backend_choice_is_checked(monkeypatch):
    with pytest.raises(ConfigError, match="tracking.backends"):
        parse_config(MODEL, ["tracking.backends=[neptune]"])
    with pytest.raises(ConfigError, match="listed twice"):
        parse_config(MODEL, ["tracking.backends=[wandb, wandb]"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert missing_backends(["wandb", "tensorboard"]) == ["wandb (pip install wandb)"]
    cfg = parse_config(MODEL, ["tracking.backends=[wandb]"])
    assert check_tracking(cfg) == ["tracking.backends: wandb (pip install wandb) is not installed"]
