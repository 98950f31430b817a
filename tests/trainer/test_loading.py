"""Loading a sharded trainer's model straight into its shards (`trainer/loading.py`): the same weights
as the plain load, each rank holding only its part while it loads, and a whole load where the
checkpoint cannot be read by shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.modeling import load_causal_lm
from rolefleet.trainer.loading import SafetensorsCheckpoint, build_on_meta, is_pending

pytestmark = pytest.mark.procs


def _rank(rank: int, world: int, store: str, model_dir: str, out: str, auto: str) -> None:
    """One gloo rank: a skeleton, sharded as a trainer shards it, then its shards and buffers saved."""
    import torch.distributed as dist

    from rolefleet.common.modeling import decoder_layers
    from rolefleet.trainer.ranks import Ranks
    from rolefleet.trainer.sharding import shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        before = _reset_peak_kib()
        model = build_on_meta({"causal": AutoModelForCausalLM, "base": AutoModel}[auto], model_dir)
        shard(model, decoder_layers(model), torch.device("cpu"), None, Ranks.of(None))
        peak = _status_kib("VmHWM") - before
        local = {name: p.to_local().clone() for name, p in model.named_parameters()}
        full = {name: p.full_tensor() for name, p in model.named_parameters()}  # a collective: every rank
        torch.save({"local": local, "full": full, "buffers": dict(model.named_buffers()), "peak_kib": peak,
                    "eos": model.config.eos_token_id if auto == "base" else model.generation_config.eos_token_id},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _reset_peak_kib() -> int:
    """The resident size now, the high-water mark reset to it (the imports' peak is not loading's)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    """The ranks are forked from a server that imported this module (torch, transformers) once: a
    spawned rank imported them itself, 4 s of CPU and most of its time, seven times a test. The
    server has run nothing but imports, so forking it is safe; it is stopped with the module."""
    import multiprocessing.forkserver as forkserver

    forkserver.set_forkserver_preload([__name__])
    yield
    forkserver._forkserver._stop()


def run_ranks(world: int, model_dir: Path, out: Path, auto: str = "causal") -> list[dict]:
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(world, str(out / "store"), str(model_dir), str(out), auto), nprocs=world,
                       start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    """Odd row counts (the vocabulary's 67 and more), so the last rank's pieces are shorter, in bf16 as
    real checkpoints are stored; tied embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("bf16") / "model", hidden=48, layers=3, dtype=torch.bfloat16)


def test_a_backbone_reads_a_causal_lms_checkpoint_without_its_head(bf16_model, tmp_path):
    plain = AutoModel.from_pretrained(bf16_model, dtype=torch.float32)
    (got,) = run_ranks(1, bf16_model, tmp_path, auto="base")
    assert got["full"].keys() == dict(plain.named_parameters()).keys()
    for name, value in plain.named_parameters():
        assert torch.equal(got["full"][name], value.detach()), name


def test_each_rank_reads_its_chunk_of_the_plain_loads_weights_and_holds_less_with_more_ranks(tmp_path):
    # Large enough (~65 MB of bf16, 130 MB as fp32 masters) that the shards dwarf allocator noise;
    # a vocabulary (67 rows) that 4 ranks split unevenly.
    model_dir = make_tiny_model(tmp_path / "model", hidden=512, layers=8, dtype=torch.bfloat16)
    runs = {world: run_ranks(world, model_dir, tmp_path / str(world)) for world in (1, 2, 4)}
    plain = load_causal_lm(str(model_dir), torch.device("cpu"))
    expected = dict(plain.named_parameters())
    for r, got in enumerate(runs[4]):
        assert got["local"].keys() == expected.keys()
        for name, value in expected.items():
            assert got["local"][name].dtype == torch.float32  # the fp32 master copy, cast from bf16
            assert torch.equal(got["local"][name], torch.chunk(value.detach(), 4)[r]), name
            assert torch.equal(got["full"][name], value.detach()), name
        # Buffers are not in the checkpoint: computed as the plain load computes them, not left empty.
        for name, buffer in plain.named_buffers():
            assert torch.equal(got["buffers"][name], buffer), name
        assert got["eos"] == plain.generation_config.eos_token_id
    # Each rank's peak is a fixed overhead (the libraries' pages a forked rank maps as it first runs
    # them, gloo's buffers: ~43 MB, more than a quarter of the model) plus its share of the fp32 model,
    # so the peaks' ratios sit near the bar while their differences are exact: going from 1 to 2 ranks
    # must save half the model a rank, from 2 to 4 a quarter (measured: 100.4% and 100.1% of that).
    model_kib = sum(v.numel() * 4 for v in expected.values()) / 1024
    peaks = {world: max(r["peak_kib"] for r in ranks) for world, ranks in runs.items()}
    assert peaks[1] - peaks[2] > 0.8 * model_kib / 2, (peaks, model_kib)
    assert peaks[2] - peaks[4] > 0.8 * model_kib / 4, (peaks, model_kib)


def test_a_checkpoint_that_is_not_readable_by_shard_loads_whole(bf16_model, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for f in bf16_model.iterdir():
        if f.name != "model.safetensors":
            (bin_dir / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(bf16_model / "model.safetensors"), bin_dir / "pytorch_model.bin")
    assert build_on_meta(AutoModelForCausalLM, str(bin_dir)) is None

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in bf16_model.iterdir():
        if f.name != "model.safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    weights = load_file(bf16_model / "model.safetensors")
    save_file({k.replace("mlp.", "feed_forward."): v for k, v in weights.items()}, renamed / "model.safetensors")
    assert build_on_meta(AutoModelForCausalLM, str(renamed)) is None

    skeleton = build_on_meta(AutoModelForCausalLM, str(bf16_model))
    assert is_pending(skeleton) and all(p.is_meta for p in skeleton.parameters())


def test_a_sharded_checkpoints_index_names_each_tensors_file(bf16_model, tmp_path):
    weights = load_file(bf16_model / "model.safetensors")
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    checkpoint = SafetensorsCheckpoint.open(tmp_path)
    assert {k: p.name for k, p in checkpoint.files.items()} == {k: f for f, keys in halves.items() for k in keys}
    assert checkpoint.shapes == {k: tuple(v.shape) for k, v in weights.items()}
