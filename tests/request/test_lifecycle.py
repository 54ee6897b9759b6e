"""RequestLifecycle: the pure rules of a request's life, without trio."""

import pytest

from omni_trio.request.lifecycle import RequestLifecycle


def running(outputs=("a", "b")) -> RequestLifecycle:
    lc = RequestLifecycle("r", outputs)
    lc.start()
    return lc


def test_finishes_when_every_output_stage_finished():
    lc = running()
    lc.finish_stage("a")
    assert lc.stage_finished("a") and not lc.stage_finished("b")
    lc.finish_stage("b")
    assert lc.end() == "finished"
    assert lc.abort_terminals() == ()


def test_abort_gives_terminals_only_to_stages_without_one():
    lc = running()
    lc.finish_stage("a")
    assert lc.request_abort()
    assert lc.end() == "aborted"
    # "a" already has its real terminal: never a second (abort) one
    assert lc.abort_terminals() == ("b",)


def test_abort_landing_after_the_last_output_changes_nothing():
    lc = running()
    lc.finish_stage("a")
    lc.finish_stage("b")
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


def test_transitions_are_checked():
    lc = RequestLifecycle("r", ["a"])
    assert lc.status == "admitted"
    lc.start()
    with pytest.raises(RuntimeError, match="cannot start"):
        lc.start()
    assert lc.end() == "aborted" and lc.status == "aborted"
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
        lc.finish_stage(sid)
    assert all(lc.stage_finished(sid) for sid in outputs[:-1])
    assert not lc.stage_finished(outputs[-1])
    assert lc.request_abort()
    assert lc.end() == "aborted"
    assert lc.abort_terminals() == (outputs[-1],)
    done = running(outputs)
    for sid in outputs:
        done.finish_stage(sid)
    assert done.end() == "finished" and done.abort_terminals() == ()
