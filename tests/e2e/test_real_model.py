"""The real test model end to end on the CPU: a GRPO step of SmolLM2-135M-Instruct through
`rolefleet up configs/smollm2_arithmetic.yaml` (real role processes), its chat template, the `math`
reward and evaluation on. Responses end at the end of the assistant's turn, rewards parse, and the
evaluations are logged."""

import json

import pytest
from transformers import AutoTokenizer

from tests.e2e.procs import read_metrics, rolefleet

pytestmark = [pytest.mark.e2e, pytest.mark.real_model, pytest.mark.timeout(300)]


def test_grpo_of_the_real_model_with_its_chat_template_stop_token_and_evaluation(real_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = rolefleet("up", "configs/smollm2_arithmetic.yaml", "devices=cpu",
                     f"model.model_name_or_path={real_model_dir}",
                     f"run.output_dir={out}", "train.total_steps=1", "train.prompts_per_step=2",
                     "train.samples_per_prompt=4", "sampling.max_new_tokens=32", "eval.every=1", "eval.max_prompts=4",
                     # Checkpoints and the per-step snapshots: tests/e2e/test_chaos.py; here, a gigabyte
                     # of writing each.
                     "checkpoint.at_end=false", "checkpoint.every_minutes=0", "checkpoint.snapshot.enabled=false")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # the starting policy, then after the step
        assert r["eval/prompts"] == 4 and r["eval/policy_version"] == r["step"]
        assert {"eval/math/mean", "eval/pass@1", "eval/response_length/mean", "eval/clip_ratio"} <= set(r)
        assert r["eval/errors"] == 0  # every answer went through the math reward's parser
    for r in records[1:]:
        assert r["reward/errors"] == 0 and "reward/math/mean" in r
        assert r["response_length/clip_ratio"] < 1  # some responses stopped before the cap

    im_end = AutoTokenizer.from_pretrained(real_model_dir).convert_tokens_to_ids("<|im_end|>")
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert stopped, "no evaluated response ended before the cap"
    for s in stopped:  # at the end of the turn, with nothing of a next turn written after it
        assert s["last_token_id"] == im_end
        assert "<|im_start|>" not in s["response"] and "\nuser" not in s["response"]
