"""`<role>.profile_updates` and `actor.rollout.profile_generates`: the chosen updates of a trainer role
and generations of the actor run under torch.profiler and leave a Chrome trace and an op table per
rank; the others run as before and leave nothing."""

import json

import pytest
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


@pytest.mark.procs
def test_new_graphs_counts_what_torch_compile_made_between_takes():
    from rolefleet.trainer.profiling import NewGraphs

    fn = torch.compile(lambda x: torch.sin(x) * 2)
    graphs = NewGraphs("actor")
    assert graphs.take() == (0, 0.0)
    fn(torch.randn(4, 3))
    made, seconds = graphs.take()
    assert made == 1 and seconds > 0  # and the time it took
    fn(torch.randn(4, 3))  # a shape it covers
    assert graphs.take() == (0, 0.0)
    fn(torch.randn(4, 3, dtype=torch.float64))  # a new dtype: another graph
    assert graphs.take()[0] == 1


def test_a_critic_update_counts_the_graphs_made_since_the_last_one(tiny_model_dir):
    from prometheus_client import REGISTRY

    critic = CriticCore(parse_config({"model": {"model_name_or_path": tiny_model_dir}}, []).critic)
    batch = SequenceBatch.from_lists([torch.tensor([5, 6, 7])], [torch.tensor([8, 9])])
    values = critic.compute_values(batch)
    assert critic.update(1, batch, torch.ones_like(values), values).stats["compiled_graphs"] == 0  # eager
    before = REGISTRY.get_sample_value("rolefleet_compiled_graphs_total", {"role": "critic"})
    critic.worker.new_graphs.seen -= 3  # as if a new shape had compiled three graphs since
    assert critic.update(2, batch, torch.ones_like(values), values).stats["compiled_graphs"] == 3
    assert REGISTRY.get_sample_value("rolefleet_compiled_graphs_total", {"role": "critic"}) == before + 3
