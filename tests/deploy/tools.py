"""The command-line tools the deploy checks run (helm, promtool, prometheus, docker-compose):
installed by the project (`make tools`, and the venv's dev extras), never assumed on the machine."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEARCH = os.pathsep.join([str(REPO / ".tools" / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def tool(name: str) -> str:
    """The path of `name`, or a test failure that says how to install it."""
    found = shutil.which(name, path=SEARCH)
    if found is None:
        pytest.fail(f"{name} is not installed: `make tools` installs helm and prometheus (promtool); "
                    "the venv's dev extras install docker-compose")
    return found
