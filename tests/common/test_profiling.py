"""`<role>.profile_updates` and `actor.rollout.profile_generates`: the chosen updates of a trainer role
and generations of the actor run under torch.profiler and leave a Chrome trace and an op table per
rank; the others run as before and leave nothing."""

import json

import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.critic.core import CriticCore


def test_the_chosen_updates_are_profiled_per_role(tiny_model_dir, tmp_path):
    out = tmp_path / "profiles"
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                       ["actor.compute_dtype=float32", "actor.profile_updates=[2]", f"actor.profile_dir={out}",
                        "critic.profile_updates=[1]", f"critic.profile_dir={out}",
                        "actor.rollout.profile_generates=[2]"])
    actor, critic = ActorCore(cfg.actor), CriticCore(cfg.critic)
    sampling = SamplingParams(max_new_tokens=3, n=2, seed=0)
    samples = actor.generate(["1+2=", "3+4="], sampling)
    assert not out.exists()
    again = actor.generate(["1+2=", "3+4="], sampling)  # profiled: it samples as any other generation
    assert [s.response_ids.tolist() for s in again] == [s.response_ids.tolist() for s in samples]
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    lp = actor.compute_logprobs(batch, 1.0, include_reference=False)
    targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
    actor.update(1, 0, batch, targets, 1.0)
    assert not list(out.glob("actor-update*"))
    actor.update(2, 1, batch, targets, 1.0)
    values = critic.compute_values(batch)
    critic.update(1, batch, torch.ones_like(values), values)
    assert sorted(p.name for p in out.iterdir()) == [
        "actor-generate2-rank0.json", "actor-generate2-rank0.txt", "actor-update2-rank0.json",
        "actor-update2-rank0.txt", "critic-update1-rank0.json", "critic-update1-rank0.txt"]
    assert "aten::" in (out / "actor-generate2-rank0.txt").read_text()
    assert "aten::" in (out / "actor-update2-rank0.txt").read_text()  # the ops of the update, by time
    trace = json.loads((out / "critic-update1-rank0.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert actor.policy_version == 2  # profiled updates apply as any other
