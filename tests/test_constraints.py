"""The tested GPU install (constraints/gpu-h200.txt) against pyproject.toml: every line an exact pin,
every pin of a package that pyproject names inside pyproject's range (the core dependencies and the
`vllm` extra the file is for), the extra bounded to the minor series that was tested, and the README
and the Dockerfile's CUDA build installing from the same file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints" / "gpu-h200.txt"
EXTRAS = ("vllm",)  # the extras the file pins for; dev, gguf and tracking install beside it unpinned


def pins() -> list[Requirement]:
    lines = (line.split(" #", 1)[0].strip() for line in CONSTRAINTS.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("#")]


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + [r for e in EXTRAS for r in extras[e]]]


def test_every_line_pins_one_package_to_an_exact_version():
    seen = set()
    for req in pins():
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{req}: not name==version"
        assert "*" not in specs[0].version and not req.extras and req.marker is None, req
        name = canonicalize_name(req.name)
        assert name not in seen, f"{req.name} pinned twice"
        seen.add(name)
    assert {"torch", "transformers", "vllm", "protobuf", "grpcio"} <= seen  # the stack that was run


def test_every_pin_of_a_package_pyproject_names_is_inside_its_range():
    pinned = {canonicalize_name(r.name): Version(next(iter(r.specifier)).version) for r in pins()}
    checked, outside = [], []
    for req in pyproject_requirements():
        name = canonicalize_name(req.name)
        if name in pinned:
            checked.append(name)
            if not req.specifier.contains(pinned[name], prereleases=True):
                outside.append(f"{name}=={pinned[name]} is outside pyproject's {req}")
    assert not outside, outside
    assert {"torch", "transformers", "vllm", "protobuf", "grpcio"} <= set(checked)


def test_the_vllm_extra_takes_the_tested_minor_series_only():
    (vllm,) = [r for r in pyproject_requirements() if r.name == "vllm"]
    assert vllm.specifier.contains("0.26.0") and vllm.specifier.contains("0.26.9")
    assert not vllm.specifier.contains("0.27.0") and not vllm.specifier.contains("0.25.1")


def test_the_readme_and_the_cuda_image_install_from_the_file():
    readme = (REPO / "README.md").read_text()
    assert "pip install -e . -c constraints/gpu-h200.txt" in readme
    assert "pip install --no-deps -r constraints/gpu-h200.txt" in readme
    assert "pip install 'rolefleet[vllm]'" not in readme  # no such package on an index
    dockerfile = re.sub(r"\\\n", " ", (REPO / "deploy" / "Dockerfile").read_text())
    (cuda,) = [line for line in dockerfile.splitlines() if '"$TORCH" = cuda' in line]
    assert "--constraint /src/constraints/gpu-h200.txt" in cuda and "--no-deps -r /src/constraints/gpu-h200.txt" in cuda
