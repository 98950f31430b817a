"""`rolefleet export`: a trainer checkpoint (whole or FSDP-sharded) becomes a Hugging Face model
directory with exactly the trained weights, which transformers loads and generates from."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolefleet import cli
from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.export import DTYPE_CHOICES, ExportError, export_checkpoint
from rolefleet.trainer.checkpoint import MANIFEST, save_hf_files, save_trainer, step_dir, write_json
from rolefleet.trainer.ranks import Ranks
from tests.e2e.procs import rolefleet

STEP = 12


def train_one_step(model: torch.nn.Module, seed: int = 0) -> torch.optim.Optimizer:
    """One AdamW step on a loss over random tokens: every weight moves off its saved value."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(4, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def save_actor(actor: Path, model, optimizer, tokenizer, ranks: Ranks | None = None, hf: bool = True) -> None:
    """What the actor's trainer writes: weights/ (and trainer.pt) through save_trainer, and hf/."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    save_trainer(actor, model, optimizer, scheduler, torch.Generator(), ranks or Ranks.alone())
    if hf:
        save_hf_files(actor, model.config, tokenizer)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A complete run checkpoint (actor/ and its manifest) after one training step, and the
    trained weights."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    optimizer = train_one_step(model)
    ckpt = step_dir(tmp_path_factory.mktemp("run") / "checkpoints", STEP)
    (ckpt / "actor").mkdir(parents=True)
    save_actor(ckpt / "actor", model, optimizer, tokenizer)
    write_json(ckpt / MANIFEST, {"step": STEP})
    return ckpt, {name: t.detach().clone() for name, t in model.state_dict().items()}


def stored_dtypes(out: Path) -> set[torch.dtype]:
    with safe_open(out / "model.safetensors", framework="pt") as f:
        return {f.get_tensor(name).dtype for name in f.keys()}


def assert_same_weights(out: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    state = model.state_dict()
    assert state.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor.to(dtype)), name


def test_export_writes_the_trained_weights_and_a_model_that_generates(trained, base_dir, tmp_path):
    ckpt, weights = trained
    out = export_checkpoint(ckpt, tmp_path / "hf-model")

    assert out == tmp_path / "hf-model" and not (tmp_path / "hf-model.partial").exists()
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert stored_dtypes(out) == {torch.float32}  # auto: the config's dtype
    assert_same_weights(out, weights, torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"])

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(base_dir).get_vocab()
    prompt = tokenizer("12+30=", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape == (1, prompt.input_ids.shape[1] + 5)
    assert torch.equal(generated[0, : prompt.input_ids.shape[1]], prompt.input_ids[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_export_casts_to_the_asked_dtype(trained, tmp_path, dtype):
    ckpt, weights = trained
    out = export_checkpoint(ckpt / "actor", tmp_path / "out", dtype)  # the actor directory itself
    assert stored_dtypes(out) == {getattr(torch, dtype)}
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    assert_same_weights(out, weights, getattr(torch, dtype))


def test_auto_dtype_is_the_one_the_config_was_saved_with(trained, tmp_path):
    actor = shutil.copytree(trained[0] / "actor", tmp_path / "actor")
    config = json.loads((actor / "hf" / "config.json").read_text())
    (actor / "hf" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert stored_dtypes(export_checkpoint(actor, tmp_path / "out")) == {torch.bfloat16}


def _sharded_worker(rank: int, world: int, store: str, base_dir: str, actor: str) -> None:
    """One of `world` FSDP2 ranks (gloo on CPU): shard, train a step, save the shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = AutoModelForCausalLM.from_pretrained(base_dir)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = train_one_step(model)
        full = {name: t.full_tensor() for name, t in model.state_dict().items()}  # a collective: every rank
        assert all(t.to_local().shape[0] < full[name].shape[0] for name, t in model.state_dict().items())
        save_actor(Path(actor), model, optimizer, tokenizer=None, ranks=Ranks.of(None), hf=False)
        if rank == 0:
            torch.save(full, Path(actor).parent / "full.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.procs
def test_export_joins_the_shards_of_an_fsdp_checkpoint(base_dir, tmp_path):
    import torch.multiprocessing as mp

    actor = tmp_path / "actor"
    actor.mkdir()
    # spawn, not fork: a fork of the test process (its OpenMP and gRPC threads running) can hang.
    mp.start_processes(_sharded_worker, args=(2, str(tmp_path / "store"), str(base_dir), str(actor)), nprocs=2,
                       start_method="spawn")
    save_hf_files(actor, AutoModelForCausalLM.from_pretrained(base_dir).config, AutoTokenizer.from_pretrained(base_dir))
    assert {p.name.split("_")[2] for p in (actor / "weights").glob("*.distcp")} == {"0", "1"}  # both ranks' shards

    out = export_checkpoint(actor, tmp_path / "out")
    assert_same_weights(out, torch.load(tmp_path / "full.pt"), torch.float32)


@pytest.mark.procs
def test_the_cli_exports_and_prints_where(trained, tmp_path):
    ckpt, weights = trained
    proc = rolefleet("export", str(ckpt), str(tmp_path / "out"), "--dtype", "bfloat16")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert str(tmp_path / "out") in output.splitlines()
    assert_same_weights(tmp_path / "out", weights, torch.bfloat16)


def test_the_cli_refuses_an_incomplete_checkpoint_on_stderr_with_exit_2(trained, tmp_path, capsys):
    incomplete = step_dir(tmp_path, STEP + 1)  # a save that never got its manifest
    shutil.copytree(trained[0] / "actor", incomplete / "actor")
    assert cli.main(["export", str(incomplete), str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"rolefleet: checkpoint {incomplete} is incomplete: it has no {MANIFEST} (its save "
                            "was interrupted); export a complete one\n")
    assert captured.out == "" and not (tmp_path / "out").exists()
    assert cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"rolefleet: checkpoint {tmp_path / 'nope'} does not exist\n"


@pytest.mark.parametrize("dtype", DTYPE_CHOICES)
def test_the_cli_takes_every_dtype_that_export_knows(dtype):
    assert cli.parse_args(["export", "ckpt", "out", "--dtype", dtype]).dtype == dtype


def test_an_existing_non_empty_output_is_refused_and_left_alone(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_checkpoint(trained[0], out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out.partial").exists()


def test_an_existing_empty_output_is_filled(trained, tmp_path):
    (tmp_path / "out").mkdir()
    assert (export_checkpoint(trained[0], tmp_path / "out") / "model.safetensors").is_file()


def test_an_incomplete_checkpoint_is_refused(trained, tmp_path):
    partial = shutil.copytree(trained[0], tmp_path / "step-00000012.partial")
    with pytest.raises(ExportError, match="incomplete"):
        export_checkpoint(partial, tmp_path / "out")
    (partial / MANIFEST).unlink()
    renamed = partial.rename(tmp_path / "step-00000012")
    with pytest.raises(ExportError, match=f"incomplete: it has no {MANIFEST}"):
        export_checkpoint(renamed, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("remove, expected", [
    ("weights", "has no weights/"),
    ("hf", "has no hf/"),
    ("hf/config.json", "has no hf/"),
    ("hf/tokenizer_config.json hf/tokenizer.json", "has no tokenizer"),
])
def test_a_trainer_directory_without_what_export_needs_is_refused(trained, tmp_path, remove, expected):
    actor = shutil.copytree(trained[0] / "actor", tmp_path / "actor")
    for name in remove.split():
        shutil.rmtree(actor / name) if (actor / name).is_dir() else (actor / name).unlink()
    with pytest.raises(ExportError, match=expected):
        export_checkpoint(actor, tmp_path / "out")


def test_a_directory_that_is_no_checkpoint_is_refused_with_a_hint(trained, tmp_path):
    with pytest.raises(ExportError, match=re.escape(f"latest complete one here is {trained[0]})")):
        export_checkpoint(trained[0].parent, tmp_path / "out")
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="is not a directory"):
        export_checkpoint(tmp_path / "file", tmp_path / "out")


def test_weights_that_do_not_match_the_config_are_refused(trained, tmp_path):
    actor = shutil.copytree(trained[0] / "actor", tmp_path / "actor")
    config = json.loads((actor / "hf" / "config.json").read_text())
    (actor / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ExportError, match=r"lacks 9 of the weights .*model\.layers\.2\."):
        export_checkpoint(actor, tmp_path / "out")
    (actor / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ExportError, match=r"has 9 weights that the model .* has not: model\.layers\.1\."):
        export_checkpoint(actor, tmp_path / "out")
    (actor / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ExportError, match=r"disagree on shapes: .*mlp\.down_proj\.weight \(64, 256\)"):
        export_checkpoint(actor, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_unreadable_config_is_refused(trained, tmp_path):
    actor = shutil.copytree(trained[0] / "actor", tmp_path / "actor")
    (actor / "hf" / "config.json").write_text("{")
    with pytest.raises(ExportError, match="cannot read the model config and tokenizer in"):
        export_checkpoint(actor, tmp_path / "out")
