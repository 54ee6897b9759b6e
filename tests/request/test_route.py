"""A routed stage's routing task (request/route.py) on its own: what it delivers, in which
order, what a stage's normal or abnormal end hands on, and what fails the request."""

import pytest
import trio
import trio.testing

from omni_trio.errors import StageError
from omni_trio.observer import ObserverSet
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.request.feeds import StageFeed
from omni_trio.request.route import COMPLETED, STOPPED, finish_feeds, route_stage
from omni_trio.request.state import Request
from omni_trio.stages.processors import InputProcessor, token_handoff
from omni_trio.transport.queue import OutputQueue

from .test_emits import out, queued, take
from .test_emits import request as emits_request


def request() -> Request:
    # stage "s", an output stage, with room in the consumer's window for every test here
    return emits_request(window=4)


class Events:
    """An observer noting the routing task's stage events (without their times)."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, ...]] = []

    def stage_started(self, rid: str, sid: str, t: float) -> None:
        self.seen.append(("started", sid))

    def stage_output(self, rid: str, sid: str, first: bool, t: float) -> None:
        self.seen.append(("output", sid, first))

    def stage_finished(self, rid: str, sid: str, status: str, t: float) -> None:
        self.seen.append(("finished", sid, status))


def observed() -> tuple[ObserverSet, Events]:
    observers, events = ObserverSet(), Events()
    observers.add(events)  # type: ignore[arg-type]
    return observers, events


def feed_to(
    req: Request,
    observers: ObserverSet,
    stage: str = "t",
    upstream: tuple[str, ...] = ("s",),
    send: trio.MemorySendChannel[StageInput] | None = None,
    *,
    stream: bool = False,
    processor: InputProcessor = token_handoff,
) -> StageFeed:
    # by default a stage taking its upstream's whole input: without a channel (deferred),
    # it starts only once that input is complete
    return StageFeed(
        stage,
        upstream,
        stream=stream,
        processor=processor,
        options={},
        send=send,
        request_id=req.request_id,
        observers=observers,
    )


async def test_outputs_go_out_in_order_and_a_normal_end_without_a_finished_one_stops(
    autojump_clock,
):
    req = request()
    observers, events = observed()
    outbox: OutputQueue[StageOutput] = OutputQueue(4)
    for tok in (1, 2):
        outbox.send_nowait(out(tok))
    outbox.send_final_nowait(COMPLETED)
    outbox.close()
    ready = await route_stage(req, "s", outbox, (), True, observers)
    assert list(ready) == []
    assert await queued(req) == [("s", out(1)), ("s", out(2)), ("s", STOPPED)]
    assert req.stage_finished("s") and not req.failed
    assert events.seen == [
        ("started", "s"),
        ("output", "s", True),
        ("output", "s", False),
        ("output", "s", False),
        ("finished", "s", "finished"),
    ]


async def test_an_outbox_ended_without_completed_is_no_normal_end(autojump_clock):
    # the backend failed or was aborted: no STOPPED output, nothing made ready
    req = request()
    observers, events = observed()
    feed = feed_to(req, observers)
    outbox: OutputQueue[StageOutput] = OutputQueue(4)
    outbox.send_nowait(out(1))
    outbox.close()
    ready = await route_stage(req, "s", outbox, (feed,), True, observers)
    assert list(ready) == []
    assert await queued(req) == [("s", out(1))]
    assert not req.stage_finished("s")
    assert events.seen[-1] == ("finished", "s", "aborted")


async def test_a_normal_end_makes_a_deferred_downstream_stage_ready_with_its_whole_input(
    autojump_clock,
):
    req = request()
    observers = ObserverSet()
    feed = feed_to(req, observers)
    outbox: OutputQueue[StageOutput] = OutputQueue(4)
    outbox.send_nowait(out(5))
    outbox.send_nowait(out(6, finished=True))
    outbox.send_final_nowait(COMPLETED)
    outbox.close()
    ready = await route_stage(req, "s", outbox, (feed,), True, observers)
    ((made_ready, chunk),) = ready
    assert made_ready is feed
    assert chunk is not None and chunk.token_ids == (5, 6) and chunk.final


def broken(upstream, *, final, options, context=None):
    raise RuntimeError("no input for you")


async def test_a_failing_input_processor_fails_the_request_without_raising(autojump_clock):
    req = request()
    observers, events = observed()
    send, _receive = trio.open_memory_channel[StageInput](4)
    streaming = feed_to(req, observers, send=send, stream=True, processor=broken)
    outbox: OutputQueue[StageOutput] = OutputQueue(4)
    outbox.send_nowait(out(1))
    outbox.send_nowait(out(2, finished=True))
    outbox.send_final_nowait(COMPLETED)
    outbox.close()
    ready = await route_stage(req, "s", outbox, (streaming,), True, observers)
    assert list(ready) == []
    assert req.failed
    assert events.seen[-1] == ("finished", "s", "failed")
    assert req.end() == "failed"
    # the caller gets the output routed before, then the downstream stage's failure,
    # caused by its processor
    assert await take(req, 1) == [("s", out(1))]
    with pytest.raises(StageError) as info:
        await req.next_output()
    assert info.value.stage_id == "t" and isinstance(info.value.__cause__, RuntimeError)


async def test_unstreamed_outputs_after_the_first_are_routed_when_the_outbox_is_full(
    autojump_clock,
):
    req = request()
    outbox: OutputQueue[StageOutput] = OutputQueue(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(route_stage, req, "s", outbox, (), False, ObserverSet())
        await trio.testing.wait_all_tasks_blocked()
        outbox.send_nowait(out(1))
        await trio.testing.wait_all_tasks_blocked()
        assert await queued(req) == [("s", out(1))]  # the first one at once (its time is a metric)
        outbox.send_nowait(out(2))
        await trio.testing.wait_all_tasks_blocked()
        assert await queued(req) == []  # batched: the routing task still waits
        outbox.send_nowait(out(3))  # the outbox is full: both go
        await trio.testing.wait_all_tasks_blocked()
        assert await queued(req) == [("s", out(2)), ("s", out(3))]
        outbox.close()


def test_finish_feeds_sends_a_running_stage_its_chunk_and_readies_a_deferred_one():
    req = request()
    observers = ObserverSet()
    deferred = feed_to(req, observers)
    send, _receive = trio.open_memory_channel[StageInput](1)
    running = feed_to(req, observers, "u", ("s", "v"), send)
    deferred.take("s", out(7, finished=True))
    ready: list[tuple[StageFeed, StageInput | None]] = []
    assert finish_feeds("s", (deferred, running), ready) == []  # "u" still waits for "v"
    assert [(f, c.token_ids if c else None) for f, c in ready] == [(deferred, (7,))]
    running.take("v", out(8, finished=True))
    to_send = finish_feeds("v", (running,), ready)
    assert [(f, c.token_ids if c else None) for f, c in to_send] == [(running, (8,))]
