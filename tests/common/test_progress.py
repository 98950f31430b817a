"""The start-up progress channel: a JSON line per stage in the file ROLEFLEET_PROGRESS_FILE names,
nothing without it, and the latest whole line read back as `up` shows it."""

import json

from rolefleet.common import progress


def test_report_appends_a_line_per_stage_and_latest_reads_the_last(tmp_path, monkeypatch):
    path = tmp_path / "actor.progress.jsonl"
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(path))
    assert progress.latest(path) is None
    progress.report("config loaded")
    progress.report("loading weights", 3, 8)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["stage"], r["done"], r["total"]) for r in lines] == [("config loaded", None, None),
                                                                     ("loading weights", 3, 8)]
    assert progress.describe(progress.latest(path)) == "loading weights (3 of 8)"


def test_report_does_nothing_without_the_variable_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.delenv(progress.PROGRESS_FILE_ENV, raising=False)
    progress.report("loading weights", 1, 2)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(tmp_path / "no" / "such" / "dir" / "file"))
    progress.report("loading weights", 1, 2)  # advice to a person watching: a failed write is no error


def test_latest_skips_a_line_still_being_written(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"stage": "loading models"}) + "\n" + '{"stage": "loading wei')
    assert progress.describe(progress.latest(path)) == "loading models"


def test_describe():
    assert progress.describe(None) == "starting (no stage reported yet)"
    assert progress.describe({"stage": "serving"}) == "serving"
    assert progress.describe({"stage": "compiling", "done": 2, "total": None}) == "compiling (2)"
