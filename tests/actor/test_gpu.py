"""The actor and critic cores on a CUDA device (skipped on CPU machines)."""

import pytest
import torch

from rolefleet.actor.core import ActorCore
from rolefleet.actor.types import PolicyTargets, SamplingParams
from rolefleet.common.batch import SequenceBatch
from rolefleet.common.config import parse_config
from rolefleet.common.modeling import compile_decoder_layers, lm_logprobs, load_causal_lm
from rolefleet.critic.core import CriticCore
from rolefleet.trainer.profiling import NewGraphs
from tests.helpers import save_after_one_update_over_two_workers

pytestmark = pytest.mark.gpu


def cores(model_dir, dtype, compiled=False):
    cfg = parse_config({"model": {"model_name_or_path": model_dir}},
                       # hf: where vLLM is installed, auto would pick it (tests/actor/test_vllm.py's), and its
                       # in-process engine keeps a one-process torch.distributed world a later worker group cannot join.
                       ["actor.rollout.backend=hf", "actor.kl_loss_coef=0.1", "actor.is_correction=token_truncate",
                        "actor.lr=1e-2",
                        f"actor.compute_dtype={dtype}", f"critic.compute_dtype={dtype}",
                        "actor.max_tokens_per_micro_batch=40", "critic.max_tokens_per_micro_batch=40",
                        f"actor.compile_layers={compiled}", f"critic.compile_layers={compiled}"])
    return ActorCore(cfg.actor), CriticCore(cfg.critic)


@pytest.mark.parametrize("dtype, compiled", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_actor_and_critic_train_on_cuda(tiny_model_dir, dtype, compiled):
    """compiled: `compile_layers`, the layers, the sampler and the LM head's logprob maths compiled."""
    actor, critic = cores(tiny_model_dir, dtype, compiled)
    assert actor.worker.device.type == "cuda" and next(actor.worker.model.parameters()).is_cuda
    samples = actor.generate(["1+2=", "13+4="] * 8, SamplingParams(max_new_tokens=4, n=2, seed=0))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    assert len(batch.micro_batches(40)) > 1  # the micro-batch path runs on the GPU
    lp = actor.compute_logprobs(batch, 1.0, include_reference=True)
    rollout = torch.cat([s.logprobs for s in samples])
    # fp32: the same numbers in both engines; bf16 training compute drifts from the fp32 rollout a
    # little (what the IS correction and the mismatch metric are for).
    assert (lp.logprobs - rollout).abs().max() < (1e-3 if dtype == "float32" else 0.15)
    digest = actor.digest()
    adv = torch.linspace(-1, 1, batch.num_response_tokens)
    result = actor.update(1, 0, batch, PolicyTargets(adv, lp.logprobs, lp.ref_logprobs, rollout), 1.0)
    assert actor.digest() != digest and result.model_version == 1
    assert all(p.dtype == torch.float32 for p in actor.worker.model.parameters())  # fp32 master weights
    values = critic.compute_values(batch)
    assert values.device.type == "cpu" and values.shape == (batch.num_response_tokens,)
    critic.update(1, batch, torch.ones_like(values), values)
    assert critic.compute_values(batch).mean() > values.mean()


@pytest.mark.parametrize("dtype, tolerance, compiled", [("float32", 1e-3, False), ("bfloat16", 0.1, False),
                                                        ("float32", 1e-3, True)])
def test_graph_decode_matches_a_plain_forward(tiny_model_dir, dtype, tolerance, compiled):
    """The CUDA-graph decode path records the logprobs a plain forward of the same weights gives
    for the same tokens (bf16: up to rounding of the incremental forward); compiled, with the
    compiled layers and sampler captured in the graph."""
    actor, _ = cores(tiny_model_dir, dtype, compiled)
    sampling = SamplingParams(max_new_tokens=8, n=2, seed=0, top_k=5, temperature=0.8)
    samples = actor.generate(["1+2=", "13+4=", "7="] * 4, sampling)
    assert any(buf.graph is not None for buf in actor.worker.engine._loop._states.values())  # the captured step ran
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    with torch.no_grad():
        plain, _ = lm_logprobs(actor.worker.engine.model, batch, actor.worker.device, 0.8, 64, with_entropy=False)
    recorded = torch.cat([s.logprobs for s in samples])
    assert (plain.cpu() - recorded).abs().max() < tolerance
    # The same seed gives the same samples through the replayed graph.
    again = actor.generate(["1+2=", "13+4=", "7="] * 4, sampling)
    assert [s.response_ids.tolist() for s in again] == [s.response_ids.tolist() for s in samples]



@pytest.mark.parametrize("dtype, tolerance, compiled", [("float32", 1e-3, False), ("bfloat16", 0.1, True)])
def test_compacted_batches_replay_their_own_graphs_and_a_seed_repeats_whoever_built_them(tiny_model_dir, dtype,
                                                                                          tolerance, compiled):
    """Compaction on CUDA: the smaller batches capture their graphs mid-call (their warm-up draws
    random numbers, given back), so a seeded call samples the same tokens on a core that built
    them before and on a fresh one; recorded logprobs still match a plain forward."""
    actor, _ = cores(tiny_model_dir, dtype, compiled)
    sampling = SamplingParams(max_new_tokens=40, n=4, seed=9, temperature=1.0)
    prompts = ["3+4=", "12+9=", "7+7=", "19+19=", "5+", "=", "1", "+=+"] * 2
    first = actor.generate(prompts, sampling)
    (root,) = actor.worker.engine._loop._states.values()
    assert root.compacted and all(buf.graph is not None for buf in root.compacted.values())
    batch = SequenceBatch.from_lists([s.prompt_ids for s in first], [s.response_ids for s in first])
    with torch.no_grad():
        plain, _ = lm_logprobs(actor.worker.engine.model, batch, actor.worker.device, 1.0, 64, with_entropy=False)
    assert (plain.cpu() - torch.cat([s.logprobs for s in first])).abs().max() < tolerance
    again = actor.generate(prompts, sampling)
    fresh, _ = cores(tiny_model_dir, dtype, compiled)
    other = fresh.generate(prompts, sampling)
    tokens = [s.response_ids.tolist() for s in first]
    assert [s.response_ids.tolist() for s in again] == tokens == [s.response_ids.tolist() for s in other]

def test_nvml_gpu_series_while_the_actor_generates(tiny_model_dir, monkeypatch, capsys):
    """The NVML sampler on a real GPU: the series carry the role, group and gpu labels, and the
    utilization is above zero while the actor generates (the figures are printed for the record)."""
    import threading
    import time

    from prometheus_client import REGISTRY

    from rolefleet.common.gpu_metrics import GpuSampler

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # as in a container: NVML's own order
    actor, _ = cores(tiny_model_dir, "bfloat16")
    sampler = GpuSampler.start_for("actor", [0], period_s=0.1)
    assert sampler is not None
    labels = {"role": "actor", "group": sampler.group, "gpu": "0"}
    done, peak = threading.Event(), []

    def generate():
        while not done.is_set():
            actor.generate(["1+2=", "13+4="] * 64, SamplingParams(max_new_tokens=32, n=4, seed=0))

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        for _ in range(40):
            time.sleep(0.1)
            peak.append(REGISTRY.get_sample_value("rolefleet_gpu_utilization_ratio", labels))
    finally:
        done.set()
        worker.join()
        sampler.stop()
    used = REGISTRY.get_sample_value("rolefleet_gpu_memory_used_bytes", labels)
    total = REGISTRY.get_sample_value("rolefleet_gpu_memory_total_bytes", labels)
    fragmentation = REGISTRY.get_sample_value("rolefleet_gpu_memory_fragmentation_ratio", labels)
    with capsys.disabled():
        print(f"\nNVML {labels}: utilization peak {max(peak):.2f}, median {sorted(peak)[len(peak) // 2]:.2f}; "
              f"memory used {used / 2**30:.2f} of {total / 2**30:.1f} GiB; fragmentation {fragmentation}")
    assert max(peak) > 0 and 0 < used <= total
    assert fragmentation is not None and 0 <= fragmentation < 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoints_on_cuda_restore_the_weights_optimizer_and_next_update(tiny_model_dir, tmp_path, dtype):
    """A checkpoint saved on the GPU loads into fresh cores: the same weights, version, ledger and
    critic values, and the next update of each gives the same weights as the original's."""
    actor, critic = cores(tiny_model_dir, dtype)
    samples = actor.generate(["1+2=", "13+4="] * 4, SamplingParams(max_new_tokens=4, n=2, seed=0))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    lp = actor.compute_logprobs(batch, 1.0, include_reference=True)
    targets = PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens), lp.logprobs, lp.ref_logprobs,
                            torch.cat([s.logprobs for s in samples]))
    actor.update(1, 0, batch, targets, 1.0)
    values = critic.compute_values(batch)
    critic.update(1, batch, torch.ones_like(values), values)
    actor.save_checkpoint(1, str(tmp_path / "actor"))
    critic.save_checkpoint(1, str(tmp_path / "critic"))

    actor2, critic2 = cores(tiny_model_dir, dtype)
    actor2.load_checkpoint(str(tmp_path / "actor"))
    critic2.load_checkpoint(str(tmp_path / "critic"))
    assert actor2.digest() == actor.digest() and critic2.digest() == critic.digest()
    assert actor2.policy_version == 1 and actor2.ledger.last_step == 1
    assert torch.equal(critic2.compute_values(batch), critic.compute_values(batch))
    # Adam's moments came back too: the next update lands on the same weights.
    for a in (actor, actor2):
        a.update(2, 1, batch, targets, 1.0)
    assert actor2.digest() == actor.digest()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp_over_two_gpus_saves_shards_that_one_gpu_loads(tiny_model_dir, tmp_path):
    """Two FSDP2 workers over NCCL save their shards; one GPU process loads them resharded."""
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir},
                        "actor": {"compute_dtype": "bfloat16", "lr": 1e-2, "workers": 2, "sharding": "fsdp",
                                  "max_tokens_per_micro_batch": 40}}, [])
    _, digest, _, _ = save_after_one_update_over_two_workers(cfg, str(tmp_path / "actor"))
    single = ActorCore(cfg.actor.model_copy(update={"workers": 1}))
    single.load_checkpoint(str(tmp_path / "actor"))
    assert single.worker.device.type == "cuda" and single.digest() == digest and single.policy_version == 1


def test_compiled_layers_train_on_any_token_count_with_one_graph(tiny_model_dir):
    """`compile_layers`: one layer graph for forward and backward serves a micro-batch of a few
    hundred tokens and one past Inductor's size heuristic for fusing the norm's backward reductions
    (tokens x hidden >= 5 Mi); before `layer_compile_options`, the second recompiled every layer."""
    model = load_causal_lm(tiny_model_dir, torch.device("cuda")).to(torch.bfloat16)
    compile_decoder_layers(model)
    graphs = NewGraphs("test")
    tokens = -(-(5 << 20) // model.config.hidden_size) * 2  # twice the threshold's token count
    for rows, width in ((2, 256), (16, -(-tokens // 16))):
        ids = torch.randint(3, model.config.vocab_size, (rows, width), device="cuda")
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().mean().backward()
        made, _ = graphs.take()
        assert made > 0 if (rows, width) == (2, 256) else made == 0, (rows, width, made)


@pytest.mark.parametrize("compiled", [False, True])
def test_lora_on_cuda_keeps_its_frozen_weights_in_bf16_and_syncs_what_it_trains(tiny_model_dir, compiled):
    """LoRA on CUDA: the frozen weights in the compute dtype, the adapters fp32 with their optimizer
    state alone; after an update the engine samples from the merged weights (its logprobs are the
    trainer's, up to bf16 rounding)."""
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                       ["actor.rollout.backend=hf", "actor.lr=1e-2", "actor.lora.rank=8", "actor.kl_loss_coef=0.1",
                        "actor.max_tokens_per_micro_batch=40", f"actor.compile_layers={compiled}"])
    actor = ActorCore(cfg.actor)
    model = actor.worker.model
    dtypes = {p.requires_grad: p.dtype for p in model.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    samples = actor.generate(["1+2=", "13+4="] * 8, SamplingParams(max_new_tokens=4, n=2, seed=0))
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    lp = actor.compute_logprobs(batch, 1.0, include_reference=True)
    assert torch.allclose(lp.logprobs, lp.ref_logprobs, atol=1e-5)  # B starts at zero (other kernels: rounding)
    for step in (1, 2):
        actor.update(step, step - 1, batch, PolicyTargets(torch.linspace(-1, 1, batch.num_response_tokens),
                                                          lp.logprobs, lp.ref_logprobs), 1.0)
    state = [t for s in actor.worker.trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert sum(t.numel() for t in state) == 2 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    after = actor.compute_logprobs(batch, 1.0, include_reference=True)
    assert (after.logprobs - lp.logprobs).abs().max() > 0.05 and torch.equal(after.ref_logprobs, lp.ref_logprobs)
    fresh = actor.generate(["1+2=", "13+4="] * 8, SamplingParams(max_new_tokens=4, n=2, seed=1))
    fresh_batch = SequenceBatch.from_lists([s.prompt_ids for s in fresh], [s.response_ids for s in fresh])
    recomputed = actor.compute_logprobs(fresh_batch, 1.0, include_reference=True)
    sampled = torch.cat([s.logprobs for s in fresh])
    # Nearer the trained policy than the base model by far (an engine left on the base would be the reverse).
    to_policy, to_base = ((sampled - lp).abs().mean() for lp in (recomputed.logprobs, recomputed.ref_logprobs))
    assert to_policy < 0.02 and to_policy < to_base / 3, (to_policy, to_base)


def test_the_teacher_s_top_k_and_the_kl_term_on_cuda_compile_nothing_after_warm_up(tiny_model_dir, tmp_path):
    """Distillation's top k on CUDA: the teacher's k tokens and logprobs equal a full fp32 softmax of
    the same model on the CPU; the student's term trains compiled in bf16 (the warm-up covered its
    passes: no graph after the start) and its KL falls."""
    from rolefleet.app.tiny_model import make_tiny_model
    from rolefleet.common.config import TeacherSection
    from rolefleet.common.modeling import load_causal_lm
    from rolefleet.teacher.core import TeacherCore
    from rolefleet.trainer.profiling import compiled_graphs

    other = str(make_tiny_model(tmp_path / "teacher", task="addition", warm_start_steps=30, seed=3))
    teacher = TeacherCore(TeacherSection(model_name_or_path=other, compute_dtype="float32"), student=tiny_model_dir)
    assert teacher.device.type == "cuda"
    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                       ["actor.rollout.backend=hf", "actor.compute_dtype=bfloat16", "actor.lr=2e-3",
                        "actor.compile_layers=true", "actor.compile_warmup=true", "actor.teacher_kl_coef=2.0",
                        f"teacher.model_name_or_path={other}", "teacher.top_k=8", "actor.ppo_epochs=1",
                        "actor.num_mini_batches=1", "actor.max_tokens_per_micro_batch=40"])
    actor = ActorCore(cfg.actor)
    samples = actor.generate(["1+2=", "13+4=", "7+7="] * 4, SamplingParams(max_new_tokens=6, n=2, seed=0))
    made = compiled_graphs()  # the warm-up's and the decode's (the engine's shapes are its own budget's)
    batch = SequenceBatch.from_lists([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    top = teacher.compute_logprobs(batch, 1.0, top_k=8).top
    cpu = load_causal_lm(other, torch.device("cpu"))
    with torch.no_grad():
        every = torch.cat([torch.log_softmax(cpu(input_ids=torch.cat([p, r])[None]).logits[0].float(), -1)
                           [len(p) - 1:len(p) + len(r) - 1] for p, r in zip(batch.prompts(), batch.responses())])
    expected = every.topk(8, dim=-1)
    torch.testing.assert_close(top.logprobs, expected.values, atol=1e-4, rtol=1e-4)
    assert (top.ids == expected.indices).float().mean() > 0.99  # ties within rounding may swap
    zeros = torch.zeros(batch.num_response_tokens)
    seen = []
    for step in range(1, 5):
        old = actor.compute_logprobs(batch, 1.0, include_reference=False).logprobs
        seen.append(actor.update(step, step - 1, batch, PolicyTargets(zeros, old, teacher_top=top), 1.0)
                    .stats["teacher_kl"])
    assert compiled_graphs() == made, "a graph compiled after the warm-up"
    assert seen[-1] < 0.8 * seen[0], seen


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_after_compile_warmup_no_width_or_row_count_compiles_on_cuda(tiny_model_dir, packed):
    """`compile_warmup` on CUDA, where graphs are also guarded on their sizes' alignment: micro-
    batches of every width from 2 to 40 tokens (one row, rows of one length, ragged rows; a single
    response token) through the update and the logprob passes compile nothing after the start."""
    from rolefleet.trainer.profiling import compiled_graphs

    cfg = parse_config({"model": {"model_name_or_path": tiny_model_dir}},
                       ["actor.rollout.backend=hf", "actor.compute_dtype=bfloat16", "actor.compile_layers=true",
                        "actor.compile_warmup=true", "actor.ppo_epochs=1", "actor.num_mini_batches=1",
                        "actor.kl_loss_coef=0.1", f"actor.sequence_packing={str(packed).lower()}"])
    actor = ActorCore(cfg.actor)
    made, late = compiled_graphs(), []
    for width in range(2, 41):
        p = max(1, width // 2)
        for shapes in ([(p, width - p)], [(p, width - p)] * 3, [(p, width - p), (p + 1, width - p - 2)],
                       [(width - 1, 1)] * 2):
            if min(r for _, r in shapes) < 1 or min(q for q, _ in shapes) < 1:
                continue
            batch = SequenceBatch.from_lists([torch.full((q,), 5) for q, _ in shapes],
                                             [torch.full((r,), 7) for _, r in shapes])
            lp = actor.compute_logprobs(batch, 1.0, include_reference=True)
            n = batch.num_response_tokens
            actor.update(actor.policy_version + 1, actor.policy_version, batch,
                         PolicyTargets(torch.linspace(-1, 1, n), lp.logprobs, lp.ref_logprobs), 1.0)
            if compiled_graphs() != made:
                late.append((shapes, compiled_graphs() - made))
                made = compiled_graphs()
    assert late == [], late
