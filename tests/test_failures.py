"""Several failures, one typed error: the pure merge rules."""

from omni_trio.errors import StageError, StageStartError, StageStopError
from omni_trio.failures import (
    leaves,
    merge_start_errors,
    merge_stop_errors,
    request_error,
    single_leaf,
)


def test_leaves_and_single_leaf_see_through_nesting():
    a, b = ValueError("a"), KeyError("b")
    nested = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [a]), b])
    assert leaves(nested) == [a, b]
    assert single_leaf(nested) is None
    assert single_leaf(ExceptionGroup("one", [ExceptionGroup("deep", [a])])) is a


def test_one_failure_is_raised_as_it_is():
    start = StageStartError("a", "boom")
    assert merge_start_errors([start]) is start
    stop = StageStopError([("a[0]", OSError("x"))])
    assert merge_stop_errors(ExceptionGroup("g", [stop])) is stop
    err = StageError("bad", stage_id="a")
    assert request_error("r", [err]) is err


def test_several_failures_name_every_one_and_keep_every_cause():
    starts = [StageStartError("a", "boom"), StageStartError("b", "bang")]
    merged = merge_start_errors(starts)
    assert merged.stage_id == "a, b" and "boom" in str(merged) and "bang" in str(merged)
    assert list(merged.__cause__.exceptions) == starts

    stops = [StageStopError([("a[0]", OSError("x"))]), StageStopError([("b[0]", OSError("y"))])]
    merged_stop = merge_stop_errors(ExceptionGroup("g", [stops[0], KeyError("other"), stops[1]]))
    assert [name for name, _ in merged_stop.failures] == ["a[0]", "b[0]"]
    assert list(merged_stop.__cause__.exceptions) == stops

    errors = [StageError("one", stage_id="a"), StageError("two", stage_id="b")]
    merged_req = request_error("r", errors)
    assert isinstance(merged_req, StageError) and merged_req.request_id == "r"
    assert "failed in 2 places (stages a, b)" in str(merged_req)
    assert list(merged_req.__cause__.exceptions) == errors
