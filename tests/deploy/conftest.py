"""Fixtures of the deploy checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolefleet.certs import make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """What `rolefleet certs DIR` writes: ca.pem, and {role}.pem with {role}-key.pem for every role and
    client (the leaves name the role, localhost and 127.0.0.1)."""
    out = tmp_path_factory.mktemp("certs") / "certs"
    make_certs(out)
    return out
