"""Supervised fine-tuning through `rolefleet up` (real role processes on loopback): a chat model
trained on conversations of a JSONL file, only their assistant messages the targets; the held-out
conversations' completion loss falls."""

import json

import pytest

from tests.e2e.procs import read_metrics, rolefleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def conversations(n: int, offset: int) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 17, (i * 7) % 13
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}?"},
                                {"role": "assistant", "content": f"The sum is {a + b}."}],
                     "ground_truth": str(a + b)})
    return rows


def test_sft_trains_a_chat_model_on_its_conversations_assistant_turns(chat_model_dir, tmp_path):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in conversations(96, 0)))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in conversations(16, 500)))
    out = tmp_path / "run"
    proc = rolefleet("up", "configs/demo.yaml", "algorithm=sft", f"model.model_name_or_path={chat_model_dir}",
                     "data.task=null", f"data.path={train}", f"eval.path={held_out}", "eval.every=10",
                     "reward.function=numeric_match", f"run.output_dir={out}", "train.total_steps=20",
                     "train.prompts_per_step=16", "actor.lr=3e-3", "sampling.max_new_tokens=12")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    assert "ended FINISHED after step 20/20" in output and "completion loss" in output
    records = read_metrics(out / "metrics.jsonl")
    losses = [(r["step"], r["eval/sft_loss"]) for r in records if "eval/sft_loss" in r]
    assert [s for s, _ in losses] == [0, 10, 20]
    assert losses[-1][1] < 0.5 * losses[0][1], losses
    assert all(r["sft/tokens"] > 0 for r in records if r["step"] > 0)
