"""A controller drives its workers by method reference: only methods marked @collective(part) run,
on the ranks of their part; alone, on this process's worker."""

import pytest

from rolefleet.trainer.workers import Workers, collective


class Worker:
    parts = {"all": [0, 1, 2], "trainers": [1, 2], "engines": [0]}

    def __init__(self):
        self.calls = []

    @collective("trainers")
    def train(self, x):
        self.calls.append(("train", x))
        return x + 1

    def helper(self):
        return "not for dispatch"


def test_a_collective_method_runs_on_the_local_worker_alone():
    worker = Worker()
    assert Workers(worker).run(Worker.train, 41) == 42 and worker.calls == [("train", 41)]
    assert Workers(worker).here_alone(Worker.train) and Workers(worker).size == 1


def test_an_unmarked_method_is_refused_before_it_runs():
    worker = Worker()
    with pytest.raises(TypeError, match=r"Worker\.helper is not a collective method"):
        Workers(worker).run(Worker.helper)


def test_a_part_must_be_one_the_group_knows():
    with pytest.raises(ValueError, match="unknown part 'rollout'"):
        collective("rollout")


def test_over_a_group_a_method_runs_on_its_parts_ranks():
    class Group:
        size = 3

        def run(self, local, method, args, ranks):
            return method.__qualname__, args, ranks

    workers = Workers(Worker(), Group())
    assert workers.run(Worker.train, 1) == ("Worker.train", (1,), [1, 2])
    assert not workers.here_alone(Worker.train) and workers.size == 3
