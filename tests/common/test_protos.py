"""The committed stubs must equal a fresh generation from protos/ (nobody edits generated code)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_are_fresh(tmp_path):
    gen = _generator()
    fresh_dir = tmp_path / "pb"
    gen.generate(fresh_dir)
    committed_dir = gen.DEFAULT_OUT
    fresh = {p.name: p.read_text() for p in fresh_dir.iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in committed_dir.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs {stale}: run `make proto`"


def test_stubs_import_from_the_package_and_carry_pyi():
    from rolefleet.common.pb import actor_pb2_grpc, common_pb2

    assert common_pb2.DESCRIPTOR.package == "rolefleet.v1"
    assert hasattr(actor_pb2_grpc, "ActorServiceStub")
    assert (ROOT / "services" / "common" / "pb" / "actor_pb2.pyi").is_file()
