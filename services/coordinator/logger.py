"""Per-step run metrics: metrics.jsonl, the experiment trackers (TensorBoard events by default;
W&B, MLflow: coordinator/trackers.py), a console progress bar, and a reward-curve PNG when the run
closes. One record per step, keys as in docs/metrics.md."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

from rolefleet.coordinator.trackers import TensorBoardTracker, Tracker, numeric
from rolefleet.trainer.checkpoint import write_atomic

log = logging.getLogger(__name__)


class RunLogger:
    def __init__(self, out_dir: Path, total_steps: int, progress: bool = True, report_every: int | None = None,
                 trackers: list[Tracker] | None = None, resume: bool = False):
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        # A new run starts its own record; a resumed one appends (`rewind` drops what is redone).
        self.records: list[dict] = _read_records(self.path) if resume else []
        self.jsonl = open(self.path, "a" if resume else "w")
        self.trackers = _tensorboard(out_dir) if trackers is None else trackers
        # A live bar on a terminal only; logs and CI get the periodic summary lines alone.
        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (progress and sys.stderr.isatty()))
        self.progress = progress
        self.report_every = report_every or max(1, total_steps // 10)

    def log(self, record: dict) -> None:
        self._write(record)
        # An RL step's reward and KL; an sft step's completion loss (algorithm sft).
        key, name = ("reward/mean", "reward") if "reward/mean" in record else ("sft/loss", "loss")
        shown = {name: f"{record[key]:.3f}", **({"kl": f"{record['kl']:.4f}"} if "kl" in record else {})}
        self.bar.set_postfix(**shown, step_s=f"{record['timing/step_s']:.2f}")
        self.bar.update(1)
        if self.progress and len(self.records) % self.report_every == 0:
            recent = [r for r in self.records if key in r][-self.report_every:]  # steps, not evaluations
            mean = sum(r[key] for r in recent) / len(recent)
            kl = f"  kl {record['kl']:.4f}" if "kl" in record else ""
            self.bar.write(f"step {record['step']:>5}  {name} {mean:.3f} (mean of last {len(recent)}){kl}  "
                           f"{record['timing/step_s']:.2f} s/step", file=sys.stdout)
        self._eval_line(record)

    def log_eval(self, record: dict) -> None:
        """A record of an evaluation alone (step 0: the policy before training)."""
        self._write(record)
        self._eval_line(record)

    def _write(self, record: dict) -> None:
        self.records.append(record)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for tracker in self.trackers:
            tracker.log(numeric(record), record["step"])

    def _eval_line(self, record: dict) -> None:
        if self.progress and "eval/reward/mean" in record:
            passes = "  ".join(f"{k[5:]} {v:.3f}" for k, v in record.items() if k.startswith("eval/pass@"))
            self.bar.write(f"eval  {record['step']:>5}  reward {record['eval/reward/mean']:.3f}  {passes}  length "
                           f"{record['eval/response_length/mean']:.1f}  clipped {record['eval/clip_ratio']:.2f}  "
                           f"({record['eval/prompts']:.0f} prompts, {record['eval/time_s']:.1f} s)", file=sys.stdout)

    def rewind(self, step: int, record: dict | None = None) -> list[dict]:
        """Resuming after checkpoint `step`: the records of later steps (run again now) leave the
        file; the earlier ones stay, and are returned. `record`: the checkpoint's own record of
        `step`, logged now if the file lacks it (the run ended after the checkpoint was complete and
        before its record was logged)."""
        self.records = [r for r in self.records if r.get("step", 0) <= step]
        self.jsonl.close()
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.jsonl = open(self.path, "a")
        self.bar.n = len(self.records)  # progress as of the checkpoint, also when recovering mid-run
        self.bar.refresh()
        if record is not None and record.get("step") == step and not any(r.get("step") == step for r in self.records):
            self.log(record)
        return self.records

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        for tracker in self.trackers:
            tracker.close()
        steps = [r for r in self.records if "reward/mean" in r]
        if steps:
            plot_reward_curve(steps, self.out_dir / "reward_curve.png")

    def summary(self, window: int = 10) -> str:
        """How the mean reward moved: first `window` steps against the last `window`."""
        rewards = [r["reward/mean"] for r in self.records if "reward/mean" in r]  # not evaluations alone
        losses = [r["sft/loss"] for r in self.records if "sft/loss" in r]  # algorithm sft's steps
        if not rewards and losses:
            k = min(window, len(losses))
            return (f"{len(losses)} steps; completion loss {sum(losses[:k]) / k:.3f} (first {k} steps) -> "
                    f"{sum(losses[-k:]) / k:.3f} (last {k} steps)")
        if not rewards:
            return "no steps completed"
        k = min(window, len(rewards))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        return (f"{len(rewards)} steps; mean reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps); "
                f"curve: {self.out_dir / 'reward_curve.png'}")


def _tensorboard(out_dir: Path) -> list[Tracker]:
    try:
        return [TensorBoardTracker(out_dir)]
    except ImportError:  # tensorboard is a dependency; stay useful if a slim install lacks it
        log.warning("tensorboard is not installed: no event files")
        return []


def plot_reward_curve(records: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # a dependency; a slim install still finishes its run without the picture
        log.warning("matplotlib is not installed: no %s", path.name)
        return

    matplotlib.use("Agg")  # headless: no display on CI or servers
    import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen on this import

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward/mean"] for r in records], marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(path.parent.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _read_records(path: Path) -> list[dict]:
    """The step records of a run's metrics.jsonl; a line cut short by a crash is left out."""
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                log.warning("%s: a line that is not JSON (a write cut short) is dropped", path)
    return records
