"""`actor.rollout.keep_decode_state_mb`: the decode loop keeps every batch shape that fits beside
what the process holds and what the next phase adds (`auto`), or within a fixed budget."""

import pytest

from rolefleet.actor.decode_budget import HEADROOM, UNMEASURED_BYTES, DecodeBudget, kept_budget
from rolefleet.actor.types import SamplingParams
from rolefleet.common.config import ConfigError
from tests.actor.test_trainer import make_core

GIB = 2**30


class Room:
    """The device as the budget reads it: `usable` bytes; allocated is `others` plus what `held()`
    says is kept; `peak` what the last update reached."""

    def __init__(self, usable: int, others: int, held=lambda: 0):
        self.usable_bytes, self.others, self.held = usable, others, held
        self.peak_bytes = 0
        self.peak_resets = 0

    def usable(self) -> int:
        return self.usable_bytes

    def allocated(self) -> int:
        return self.others + self.held()

    def start_peak(self) -> None:
        self.peak_resets += 1
        self.peak_bytes = self.allocated()

    def peak(self) -> int:
        return self.peak_bytes


def test_the_budget_is_what_fits_within_the_headroom_beside_the_rest():
    assert kept_budget(10 * GIB, 2 * GIB, 1 * GIB) == int(HEADROOM * 10 * GIB) - 3 * GIB
    assert kept_budget(10 * GIB, 8 * GIB, 2 * GIB) == 0  # nothing fits: nothing is kept


def test_a_fixed_budget_is_the_configured_one_whatever_the_device():
    budget = DecodeBudget(512 * 2**20, Room(80 * GIB, 1 * GIB))
    assert budget.for_call(held=0, reserve=10 * GIB) == budget.for_update(held=0) == 512 * 2**20


def test_auto_before_an_update_is_measured_keeps_at_most_the_unmeasured_budget_and_without_a_device_that():
    assert DecodeBudget(None, None).for_call(held=0) == DecodeBudget(None, None).for_update(held=0) == UNMEASURED_BYTES
    roomy = DecodeBudget(None, Room(80 * GIB, 1 * GIB))
    assert roomy.for_call(held=0) == int(HEADROOM * 80 * GIB) - GIB  # a call: what the device has room for
    assert roomy.for_update(held=0) == UNMEASURED_BYTES             # the update's need is not known yet
    tight = DecodeBudget(None, Room(4 * GIB, 3 * GIB))
    assert tight.for_update(held=0) == int(HEADROOM * 4 * GIB) - 3 * GIB  # less still when less fits


def test_auto_keeps_beside_an_update_what_its_measured_growth_leaves_and_remembers_the_largest():
    held = {"bytes": 5 * GIB}
    room = Room(80 * GIB, others=10 * GIB, held=lambda: held["bytes"])
    budget = DecodeBudget(None, room)
    budget.update_starts()
    assert room.peak_resets == 1
    room.peak_bytes = room.allocated() + 30 * GIB  # the update's activations, gradients, logits
    budget.update_done()
    assert budget.update_growth == 30 * GIB
    assert budget.for_update(held=held["bytes"]) == int(HEADROOM * 80 * GIB) - 10 * GIB - 30 * GIB
    budget.update_starts()
    room.peak_bytes = room.allocated() + 12 * GIB  # a batch of shorter sequences
    budget.update_done()
    assert budget.update_growth == 30 * GIB  # the next long batch will need the room again
    room.usable_bytes = 40 * GIB  # another process on the GPU grew
    assert budget.for_update(held=held["bytes"]) == 0


@pytest.fixture
def engine(tiny_model_dir):
    return make_core(tiny_model_dir, "actor.compute_dtype=float32").worker.engine


def generate_shapes(engine, *batch_sizes: int) -> None:
    for rows in batch_sizes:
        engine_core_generate(engine, ["3+4="] * rows)


def engine_core_generate(engine, prompts: list[str]) -> None:
    ids = [engine.tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
    for _ in engine.generate(ids, SamplingParams(max_new_tokens=4, seed=1), policy_version=0):
        pass


def test_auto_is_the_default_and_keeps_every_shape_the_device_has_room_for(engine):
    loop = engine._loop
    assert engine.cfg.rollout.keep_decode_state_mb == "auto"
    room = Room(80 * GIB, 1 * GIB, held=loop.held_bytes)
    loop.budget.room = room
    generate_shapes(engine, 8, 12, 16, 24)  # four row buckets
    assert len(loop._states) == 4
    room.usable_bytes = GIB  # the device fills up (another process): the budget is what it has room for
    generate_shapes(engine, 32)
    assert len(loop._states) == 1  # the newest alone: nothing else fits beside the process's own 1 GiB


def test_auto_evicts_the_least_recently_used_shapes_to_make_room_for_a_new_one(engine):
    loop = engine._loop
    generate_shapes(engine, 8, 16)
    small, large = loop._states
    room = Room(0, 0, held=loop.held_bytes)
    loop.budget.room = room
    # Room for what is kept and a little more: a shape of 24 rows (as large as both kept ones) does
    # not fit beside both, and the least recently used one goes first.
    room.usable_bytes = int((loop.held_bytes() + loop._slot_bytes * 24 * small[1] * 0.8) / HEADROOM)
    loop._states.move_to_end(small)
    generate_shapes(engine, 24)
    assert list(loop._states)[0] == small and large not in loop._states and len(loop._states) == 2


def test_sleep_keeps_what_the_measured_update_leaves_room_for(engine):
    loop = engine._loop
    room = Room(0, 0, held=loop.held_bytes)
    loop.budget.room = room
    room.usable_bytes = 80 * GIB
    generate_shapes(engine, 8, 12, 16)
    engine.sleep()  # the first update: not yet measured, so at most the unmeasured budget (all of these)
    assert len(loop._states) == 3
    room.peak_bytes = room.allocated() + 2 * GIB
    engine.wake()
    assert loop.budget.update_growth == 2 * GIB
    # The device now has room for the update's growth and only about one shape beside it.
    smallest = next(iter(loop._states.values())).held_bytes()
    room.usable_bytes = int((2 * GIB + loop.held_bytes() - smallest // 2) / HEADROOM)
    engine.sleep()
    assert len(loop._states) == 2
    room.usable_bytes = int(2 * GIB / HEADROOM)
    engine.sleep()
    assert not loop._states


@pytest.mark.parametrize("value, word", [("-1", "greater than or equal to 0"), ("lots", "auto")])
def test_a_bad_budget_is_refused_naming_the_key(tiny_model_dir, value, word):
    with pytest.raises(ConfigError, match="keep_decode_state_mb") as err:
        make_core(tiny_model_dir, f"actor.rollout.keep_decode_state_mb={value}")
    assert word in str(err.value)


def test_each_update_reports_the_shapes_built_since_the_last_and_the_state_kept(tiny_model_dir):
    import torch

    from rolefleet.actor.types import PolicyTargets
    from tests.actor.test_trainer import rollout

    core = make_core(tiny_model_dir, "actor.compute_dtype=float32")

    def update(step: int) -> dict:
        _, batch, lp = rollout(core)  # the same prompts and sampling every time: one shape
        targets = PolicyTargets(torch.ones(batch.num_response_tokens), lp.logprobs)
        return core.update(step, step - 1, batch, targets, 1.0).stats

    first, second = update(1), update(2)
    assert first["decode_shapes_built"] == 1 and second["decode_shapes_built"] == 0  # kept: replayed
    assert first["decode_state_gib"] == second["decode_state_gib"] > 0
    core.worker.engine.sleep = lambda: core.worker.engine._loop.trim(0)  # a budget of nothing
    update(3)  # generated with the kept shape, given back before its update
    assert update(4)["decode_shapes_built"] == update(5)["decode_shapes_built"] == 1  # built again every step
