"""RequestLifecycle: the pure rules of a request's life, without trio."""

import pytest

from omni_trio.request.lifecycle import ContractViolation, RequestLifecycle


def running(outputs=("a", "b")) -> RequestLifecycle:
    lc = RequestLifecycle("r", outputs)
    lc.start()
    return lc


def test_finishes_when_every_output_stage_finished():
    lc = running()
    lc.stage_output("a", finished=False)
    lc.stage_output("a", finished=True)
    lc.stage_output("b", finished=True)
    assert lc.end() == "finished"
    assert lc.abort_terminals() == ()


def test_abort_gives_terminals_only_to_stages_without_one():
    lc = running()
    lc.stage_output("a", finished=True)
    assert lc.request_abort()
    assert lc.end() == "aborted"
    # "a" already has its real terminal: never a second (abort) one
    assert lc.abort_terminals() == ("b",)


def test_abort_landing_after_the_last_output_changes_nothing():
    lc = running()
    lc.stage_output("a", finished=True)
    lc.stage_output("b", finished=True)
    assert lc.request_abort()
    assert lc.end() == "finished"
    assert lc.abort_terminals() == ()


def test_an_error_wins_over_an_abort_and_every_error_is_kept():
    lc = running()
    lc.request_abort()
    first, second = RuntimeError("one"), RuntimeError("two")
    lc.fail(first)
    lc.fail(second)
    assert lc.failed
    assert lc.end() == "failed"
    assert lc.errors == (first, second)
    assert lc.abort_terminals() == ()


def test_output_after_finished_breaks_the_contract():
    lc = running()
    lc.stage_output("a", finished=True)
    with pytest.raises(ContractViolation, match="'a'.*after its finished output"):
        lc.stage_output("a", finished=False)


def test_transitions_are_checked():
    lc = RequestLifecycle("r", ["a"])
    assert lc.status == "admitted"
    lc.start()
    with pytest.raises(RuntimeError, match="cannot start"):
        lc.start()
    assert lc.end() == "aborted"
    assert lc.ended
    assert not lc.request_abort()  # nothing to abort any more
    with pytest.raises(RuntimeError, match="already ended"):
        lc.end()
    assert "aborted" in repr(lc)


@pytest.mark.parametrize("n", [3, 9, 2_000])
def test_the_rules_hold_for_any_number_of_finished_stages(n):
    # a handful of finished stages are kept as a tuple, more as a set: the same rules
    outputs = [f"s{i}" for i in range(n)]
    lc = running(outputs)
    for sid in outputs[:-1]:
        lc.stage_output(sid, finished=True)
    assert all(lc.stage_finished(sid) for sid in outputs[:-1])
    assert not lc.stage_finished(outputs[-1])
    for sid in (outputs[0], outputs[-2]):
        with pytest.raises(ContractViolation, match=f"stage '{sid}' produced an output"):
            lc.stage_output(sid, finished=False)
    assert lc.request_abort()
    assert lc.end() == "aborted"
    assert lc.abort_terminals() == (outputs[-1],)
    done = running(outputs)
    for sid in outputs:
        done.stage_output(sid, finished=True)
    assert done.end() == "finished" and done.abort_terminals() == ()
