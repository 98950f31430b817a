"""Experiment trackers the step records go to besides metrics.jsonl (always written):
TensorBoard (a dependency), Weights & Biases and MLflow where installed, chosen by
`tracking.backends`. Each gets the numeric keys of every record at its step, and the resolved
config once; W&B runs offline with `tracking.wandb_mode: offline` (no network; `wandb sync`
uploads later), MLflow defaults to a SQLite store in the run directory."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Protocol

from rolefleet.algos.registry import Registry

# The package each backend imports, and what installs it (preflight names both when it is missing).
PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow (or mlflow-skinny with sqlalchemy and alembic)")}


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


TRACKERS: Registry = Registry("tracking backend")


def missing_backends(names: list[str]) -> list[str]:
    """'name (how to install it)' for each chosen backend whose package is not importable."""
    return [f"{n} ({PACKAGES[n][1]})" for n in names if importlib.util.find_spec(PACKAGES[n][0]) is None]


def open_trackers(names: list[str], out_dir: Path, run_name: str, project: str, config: dict[str, Any],
                  wandb_mode: str = "online", mlflow_uri: str | None = None) -> list[Tracker]:
    options = {"out_dir": out_dir, "run_name": run_name, "project": project, "config": config,
               "wandb_mode": wandb_mode, "mlflow_uri": mlflow_uri}
    return [TRACKERS.get(name)(**options) for name in names]


def numeric(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool)}


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    def __init__(self, out_dir: Path, **_: Any):
        from torch.utils.tensorboard import SummaryWriter  # optional tracker: loaded only when asked for

        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


@TRACKERS.register("wandb")
class WandbTracker:
    def __init__(self, out_dir: Path, run_name: str, project: str, config: dict[str, Any], wandb_mode: str, **_: Any):
        import wandb  # optional dependency

        self.run = wandb.init(project=project, name=run_name, config=config, dir=str(out_dir), mode=wandb_mode,
                              reinit="create_new")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


@TRACKERS.register("mlflow")
class MlflowTracker:
    def __init__(self, out_dir: Path, run_name: str, project: str, config: dict[str, Any], mlflow_uri: str | None,
                 **_: Any):
        from mlflow import MlflowClient  # optional dependency
        from mlflow.entities import Metric, Param  # the same optional dependency

        self._metric = Metric

        # A client of its own, not mlflow's process-wide active run: nothing leaks between runs.
        self.client = MlflowClient(mlflow_uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}")
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        # The config as parameters (dotted keys), not an artifact: no artifact store to set up.
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in _flatten(config).items()])

    def log(self, metrics: dict[str, float], step: int) -> None:
        # MLflow keys allow [A-Za-z0-9_-./ ]: the record's keys (reward/mean) pass as they are.
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
