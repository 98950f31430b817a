"""Model directories as another user sees them: the files a writer of the project leaves are
readable by every user (a container's role runs as its own), and an unreadable one is named."""

import os
from pathlib import Path

from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common import model_paths
from rolefleet.common.model_paths import share_read_access


def test_a_tiny_model_is_written_readable_by_every_user(tmp_path):
    out = make_tiny_model(tmp_path / "model")
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir() if f.is_file()}
    assert "model.safetensors" in modes
    assert all(mode & 0o444 == 0o444 for mode in modes.values()), modes  # safetensors alone writes 0600


def test_share_read_access_keeps_the_umask_and_write_bits(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a", "sub/b"):
        (tmp_path / name).write_text("x")
        (tmp_path / name).chmod(0o600)
    old = os.umask(0o027)
    try:
        share_read_access(tmp_path)
    finally:
        os.umask(old)
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in ("a", "sub/b")] == [0o640, 0o640]


def test_a_file_this_process_cannot_read_is_named_with_the_fix(tmp_path, monkeypatch):
    """What a container's non-root role meets in a directory a root writer left 0600 (root itself
    reads every file, so the test stands in for the permission check)."""
    model = make_tiny_model(tmp_path / "model")
    monkeypatch.setattr(model_paths.os, "access", lambda path, mode: Path(path).name != "model.safetensors")
    assert model_paths.model_problem(str(model)) == (
        f"model directory {model}: model.safetensors cannot be read by this process (uid {os.getuid()}); "
        f"make the files readable, e.g. chmod -R a+rX {model}")
