"""The spread of the learning tests (tests/coordinator/test_learning.py), and proof that a broken
learner fails them: each case runs over several seeds, then with the learning rate at 0 (1e-12: the
config refuses 0) and with the policy gradient's sign flipped. Prints each case's gains (the
evaluated accuracy after the run minus before it, the figure the test asserts) next to its bar;
docs/testing.md records a run.

    .venv/bin/python scripts/learning_spread.py [--cases ppo grpo ...] [--seeds 0 1 2 3 4] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def flip_the_policy_gradient() -> None:
    """Every update gets its advantages negated: the policy learns away from the reward."""
    from rolefleet.actor.client import InProcessActorClient

    update = InProcessActorClient.update

    async def flipped(self, step, policy_version, batch, targets, temperature):
        return await update(self, step, policy_version, batch, replace(targets, advantages=-targets.advantages),
                            temperature)

    InProcessActorClient.update = flipped


def one_run(case_id: str, variant: str, seed: int, model: str, steps: int | None, every: int | None,
            overrides: list[str]) -> dict:
    from tests.coordinator.test_learning import CASES, accuracy

    case = replace(CASES[case_id], steps=steps or CASES[case_id].steps)
    extra = [f"run.seed={seed}", *overrides] + ([f"eval.every={every}"] if every else [])
    if variant == "lr0":
        extra += ["actor.lr=1e-12", "critic.lr=1e-12"]  # the config refuses 0
    elif variant == "flipped":
        flip_the_policy_gradient()
    with tempfile.TemporaryDirectory() as out:
        evals = accuracy(model, Path(out), case, extra)
    return {"case": case_id, "variant": variant, "seed": seed, "evals": evals,
            "gain": evals[-1][1] - evals[0][1], "bar": case.bar}


def runs(cases: list[str], seeds: list[int]) -> list[tuple]:
    """Healthy runs over the seeds, then the two broken learners at the first seed."""
    out = []
    for case in cases:
        out += [(case, "healthy", seed) for seed in seeds]
        out += [(case, broken, seeds[0]) for broken in ("lr0", "flipped")]
    return out


def summary(results: list[dict]) -> str:
    lines = ["| case | healthy gains (seeds) | mean | sd | min | bar | lr 0 | sign flipped |",
             "|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in results):
        mine = [r for r in results if r["case"] == case]
        healthy = [r["gain"] for r in mine if r["variant"] == "healthy"]
        broken = {r["variant"]: r["gain"] for r in mine if r["variant"] != "healthy"}
        sd = statistics.stdev(healthy) if len(healthy) > 1 else 0.0
        lines.append(f"| {case} | {' '.join(f'{g:+.3f}' for g in healthy)} | {statistics.mean(healthy):+.3f} | "
                     f"{sd:.3f} | {min(healthy):+.3f} | {mine[0]['bar']:+.3f} | {broken.get('lr0', float('nan')):+.3f} | "
                     f"{broken.get('flipped', float('nan')):+.3f} |")
    return "\n".join(lines)


def main() -> None:
    from tests.coordinator.test_learning import CASES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each in its own process)")
    parser.add_argument("--steps", type=int, default=None, help="run this long instead of each case's steps")
    parser.add_argument("--every", type=int, default=None, help="also evaluate every this many steps")
    parser.add_argument("--override", nargs="*", default=[], help="dotted overrides for every run (actor.lr=3e-4)")
    parser.add_argument("--out", type=Path, default=None, help="also write every run as a JSON line here")
    args = parser.parse_args()

    from rolefleet.app.tiny_model import make_tiny_model
    from tests.coordinator.test_learning import DEMO_MODEL

    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "demo-model")
        make_tiny_model(model, **DEMO_MODEL)
        with ProcessPoolExecutor(args.jobs, max_tasks_per_child=1) as pool:
            futures = [pool.submit(one_run, *run, model, args.steps, args.every, args.override)
                       for run in runs(args.cases, args.seeds)]
            results = []
            for future in futures:
                results.append(future.result())
                print(json.dumps(results[-1]), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(results[-1]) + "\n")
    print(summary(results))


if __name__ == "__main__":
    main()
