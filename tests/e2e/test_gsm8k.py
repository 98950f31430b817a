"""The step from the demo to a real run, on the CPU, as docs/coming-from-verl-trl.md gives it:
`rolefleet data gsm8k` prepares the project's GSM8K-format sample (as a save_to_disk copy of GSM8K
would be), then `rolefleet up configs/gsm8k.yaml` (real role processes) trains on its train split,
chat messages through the model's chat template, GRPO with the math and format rewards, and
evaluates on its test split; the run completes and logs each source's reward and the evaluations."""

import shutil
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from rolefleet.app.tiny_model import TINY_CHAT_TEMPLATE
from tests.e2e.procs import read_metrics, rolefleet

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_gsm8k_example_config_runs_and_logs_per_source_rewards(tiny_model_dir, tmp_path):
    model = tmp_path / "chat-model"  # the tiny model, given a chat template as a chat model has
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(model)

    data = tmp_path / "gsm8k"
    prep = rolefleet("data", "gsm8k", str(data), "--source", str(REPO / "examples" / "gsm8k_sample.parquet"),
                     "--test-source", str(REPO / "examples" / "gsm8k_sample_test.jsonl"))
    printed, _ = prep.communicate(timeout=60)
    assert prep.returncode == 0 and f"{data}/test.parquet: 16 rows" in printed, printed

    out = tmp_path / "run"
    proc = rolefleet("up", "configs/gsm8k.yaml", "devices=cpu", f"model.model_name_or_path={model}",
                     f"run.output_dir={out}", f"data.path={data}/train.parquet", f"eval.path={data}/test.parquet",
                     "train.total_steps=2", "train.prompts_per_step=4", "train.samples_per_prompt=2",
                     "sampling.max_new_tokens=8", "data.max_prompt_tokens=100", "data.overlong=truncate",
                     "eval.max_prompts=4", "actor.num_threads=1")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    everything = read_metrics(out / "metrics.jsonl")
    # The starting policy evaluated (a record of its own, step 0), and again after the last step.
    evaluations = [r for r in everything if "eval/reward/mean" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    assert all(r["eval/prompts"] == 4 and r["eval/correct/mean"] == 0.0 and r["eval/errors"] == 0 for r in evaluations)
    assert "eval      0  reward 0.000  pass@1 0.000" in output
    records = [r for r in everything if "reward/mean" in r]
    assert [r["step"] for r in records] == [1, 2]
    # Both sources scored every sample (the tiny model cannot write '#', so both give 0 here).
    for r in records:
        assert r["reward/correct/mean"] == 0.0 and r["reward/format/mean"] == 0.0 and r["reward/errors"] == 0
    # The load's counts: every prompt kept, the long ones cut to the limit through the template.
    assert records[0]["data/records"] == 64 and records[0]["data/filtered"] == 0 and records[0]["data/truncated"] > 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert [s["name"] for s in saved["reward"]["sources"]] == ["correct", "format"]
