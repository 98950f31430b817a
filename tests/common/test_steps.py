import pytest

from rolefleet.common.errors import FailedPrecondition, InvalidArgument
from rolefleet.common.steps import PartialUpdate, StepLedger


def apply(ledger: StepLedger, step: int, result: str) -> str:
    done = ledger.check(step)
    if done is not None:
        return done
    with ledger.applying(step):
        ledger.record(step, result)
    return result


def test_only_the_next_step_or_a_replay_is_accepted():
    ledger: StepLedger[str] = StepLedger("actor")
    assert apply(ledger, 1, "one") == "one"
    assert apply(ledger, 1, "again") == "one"  # a retry replays the recorded result
    for bad in (3, 1000, 2**63 - 1):
        with pytest.raises(FailedPrecondition, match="expects step 2 next"):
            ledger.check(bad)
    assert ledger.last_step == 1 and list(ledger.results) == [1]  # refusals changed nothing
    assert apply(ledger, 2, "two") == "two"
    with pytest.raises(InvalidArgument, match="step: must be >= 1"):
        ledger.check(0)


def test_a_step_that_fell_out_of_the_window_is_refused_not_reapplied():
    ledger: StepLedger[str] = StepLedger("critic", keep=2)
    for step in (1, 2, 3):
        apply(ledger, step, str(step))
    assert list(ledger.results) == [2, 3]
    with pytest.raises(FailedPrecondition, match="already moved past step 1"):
        ledger.check(1)


def test_a_partial_update_blocks_every_later_step_but_replays_still_answer():
    ledger: StepLedger[str] = StepLedger("actor")
    apply(ledger, 1, "one")
    with pytest.raises(PartialUpdate), ledger.applying(2):
        raise PartialUpdate("after 1 of 2 optimizer steps")
    with pytest.raises(FailedPrecondition, match="refuses updates until restarted"):
        ledger.check(2)
    assert ledger.check(1) == "one"
