"""`docker compose up` for real: compose files that `rolefleet deploy compose` generated, run in
containers of the CPU image, as docs/deploy-compose.md ("On a CPU machine") tells a user to.

- The CPU demo (PPO, critic included) runs to FINISHED and learns; during it the control plane
  answers the run's token on the published port and refuses a caller without it, Prometheus
  scrapes every role, every dashboard query finds series, and no alert fires.
- A chat task (a chat template, a data file, an eval file outside ./configs, a user reward function
  in a directory of its own) runs to FINISHED with eval metrics: every file a role reads reached
  its container.
- Each of actor, critic and reward is killed (SIGKILL to its container's process, as an OOM kill
  or a crash does) mid-run: the restart policy brings it back, the run finishes every step, and
  the journal shows every sample trained once.
- `down -v` leaves no container, volume or network of the project behind, after a failure too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from rolefleet.coordinator.journal import Journal
from tests.containers.project import REPO, Project, wait_for
from tests.deploy.test_observability import concrete_queries, dashboard

pytestmark = [pytest.mark.container, pytest.mark.timeout(600)]

DEMO_MODEL = REPO / "runs" / "demo-model"  # what `make demo` builds (`make test-containers` too)
ROLE_SERVICES = ("actor", "reward", "critic", "coordinator")
# Evaluated before the first step and after the last, on the same draws (tests/coordinator/test_learning.py
# explains the method): every addition problem, 4 samples each at temperature 1.
EVAL = ("eval.max_prompts=400", "eval.temperature=1.0", "eval.samples_per_prompt=4")


@pytest.fixture
def project(tmp_path):
    """A compose project of its own; `down -v` afterwards, whatever happened, and nothing left."""
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.fail(f"{DEMO_MODEL} is missing: `make {DEMO_MODEL.relative_to(REPO)}/config.json` builds it",
                    pytrace=False)
    made = Project(tmp_path / "project", f"rftest-{uuid.uuid4().hex[:8]}")
    try:
        yield made
    finally:
        made.down()
        assert made.leftovers() == [], "docker compose down -v left these behind"


def addition_problems(chat: bool) -> str:
    """Every problem of the demo task (a+b=, a and b below 20) as JSONL: a prompt string, or the
    same text as a user message for the chat template."""
    rows = []
    for a in range(20):
        for b in range(20):
            prompt = f"{a}+{b}="
            rows.append({"prompt": [{"role": "user", "content": prompt}] if chat else prompt,
                         "ground_truth": str(a + b)})
    return "".join(json.dumps(row) + "\n" for row in rows)


def gain(records: list[dict]) -> tuple[float, float]:
    evals = [(r["step"], r["eval/reward/mean"]) for r in records if "eval/reward/mean" in r]
    assert [step for step, _ in evals] == [0, records[-1]["step"]], evals
    return evals[0][1], evals[-1][1]


def finished(project: Project, run: str, steps: int, timeout: float = 300) -> str:
    """The coordinator's log once it exited 0 with the run FINISHED after every step."""
    code = project.exit_code("coordinator", timeout)
    log = project.logs("coordinator")
    assert code == 0, log[-4000:]
    assert f"run {run} ended FINISHED after step {steps}/{steps}" in log, log[-4000:]
    return log


# --- the CPU demo, watched from the host ----------------------------------------------------------------

def test_the_demo_runs_learns_and_is_watched_through_the_published_ports(project):
    steps = 100
    model = project.add_model(DEMO_MODEL, "demo-model")
    (project.root / "configs" / "demo.yaml").write_bytes((REPO / "configs" / "demo.yaml").read_bytes())
    (project.root / "configs" / "problems.jsonl").write_text(addition_problems(chat=False))
    # The async pipeline, as the shipped GPU configs run: its queue and staleness panels have series.
    project.generate("configs/demo.yaml", f"model.model_name_or_path={model}", f"train.total_steps={steps}",
                     "pipeline.mode=async", "pipeline.max_staleness=1",
                     f"eval.every={steps}", "eval.path=configs/problems.jsonl", *EVAL)
    started = time.time()
    project.up(*ROLE_SERVICES, "prometheus")

    # The control plane, from the host through the published port, with the run's token and without.
    def control_plane_answers():
        try:
            code, body = project.http("/v1/status", project.token)
        except OSError:  # the published port takes connections before the coordinator listens
            return None
        return code == 200 and body
    status = wait_for("the control plane to answer", control_plane_answers, timeout=120)
    assert status["run_name"] == "demo" and status["total_steps"] == steps
    assert project.http("/v1/status")[0] == 401
    assert project.http("/v1/status", "not-the-token-of-this-run")[0] == 401
    cli = [str(Path(sys.executable).parent / "rolefleet"), "status", "--http",
           f"http://127.0.0.1:{project.ports['ROLEFLEET_HTTP_PORT']}"]
    env = {k: v for k, v in os.environ.items() if k != "ROLEFLEET_TOKEN"}
    answered = subprocess.run(cli, capture_output=True, text=True, timeout=60, env={**env, "ROLEFLEET_TOKEN": project.token})
    assert answered.returncode == 0 and "demo" in answered.stdout, answered.stderr
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "token" in refused.stderr.lower(), (refused.stdout, refused.stderr)

    # Prometheus scrapes every role while the run is on.
    def every_role_up():
        targets = project.prometheus("/api/v1/targets")["activeTargets"]
        health = {t["labels"]["role"]: t["health"] for t in targets}
        return all(health.get(role) == "up" for role in ROLE_SERVICES) and health
    wait_for("Prometheus to scrape every role", every_role_up, timeout=60, every=2)

    log = finished(project, "demo", steps)
    ended = time.time()
    records = project.metrics("demo")
    assert [r["step"] for r in records if "reward/mean" in r] == list(range(1, steps + 1))
    before, after = gain(records)
    assert after - before > 0.04, (before, after)  # PPO's 15-step bar; this run is longer
    assert "mean reward" in log

    # Every query of every dashboard panel finds series in the live Prometheus over the run, but for
    # the GPU panels: no GPU here, so no GPU series (docs/operations.md).
    empty = []
    for where, expr in concrete_queries(dashboard()):
        found = project.prometheus("/api/v1/query_range", query=expr, start=started, end=ended + 15, step=5)
        if not found["result"] and "gpu" not in expr:
            empty.append(f"{where}: {expr}")
    assert empty == [], "dashboard queries without a series in a live run:\n" + "\n".join(empty)

    # The shipped alert rules loaded, and none fired on this healthy run.
    shipped = {g["name"] for g in yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]}
    loaded = {g["name"] for g in project.prometheus("/api/v1/rules")["groups"]}
    assert loaded == shipped
    fired = [a for a in project.prometheus("/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert fired == []


# --- a chat task: every file a role reads, in its container ---------------------------------------------

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
USER_REWARD = '''def score(prompt, response, ground_truth, extra):
    """1 for the exact sum, else 0."""
    return float(response.strip() == ground_truth)
'''


def test_a_chat_task_reads_its_model_data_eval_and_reward_code_in_the_containers(project, tmp_path):
    from transformers import AutoTokenizer

    from rolefleet.common.model_paths import share_read_access

    steps = 30
    # The demo model with a chat template that renders the user's message as the demo's prompt.
    model = project.add_model(DEMO_MODEL, "chat-demo")
    tokenizer = AutoTokenizer.from_pretrained(project.root / model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(project.root / model)
    share_read_access(project.root / model)
    (project.root / "configs" / "train.jsonl").write_text(addition_problems(chat=True))
    (project.root / "evals").mkdir()
    (project.root / "evals" / "problems.jsonl").write_text(addition_problems(chat=True))
    (project.root / "rewards").mkdir()
    (project.root / "rewards" / "exact.py").write_text(USER_REWARD)
    config = yaml.safe_load((REPO / "configs" / "demo_grpo.yaml").read_text())
    config["run"]["name"] = "chat"
    config["data"] = {"path": "configs/train.jsonl", "max_prompt_tokens": 16}
    config["reward"] = {"sources": [{"kind": "user", "path": "rewards/exact.py:score"}], "num_threads": 1}
    (project.root / "configs" / "chat.yaml").write_text(yaml.safe_dump(config))
    compose = project.generate("configs/chat.yaml", f"model.model_name_or_path={model}", "actor.lr=3e-4",
                               f"train.total_steps={steps}", f"eval.every={steps}", "eval.path=evals/problems.jsonl",
                               *EVAL)
    assert set(compose["services"]) == {"actor", "reward", "coordinator", "prometheus", "grafana"}  # GRPO: no critic
    coordinator = compose["services"]["coordinator"]
    assert any(v["target"] == "/models" for v in coordinator["volumes"])  # the tokenizer, for the chat template
    project.up("actor", "reward", "coordinator")

    finished(project, "chat", steps)
    records = project.metrics("chat")
    before, after = gain(records)
    assert after - before > 0.04, (before, after)
    assert records[-1]["reward/exact/mean"] == records[-1]["reward/mean"]  # the user function scored
    run = project.copy_run("chat", tmp_path)
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["data"]["path"] == "/configs/train.jsonl" and resolved["eval"]["path"].startswith("/inputs/")


# --- on-policy distillation: the teacher role in its container ------------------------------------------

def test_a_distillation_run_has_its_teacher_in_a_container_of_its_own(project, tmp_path):
    """algorithm distill: the teacher service (its model and the student's on the models volume)
    grades every sampled token; the run finishes, its records carry the distillation metrics, and
    Prometheus saw the teacher serve them."""
    from rolefleet.app.tiny_model import make_tiny_model
    from rolefleet.common.model_paths import share_read_access

    steps = 12
    (project.root / "configs" / "demo.yaml").write_bytes((REPO / "configs" / "demo.yaml").read_bytes())
    student = project.add_model(DEMO_MODEL, "student")
    teacher = project.root / "models" / "teacher"  # the same tokenizer, more practice
    make_tiny_model(teacher, task="addition", warm_start_steps=300)
    share_read_access(teacher)
    compose = project.generate("configs/demo.yaml", f"model.model_name_or_path={student}", "algorithm=distill",
                               "teacher.model_name_or_path=models/teacher", f"train.total_steps={steps}",
                               "train.prompts_per_step=64", "actor.ppo_epochs=1", "actor.num_mini_batches=1")
    assert set(compose["services"]) == {"actor", "reward", "teacher", "coordinator", "prometheus", "grafana"}
    project.up("actor", "reward", "teacher", "coordinator", "prometheus")
    finished(project, "demo", steps)
    records = project.metrics("demo")
    assert len(records) == steps and all(r["distill/reverse_kl"] == r["distill/reverse_kl"] for r in records)

    def served() -> float:  # the teacher's counter as Prometheus last scraped it (every few seconds)
        result = project.prometheus("/api/v1/query", query='rolefleet_teacher_tokens_total{role="teacher"}')["result"]
        return float(result[0]["value"][1]) if result else 0.0

    wait_for("the teacher's tokens in Prometheus", lambda: served() >= steps * 64, timeout=60)


# --- a role killed mid-run ------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["actor", "critic", "reward"])
def test_a_role_killed_mid_run_comes_back_and_the_run_trains_every_sample_once(project, tmp_path, role):
    steps, kill_after = 40, 8
    model = project.add_model(DEMO_MODEL, "demo-model")
    (project.root / "configs" / "demo.yaml").write_bytes((REPO / "configs" / "demo.yaml").read_bytes())
    project.generate("configs/demo.yaml", f"model.model_name_or_path={model}", f"train.total_steps={steps}")
    project.up(*ROLE_SERVICES)
    wait_for(f"step {kill_after}", lambda: project.last_step("demo") >= kill_after, timeout=180)
    # SIGKILL to the container's process from the host: what an OOM kill or a crash does. (`docker
    # kill` would be a stop by hand, which Docker's restart policies leave stopped.)
    os.kill(project.state(role)["Pid"], signal.SIGKILL)
    assert project.last_step("demo") < steps, "the run ended before the kill: give it more steps"

    finished(project, "demo", steps, timeout=400)
    state = project.state(role)
    assert state["RestartCount"] == 1 and state["Status"] == "running", state
    records = project.metrics("demo")
    assert [r["step"] for r in records if "reward/mean" in r] == list(range(1, steps + 1))
    with Journal(project.copy_run("demo", tmp_path) / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
        assert len(ids) == len(set(ids)) == steps * 128  # none lost, none twice (demo: 128 prompts x 1)
        rewound = [step for step, _ in journal.rewound()]
    lost = [r for r in records if "recovery/steps_lost" in r]
    if role == "reward":  # its lost call is repeated: no recovery, nothing trained again
        assert lost == [] and rewound == []
    else:  # a trainer resumes from the snapshot (the compose volume) of the last finished step
        [after] = lost
        assert after["recovery/steps_lost"] == 0 and rewound in ([], [after["step"]]), (after, rewound)


# --- a worker group over two containers -------------------------------------------------------------------

SPAN_RUN = ("algorithm=grpo", "train.samples_per_prompt=2", "train.prompts_per_step=8", "actor.entropy_coef=0.01",
            "train.total_steps=10", "checkpoint.every=1", "checkpoint.keep=20", "checkpoint.every_minutes=0",
            "actor.lr=3e-4")


def step_2_weights(checkpoints: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    from rolefleet.export import export_checkpoint

    export_checkpoint(checkpoints / "step-00000002", out, dtype="float32")
    return load_file(str(out / "model.safetensors"))


@pytest.mark.multinode
def test_an_actor_over_two_containers_trains_like_one_process_and_recovers_a_killed_node(project, tmp_path):
    """The actor's worker group over two containers ("two nodes": an elastic agent each, gloo over the
    compose network): its step 2 is one process's step 2; its second node killed mid-run, the group
    ends, both containers come back, the group forms anew, and the run recovers every step."""
    import torch
    from safetensors.torch import load_file

    import tests.e2e.procs as procs

    # The reference: the same run in one process, on the host.
    reference = procs.rolefleet("up", str(REPO / "configs" / "demo_grpo.yaml"), *SPAN_RUN,
                                f"model.model_name_or_path={DEMO_MODEL}", f"run.output_dir={tmp_path / 'one'}")
    output, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, output[-3000:]
    expected = step_2_weights(tmp_path / "one" / "checkpoints", tmp_path / "one-export")
    initial = load_file(str(DEMO_MODEL / "model.safetensors"))
    moved = max((expected[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "the run must move the weights for the comparison to mean anything"

    model = project.add_model(DEMO_MODEL, "demo-model")
    (project.root / "configs" / "demo_grpo.yaml").write_bytes((REPO / "configs" / "demo_grpo.yaml").read_bytes())
    compose = project.generate("configs/demo_grpo.yaml", f"model.model_name_or_path={model}", *SPAN_RUN,
                               "actor.workers=4", "actor.nodes=2", "actor.rollout.workers=1", "actor.sharding=fsdp")
    assert {"actor", "actor-node1"} <= set(compose["services"])
    project.up("actor", "actor-node1", "reward", "coordinator")
    wait_for("step 4", lambda: project.last_step("demo-grpo") >= 4, timeout=300)
    os.kill(project.state("actor-node1")["Pid"], signal.SIGKILL)  # the second node's machine fails

    finished(project, "demo-grpo", 10, timeout=400)
    # Killed, back; then (maybe) once more when node 0's agent ended the old group under it.
    assert project.state("actor-node1")["RestartCount"] >= 1
    assert project.state("actor")["RestartCount"] >= 1  # rank 0 lost a rank: the whole group started again
    # The group's end is logged: rank 0 names the lost node (its watch saw a rank go, or a command to
    # it failed), or a rank of node 0 whose collective with the lost ranks broke says so first.
    actor_log = project.logs("actor")
    assert "node 1 (node1, ranks 2-3)" in actor_log or "failed on rank 1; stopping the group" in actor_log, [
        line for line in actor_log.splitlines() if any(w in line for w in ("ERROR", "CRITICAL", "exited"))]
    run = project.copy_run("demo-grpo", tmp_path)
    with Journal(run / "journal.sqlite") as journal:
        ids = journal.trained_sample_ids()
        assert len(ids) == len(set(ids)) == 10 * 8 * 2  # none lost, none twice (a checkpoint every step)
    spanned = step_2_weights(run / "checkpoints", tmp_path / "span-export")
    assert spanned.keys() == expected.keys()
    for name, tensor in expected.items():  # float32 sums in another order: close, not equal
        assert torch.allclose(spanned[name], tensor, atol=1e-4, rtol=1e-3), name
