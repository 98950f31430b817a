"""A role over two gloo worker processes gives the numbers of one process, sharded (FSDP2) or
replicated (the test process is rank 0; the single-process results are taken before the group
exists, since ranks are process-wide)."""

import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.actor.worker import ActorWorker
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.errors import FailedPrecondition, InvalidArgument
from rolefleet.critic.core import CriticCore
from rolefleet.critic.worker import CriticWorker
from rolefleet.trainer.profiling import compiled_graphs
from rolefleet.trainer.workers import WorkerGroup
from tests.helpers import save_after_one_update_over_two_workers

pytestmark = [pytest.mark.timeout(240), pytest.mark.procs]
COMMON = {"compute_dtype": "float32", "lr": 1e-2, "num_threads": 1, "max_tokens_per_micro_batch": 20,
          "num_mini_batches": 2, "ppo_epochs": 2}


@pytest.fixture(autouse=True)
def one_thread():
    """The test process's cores (the single-process reference, and rank 0) on the workers' one
    thread (`num_threads` above): the same kernels in the same order, so an exact comparison of
    weights holds. At two threads against one, CPU reductions may round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(model_dir, sharding):
    return parse_config({"model": {"model_name_or_path": model_dir},
                         "actor": {**COMMON, "kl_loss_coef": 0.1, "entropy_coef": 0.01, "workers": 2,
                                   "sharding": sharding},
                         "critic": {**COMMON, "workers": 2, "sharding": sharding}}, [])


@pytest.mark.parametrize("sharding", ["fsdp", "replicate"])
def test_two_actor_workers_give_the_logprobs_and_update_of_one(tiny_model_dir, sharding):
    cfg = config(tiny_model_dir, sharding)
    single = ActorCore(cfg.actor)
    samples = single.generate(["1+2=", "13+4=", "7+7=", "9+1=", "11+11="], SamplingParams(max_new_tokens=5, n=2, seed=3))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    lp = single.compute_logprobs(batch, 1.0, include_reference=True)
    targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
    one = single.update(1, 0, batch, targets, 1.0)
    after_one = single.compute_logprobs(batch, 1.0, include_reference=False).logprobs
    digest_before = ActorCore(cfg.actor).digest()

    group = WorkerGroup.start("actor", 2, cfg.model_dump(mode="json"), ActorWorker.from_config)
    try:
        double = ActorCore(cfg.actor, group=group)
        assert double.worker.trainer.sharded == (sharding == "fsdp")
        assert double.digest() == digest_before  # the sharded weights, gathered
        lp2 = double.compute_logprobs(batch, 1.0, include_reference=True)
        # Two workers split the micro-batches finer (a count both share evenly): other padded widths,
        # the same numbers up to float32 summation order.
        for a, b in ((lp.logprobs, lp2.logprobs), (lp.ref_logprobs, lp2.ref_logprobs), (lp.entropy, lp2.entropy)):
            assert torch.allclose(a, b, atol=2e-4)
        two = double.update(1, 0, batch, targets, 1.0)
        # The same new weights: the same logprobs from them (the update moved them by far more).
        after_two = double.compute_logprobs(batch, 1.0, include_reference=False).logprobs
        assert (after_one - lp.logprobs).abs().max() > 1e-2
        assert torch.allclose(after_two, after_one, atol=2e-4)
        for key in ("loss", "pg_loss", "grad_norm", "kl_loss", "entropy"):
            assert two.stats[key] == pytest.approx(one.stats[key], rel=1e-4, abs=1e-6), key
        # Rollouts: each worker its share of the prompts, back in prompt order, n samples each.
        more = double.generate(["1+2=", "5+5=", "3+3="], SamplingParams(max_new_tokens=4, n=2, seed=1))
        assert [(s.prompt_index, s.sample_index) for s in more] == [(p, i) for p in range(3) for i in range(2)]
        assert all(s.policy_version == 1 for s in more)
    finally:
        group.stop()


@pytest.mark.parametrize("sharding", ["fsdp", "replicate"])
def test_two_critic_workers_give_the_values_and_update_of_one(tiny_model_dir, sharding):
    cfg = config(tiny_model_dir, sharding)
    batch = SequenceBatch.from_lists([torch.tensor([4, 41, 5, 45]), torch.tensor([6, 45]), torch.tensor([7])],
                                     [torch.tensor([9, 2]), torch.tensor([10, 4, 2]), torch.tensor([3])])
    returns, old = torch.tensor([1.0, 0.5, -1.0, 2.0, 0.0, 3.0]), torch.zeros(6)
    single = CriticCore(cfg.critic)
    one = single.update(1, batch, returns, old)
    values_one = single.compute_values(batch)

    group = WorkerGroup.start("critic", 2, cfg.model_dump(mode="json"), CriticWorker.from_config)
    try:
        double = CriticCore(cfg.critic, group=group)
        assert double.worker.trainer.sharded == (sharding == "fsdp")
        two = double.update(1, batch, returns, old)
        for key in ("vf_loss", "vf_grad_norm"):
            assert two.stats[key] == pytest.approx(one.stats[key], rel=1e-4, abs=1e-6), key
        assert torch.allclose(double.compute_values(batch), values_one, atol=1e-5)
    finally:
        group.stop()


def test_workers_must_match_the_gpus_of_the_group(tiny_model_dir):
    from rolefleet.app.preflight import check_workers

    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                       ["actor.workers=3", "devices.actor=[0, 1]", "critic.workers=2"])
    assert check_workers(cfg, ["actor", "critic"]) == [
        "actor.workers: 3 workers, but devices.actor lists 2 GPUs (one worker per GPU; leave it unset)"]
    gpus = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                        ["devices.actor=[0, 1]", "devices.rollout=[1]", "actor.rollout.workers=1"])
    assert check_workers(gpus, ["actor"]) == ["actor.rollout.workers: the actor has GPUs; devices.rollout names "
                                              "the ones that generate (leave it unset)"]
    cpu = parse_config({"model": {"model_name_or_path": tiny_model_dir}}, ["actor.workers=2", "actor.rollout.workers=2"])
    assert check_workers(cpu, ["actor"]) == ["actor.rollout.workers: 2 of the actor's 2 workers would generate, "
                                             "leaving none to train; at most actor.workers - 1"]


def test_rollout_ranks_follow_the_rollout_gpus_within_the_actor_group(tiny_model_dir):
    from rolefleet.actor.placement import ActorPlacement, rollout_ranks

    def ranks(*overrides):
        return rollout_ranks(parse_config({"model": {"model_name_or_path": tiny_model_dir}}, list(overrides)))

    assert ranks("devices.actor=[4, 5, 6, 7]", "devices.rollout=[6, 4]") == (0, 2)
    assert ranks("devices.actor=[4, 5]") == ()
    assert ranks("actor.workers=3", "actor.rollout.workers=1") == (0,)
    split = ActorPlacement(4, (0, 2))
    assert split.split and split.train_ranks == [1, 3] and split.sync_ranks == [0, 1, 2]
    assert not ActorPlacement(2, (0, 1)).split and ActorPlacement(2, (0, 1)).train_ranks == [0, 1]


def test_vllm_serves_a_multi_worker_actor_only_with_rollout_gpus_apart():
    from rolefleet.actor.rollout import backend_problem, choose_backend

    problem = backend_problem("vllm", True, True, 2)
    assert "this actor has 2 workers that each train and generate: set devices.rollout" in problem
    assert choose_backend("auto", True, True, 2) == "hf"
    assert backend_problem("vllm", True, True, 2, split=True) is None
    assert choose_backend("auto", True, True, 3, split=True) == "vllm"
    assert choose_backend("auto", True, False, 3, split=True) == "hf"


def test_tensor_parallel_engines_over_the_rollout_gpus(tiny_model_dir):
    """Engines of k GPUs: the rollout ranks in runs of k, the first of each driving it; the
    communicator's ranks follow (trainer 0, then one per rollout GPU)."""
    from rolefleet.actor.placement import ActorPlacement, engine_size, rollout_ranks
    from rolefleet.app.preflight import check_rollout_backend

    p = ActorPlacement(6, (2, 3, 4, 5), engine_size=2)
    assert p.engine_ranks == [2, 4] and p.engine_members(4) == [4, 5] and p.train_ranks == [0, 1]
    assert "2 engines of 2 GPUs (driven by ranks [2, 4])" in p.describe()
    assert ActorPlacement(3, (1, 2)).engine_ranks == [1, 2]  # one engine per rollout GPU (hf, or vLLM's default)
    assert ActorPlacement(2).engine_ranks == [0, 1]  # colocated: every rank generates

    def cfg(*overrides):
        return parse_config({"model": {"model_name_or_path": tiny_model_dir}}, list(overrides))

    split = cfg("devices.actor=[0, 1, 2, 3]", "devices.rollout=[1, 2, 3]", "actor.rollout.vllm.tensor_parallel_size=2")
    placement = ActorPlacement(4, rollout_ranks(split))
    with pytest.raises(ValueError, match=r"tensor_parallel_size: the 3 rollout GPUs \(devices.rollout\) do not form"):
        engine_size(split.actor, "vllm", placement)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: engines of 2 GPUs need actor.rollout.backend=vllm"):
        engine_size(split.actor, "hf", placement)
    colocated = cfg("devices.actor=[0, 1]", "actor.rollout.vllm.tensor_parallel_size=2", "actor.rollout.backend=hf")
    assert check_rollout_backend(colocated, ["actor"], "up") == [
        "actor.rollout.vllm.tensor_parallel_size: engines of 2 GPUs need actor.rollout.backend=vllm and the actor's "
        "rollout GPUs apart from its training GPUs (devices.rollout, a part of devices.actor)"]
    assert check_rollout_backend(cfg("devices.actor=[0, 1]", "actor.rollout.backend=hf"), ["actor"], "up") == []


@pytest.mark.parametrize("world", [2, 3])
def test_split_actor_trains_on_some_workers_and_generates_with_the_new_weights_on_others(tiny_model_dir, world):
    """Rank 0 generates; the other ranks train (two of them: FSDP over their own process group) and
    broadcast each update's weights to it in several buckets. The samples it draws afterwards carry
    the logprobs of the one-process trainer's updated weights and the new version."""
    from rolefleet.actor.placement import rollout_ranks

    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir},
                        "actor": {**COMMON, "kl_loss_coef": 0.1, "workers": world,
                                  "rollout": {"workers": 1, "sync_bucket_mb": 1, "batch_size": 2}}}, [])
    assert rollout_ranks(cfg) == (0,)
    prompts, sampling = ["1+2=", "13+4=", "7+7="], SamplingParams(max_new_tokens=5, n=2, seed=3)
    single = ActorCore(cfg.actor)
    samples = single.generate(prompts, sampling)
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    lp = single.compute_logprobs(batch, 1.0, include_reference=True)
    targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs, lp.ref_logprobs)
    one = single.update(1, 0, batch, targets, 1.0)
    digest_after = single.digest()

    group = WorkerGroup.start("actor", world, cfg.model_dump(mode="json"), ActorWorker.from_config)
    try:
        split = ActorCore(cfg.actor, rollout_ranks=rollout_ranks(cfg), group=group)
        w = split.worker
        assert w.placement.split and w.trainer is None and w.model is None  # rank 0 only generates
        before = split.generate(prompts, sampling)
        assert all(s.policy_version == 0 for s in before)
        # Its only rollout worker is this process: samples stream per engine call (2 sequences each).
        assert [len(chunk) for chunk in split.generate_chunks(prompts, sampling)] == [2, 2, 2]
        assert torch.allclose(split.compute_logprobs(batch, 1.0, include_reference=True).logprobs, lp.logprobs,
                              atol=1e-5)
        two = split.update(1, 0, batch, targets, 1.0)
        assert two.stats["loss"] == pytest.approx(one.stats["loss"], rel=1e-4, abs=1e-6)
        assert two.stats["weight_sync_s"] > 0
        if world == 2:  # one trainer: the very same weights (sharded, the sums run in another order)
            assert split.digest() == digest_after
        assert torch.allclose(split.compute_logprobs(batch, 1.0, include_reference=False).logprobs,
                              single.compute_logprobs(batch, 1.0, include_reference=False).logprobs, atol=1e-5)
        after = split.generate(prompts, sampling)
        assert all(s.policy_version == 1 for s in after)
        fresh = SequenceBatch.from_lists([s.prompt_ids for s in after], [s.response_ids for s in after])
        recorded = torch.cat([s.logprobs for s in after])
        assert torch.allclose(recorded, single.compute_logprobs(fresh, 1.0, include_reference=False).logprobs,
                              atol=1e-4)
        with pytest.raises(FailedPrecondition, match="expects step 2"):  # a trainer's refusal reaches rank 0
            split.update(3, 1, batch, targets, 1.0)
    finally:
        group.stop()


def test_a_sharded_checkpoint_loads_into_one_process(tiny_model_dir, tmp_path):
    """Two FSDP2 workers save their shards (torch.distributed.checkpoint); one process loads them
    back resharded: the same weights, version and ledger, and the same next update."""
    cfg = config(tiny_model_dir, "fsdp")
    saved, digest, batch, targets = save_after_one_update_over_two_workers(cfg, str(tmp_path / "actor"))
    # Each rank wrote its own files (`__<rank>_<file>.distcp`, several files a rank: its writer's threads).
    assert {p.name.split("_")[2] for p in (tmp_path / "actor" / "weights").glob("*.distcp")} == {"0", "1"}
    single = ActorCore(cfg.actor)
    assert single.load_checkpoint(str(tmp_path / "actor")) == saved
    assert single.digest() == digest and single.policy_version == 1 and single.ledger.last_step == 1
    assert single.generate(["1+2="], SamplingParams(max_new_tokens=4, n=2, seed=5))[0].policy_version == 1
    assert single.update(2, 1, batch, targets, 1.0).model_version == 2


def test_a_sharded_snapshot_loads_onto_its_ranks_and_is_refused_by_one_process(tiny_model_dir, tmp_path):
    """Two FSDP2 workers copy their shards into their own snapshot files (the replicated rest in the
    first rank's) and load them back after another update; one process refuses it whole, saying why."""
    cfg = config(tiny_model_dir, "fsdp")
    path = tmp_path / "shm" / "instance" / "step-00000001" / "actor"
    saved, _, _, _ = save_after_one_update_over_two_workers(cfg, str(path), str(tmp_path / "shm"))
    assert sorted(p.name for p in (path / "weights").iterdir()) == ["rank-0.layout", "rank-1.layout"]
    single = ActorCore(cfg.actor)
    single.snapshot_root = str(tmp_path / "shm")
    before = single.digest()
    with pytest.raises(InvalidArgument, match="written by 2 ranks; this trainer has 1"):
        single.load_checkpoint(str(path))
    assert single.digest() == before and not single.ledger.broken and saved.step == 1


def test_an_update_counts_the_graphs_every_worker_compiled(tiny_model_dir):
    """`compiled_graphs` is the group's count: rank 0's (this process's) alone would miss a graph
    only another rank's micro-batches made it compile."""
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir},
                        "critic": {**COMMON, "workers": 2, "sharding": "replicate", "compile_layers": True,
                                   "compile_warmup": False, "num_mini_batches": 1, "ppo_epochs": 1}}, [])
    batch = SequenceBatch.from_lists([torch.tensor([4, 41, 5, 45]), torch.tensor([6, 45])] * 2,
                                     [torch.tensor([9, 2]), torch.tensor([10, 4, 2])] * 2)
    group = WorkerGroup.start("critic", 2, cfg.model_dump(mode="json"), CriticWorker.from_config)
    try:
        critic = CriticCore(cfg.critic, group=group)
        here = compiled_graphs()
        made = critic.update(1, batch, torch.ones(10), torch.zeros(10)).stats["compiled_graphs"]
        assert compiled_graphs() > here  # this rank compiled its micro-batches' layers
        assert made > compiled_graphs() - here  # ... and the other rank its own
    finally:
        group.stop()
