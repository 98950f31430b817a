"""A rolling update of the reward during a run: a replica serving a new reward definition joins
(`rolefleet scale reward --add`), the old one leaves (`--remove`), the run goes on without a pause,
and each step's record names the reward version(s) that scored it."""

import signal
import subprocess

import pytest
import yaml

from rolefleet.coordinator.journal import Journal
from tests.e2e.procs import read_metrics, rolefleet, wait_ready, write_config
from tests.e2e.test_live_run import cli, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ALWAYS_ONE = "def score(prompt, response, ground_truth, extra):\n    return 1.0\n"


def test_a_new_reward_version_replaces_the_old_one_while_the_run_goes_on(make_config, tmp_path):
    cfg = make_config("algorithm=grpo", "train.samples_per_prompt=2", "train.total_steps=1000000",
                      "checkpoint.at_end=false", "checkpoint.every_minutes=0")
    out, metrics = cfg.run.out, cfg.run.out / "metrics.jsonl"
    run = ("--run", str(out))
    proc = rolefleet("up", str(write_config(cfg, tmp_path / "config.yaml")))
    new = None
    try:
        wait_for(lambda: metrics.exists() and len(read_metrics(metrics)) >= 2, timeout_s=120)
        old_version = read_metrics(metrics)[-1]["reward/versions"]
        # The new definition: the run's config with another reward function, served on a port of its own.
        resolved = yaml.safe_load((out / "config.yaml").read_text())
        (tmp_path / "one.py").write_text(ALWAYS_ONE)
        resolved["reward"] = {**resolved["reward"], "sources": [
            {"name": "one", "kind": "user", "path": f"{tmp_path / 'one.py'}:score"}]}
        (tmp_path / "new.yaml").write_text(yaml.safe_dump(resolved))
        new = rolefleet("serve", "reward", "--config", str(tmp_path / "new.yaml"), "--ready-file",
                        str(tmp_path / "new.ready.json"), stdout=subprocess.DEVNULL)
        address = f"127.0.0.1:{wait_ready(new, tmp_path / 'new.ready.json')['grpc_port']}"

        code, said = cli("scale", "reward", "--add", address, *run)
        assert code == 0, said
        [old] = [label for label in said.strip().split(": ", 1)[1].split(", ") if label != address]
        code, said = cli("scale", "reward", "--remove", old, *run)
        assert code == 0 and said.strip() == f"reward replicas in use: {address}", said
        switched = len(read_metrics(metrics))
        wait_for(lambda: len(read_metrics(metrics)) >= switched + 4)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        for p in (proc, new):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    assert "rolefleet: run test ended STOPPED after step " in output and "run failed" not in output, output
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # no step lost to the swap
    versions = [r["reward/versions"] for r in records]
    new_version = versions[-1]
    assert new_version != old_version and "," not in old_version + new_version
    # Old alone at first; while both served, either or both scored a step (a shard re-sent to the
    # other replica when one lagged, on a loaded machine); the last steps, after the removal, the new
    # one alone.
    both = ",".join(sorted((old_version, new_version)))
    assert versions[0] == old_version and set(versions) <= {old_version, both, new_version}, versions
    assert versions[-2:] == [new_version] * 2, versions
    assert all(r["reward/mean"] == 1.0 for r in records if r["reward/versions"] == new_version)
    assert f"reward replicas and versions: {address} {new_version}" in output
    with Journal(out / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
    assert len(ids) == len(set(ids)) == len(records) * cfg.train.prompts_per_step * 2
