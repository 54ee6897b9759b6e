"""One admitted request (request/state.py) on its own: what its methods own, the only way its
state changes. MockClock: a read that would wait fails at once."""

import pytest
import trio
import trio.testing

from omni_trio.context import RequestContext
from omni_trio.errors import InvalidRequestError, StageError
from omni_trio.outputs import StageInput
from omni_trio.request.planning import RequestPlan
from omni_trio.request.state import Request, RequestHandle
from omni_trio.request.streaming_input import RequestInput

from .test_emits import out, take


def request(stages: tuple[str, ...] = ("a", "b"), streamed: RequestInput | None = None) -> Request:
    plan = RequestPlan(active=stages, outputs=stages[-1:], entries=stages[:1])
    params = {sid: {"max_tokens": i + 1} for i, sid in enumerate(stages)}
    return Request(
        "r",
        plan,
        StageInput(token_ids=(7,), final=True),
        RequestContext("r", [7], sampling_params=params),
        4,
        lambda rid, sid, o: (sid, o),  # type: ignore[arg-type,return-value]
        streamed,
    )


async def test_what_it_carries_is_read_only_and_per_stage():
    req = request()
    assert req.plan.entries == ("a",) and req.context.request_id == "r"
    assert req.sampling_params("b") == {"max_tokens": 2}
    with req.entry_input() as whole:  # the prompt, whole: one chunk, then the end
        assert (await whole.receive()).token_ids == (7,)
        with pytest.raises(trio.EndOfChannel):
            await whole.receive()
    streamed = RequestInput("r", "a", StageInput(token_ids=(7,), final=True), 2)
    req = request(streamed=streamed)
    assert req.entry_input() is streamed.receiver  # the segments the caller sends
    await req.send_input(StageInput(token_ids=(8,)))
    assert [(await streamed.receiver.receive()).token_ids for _ in range(2)] == [(7,), (8,)]


async def test_input_refused_without_streaming_input():
    req = request()
    with trio.testing.assert_checkpoints():
        with pytest.raises(InvalidRequestError, match="without streaming_input=True"):
            await req.send_input(StageInput(token_ids=(1,)))
    with trio.testing.assert_checkpoints():
        await req.end_input()  # a no-op


async def test_an_abort_or_a_failure_cancels_its_run_scope():
    for stop in ("abort", "fail"):
        req = request()
        with req.run_scope():
            assert not req.stopping
            if stop == "abort":
                req.request_abort()
            else:
                req.fail("a", RuntimeError("broken"))
            assert req.stopping and req.failed == (stop == "fail")
            await trio.lowlevel.checkpoint()
            pytest.fail("the request's scope was not cancelled")


async def test_a_finished_request_ends_its_outputs(autojump_clock):
    req = request()
    req.record("a", out(1, finished=True))  # not an output stage: kept, not queued
    await req.send_output("b", out(2))
    await req.send_output("b", out(3, finished=True))
    assert req.stage_finished("a") and req.stage_finished("b") and req.n_produced == 3
    assert req.end() == "finished" and req.ended
    assert await take(req, 2) == [("b", out(2)), ("b", out(3, finished=True))]
    with pytest.raises(StopAsyncIteration):
        await req.next_output()
    assert await req.abort() == []  # ended: nothing to abort


async def test_an_aborted_request_gives_its_outputs_so_far_and_abort_terminals(autojump_clock):
    req = request()
    handle = RequestHandle(req)
    req.record("a", out(1, finished=True))
    await req.send_output("b", out(2))
    req.request_abort()
    assert req.end() == "aborted" and handle.status == "aborted"
    assert [(sid, o.token_ids) for sid, o in await req.aborted()] == [("a", (1,)), ("b", (2,))]
    # the consumer reads what was queued, then one abort terminal for the output stage
    got = [item async for item in handle.outputs()]
    assert [(sid, o.finish_reason) for sid, o in got] == [("b", None), ("b", "abort")]


async def test_a_failed_request_raises_its_error_to_the_consumer_and_to_abort(autojump_clock):
    req = request()
    await req.send_output("b", out(2))
    req.fail("b", RuntimeError("broken"))
    assert req.end() == "failed"
    assert await take(req, 1) == [("b", out(2))]
    with pytest.raises(StageError, match="stage 'b' failed request 'r'") as info:
        await req.next_output()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(StageError) as aborted:
        await req.aborted()
    assert [sid for sid, _ in aborted.value.partial_outputs] == ["b"]


async def test_the_consumer_gone_drops_outputs_and_aborts(autojump_clock):
    req = request()
    handle = RequestHandle(req)
    handle.close_receiver()
    assert not req.send_output_nowait("b", out(1))  # nothing changed
    assert req.n_produced == 0 and not req.stopping
    await req.send_output("b", out(1))  # recorded, then the consumer is found gone
    assert req.n_produced == 1 and req.stopping and not req.failed
    assert req.end() == "aborted"
