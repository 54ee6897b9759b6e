"""A routed stage's routing task (:func:`route_stage`), and how a stage's end is handed on.

A stage of a request gets a routing task (see :mod:`omni_trio.request.run`) when its outputs
are needed as they come by more than the request's own queue: an output stage that feeds
another stage, a stage feeding a ``stream_input`` stage, or every stage while observers
watch the engine. Its backend's emit (:class:`~omni_trio.request.emits.OutboxEmit`) only
fills the stage's bounded outbox; the routing task, the orchestrator's code and never the
backend's call stack, takes each output from it and delivers it to the caller, to the
observers and to the downstream stages' input processors. The outbox ends with
:data:`COMPLETED` only when the backend returned normally: then the stage gets its finished
output if it had none (:data:`STOPPED`) and its feeds are finished (:func:`finish_feeds`,
which the runner's collected stages use too).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ..errors import OmniTrioError
from ..observer import ObserverSet
from ..outputs import StageInput, StageOutput
from ..transport.queue import OutputQueue
from .feeds import StageFeed
from .state import Request

__all__ = ["COMPLETED", "NONE_READY", "STOPPED", "Ready", "finish_feeds", "route_stage"]

#: the deferred downstream stages a stage's end made ready, each with its whole input
Ready = Sequence[tuple[StageFeed, StageInput | None]]
#: no deferred stage made ready
NONE_READY: Ready = ()

#: the finished output a stage gets when its backend returned without one
STOPPED = StageOutput(finished=True, finish_reason="stop")
#: what a stage's outbox ends with when its backend returned normally
COMPLETED = StageOutput(finished=True, finish_reason="completed")


def finish_feeds(
    sid: str, feeds: Sequence[StageFeed], ready: list[tuple[StageFeed, StageInput | None]]
) -> list[tuple[StageFeed, StageInput | None]]:
    """Stage ``sid`` finished: the final chunk of each downstream stage that has all its
    input now. Deferred ones go to ``ready`` (to be started); the others are returned,
    for the caller to send with ``send_final``. Synchronous. Raises StageError if an
    input processor fails."""
    to_send: list[tuple[StageFeed, StageInput | None]] = []
    for feed in feeds:
        if feed.finish(sid):
            (ready if feed.deferred else to_send).append((feed, feed.final_chunk()))
    return to_send


async def route_stage(
    req: Request,
    sid: str,
    outbox: OutputQueue[StageOutput],
    feeds: Sequence[StageFeed],
    streamed: bool,
    observers: ObserverSet,
) -> Ready:
    """The routing task of stage ``sid`` of ``req``: route each output of its outbox until
    the outbox ends; what the stage's end made ready. Checkpoints. A routing failure
    (an input processor) fails the request, it is not raised."""
    rid = req.request_id
    status = "aborted"
    first = True
    completed = False
    # Outputs nobody needs promptly (no caller gets them, no downstream stage streams
    # them) are routed in batches: after the first one (its time is a metric), this task
    # wakes when the outbox is full or the backend ended, not once per output.
    batch = not streamed
    ready: list[tuple[StageFeed, StageInput | None]] = []
    # whether the caller gets its outputs (an output stage)
    output = sid in req.plan.output_set
    if observers:
        observers.emit("stage_started", rid, sid)
    try:
        while True:
            # take what is queued without a scheduler trip; wait only when nothing is
            try:
                out = outbox.receive_nowait()
            except trio.WouldBlock:
                if batch and not first:
                    await outbox.wait_full()
                    continue
                try:
                    out = await outbox.receive()
                except trio.EndOfChannel:
                    break
            except trio.EndOfChannel:
                break
            if out is COMPLETED:
                completed = True
                continue
            await _route(req, sid, out, output, feeds, first, observers)
            first = False
        if completed and not req.failed:
            if not req.stage_finished(sid):
                # the backend ended without a finished output; the caller gets one
                await _route(req, sid, STOPPED, output, feeds, first, observers)
            for feed, chunk in finish_feeds(sid, feeds, ready):
                await feed.send_final(chunk)
            status = "finished"
    except OmniTrioError as exc:
        # a routing failure (an input processor): cancels the request, and with it this
        # stage's backend
        req.fail(sid, exc)
    finally:
        if req.failed and status != "finished":
            status = "failed"
        if observers:
            observers.emit("stage_finished", rid, sid, status)
    return ready if status == "finished" else NONE_READY


async def _route(
    req: Request,
    sid: str,
    out: StageOutput,
    output: bool,
    feeds: Sequence[StageFeed],
    first: bool,
    observers: ObserverSet,
) -> None:
    """Deliver one output of stage ``sid``: to the caller (if ``output``, an output stage)
    and to the downstream feeds. Checkpoints only when a channel is full (backpressure); the routing
    loop that calls it checkpoints per output. Raises StageError (an input processor
    failed)."""
    req.record(sid, out)
    if observers:
        observers.emit("stage_output", req.request_id, sid, first)
        observers.emit("stage_delta", req.request_id, sid, out)
    if output:
        # the routing loop checkpoints on every output it takes from the outbox: pass
        # this one on without another trip through the scheduler unless the window is full
        await req.deliver(sid, out)
    for feed in feeds:
        chunk = feed.take(sid, out)
        if chunk is not None:
            await feed.send(sid, chunk)
