"""The emit each kind of stage run gives its backend (_stage_emits.py): what the awaited emit
does, and when the fast path refuses (nothing changed) so that the awaited one decides."""

import trio
import trio.testing

from omni_trio.context import RequestContext
from omni_trio.errors import StageError
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.request.emits import CollectEmit, OutboxEmit, PulledEmit, deliver
from omni_trio.request.planning import RequestPlan
from omni_trio.request.state import Request
from omni_trio.transport.queue import OutputQueue


def out(tok: int, finished: bool = False) -> StageOutput:
    return StageOutput(token_ids=(tok,), finished=finished)


def request(window: int = 2) -> Request:
    plan = RequestPlan(active=("s",), outputs=("s",), entries=("s",))
    return Request(
        "r",
        plan,
        StageInput(token_ids=(1,), final=True),
        RequestContext("r", [1]),
        window,
        lambda rid, sid, o: o,
    )


def queued(req: Request) -> list[tuple[str, StageOutput]]:
    items = []
    while True:
        try:
            items.append(req.queue.receive_nowait())
        except trio.WouldBlock:
            return items


async def test_pulled_fast_path_fills_the_window_then_refuses_and_emit_waits():
    req = request(window=2)
    pulled = PulledEmit(req, "s")
    assert pulled.emit_nowait(out(1)) and pulled.emit_nowait(out(2))
    assert not pulled.emit_nowait(out(3))  # the window is full: nothing changed
    assert req.n_produced == 2
    # the awaited emit takes the room there is without a checkpoint, else waits for room
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pulled.emit, out(3))
        await trio.testing.wait_all_tasks_blocked()
        assert req.n_produced == 3  # recorded, waiting for room
        assert [o.token_ids for _, o in queued(req)] == [(1,), (2,)]
    assert [o.token_ids for _, o in queued(req)] == [(3,)]
    with trio.testing.assert_no_checkpoints():
        await pulled.emit(out(4))
    assert [o.token_ids for _, o in queued(req)] == [(4,)]


async def test_pulled_refuses_once_aborting_or_failed():
    req = request()
    pulled = PulledEmit(req, "s")
    assert pulled.emit_nowait(out(1, finished=True))
    assert req.lifecycle.stage_finished("s")
    failed = request()
    failed.fail("s", StageError("boom"))
    assert not PulledEmit(failed, "s").emit_nowait(out(1))
    aborting = request()
    aborting.request_abort()
    assert not PulledEmit(aborting, "s").emit_nowait(out(1))
    assert queued(aborting) == []


async def test_deliver_a_finished_output_never_waits_for_the_window():
    req = request(window=1)
    await deliver(req, ("s", out(1)))
    with trio.testing.assert_no_checkpoints():
        await deliver(req, ("s", out(2, finished=True)))  # past the full window
    assert [o.token_ids for _, o in queued(req)] == [(1,), (2,)]


async def test_deliver_to_a_consumer_gone_aborts_the_request():
    req = request()
    req.queue.close_receiver()
    await deliver(req, ("s", out(1)))
    assert req.lifecycle.abort_requested


async def test_collect_keeps_every_output_in_order_and_refuses_once_aborting_or_failed():
    req = request()
    collect = CollectEmit(req, "s")
    with trio.testing.assert_no_checkpoints():
        await collect.emit(out(1))
    assert collect.emit_nowait(out(2, finished=True))
    assert [o.token_ids for o in collect.outputs()] == [(1,), (2,)]
    assert req.lifecycle.stage_finished("s") and req.n_produced == 2
    aborting = request()
    aborting.request_abort()
    assert not CollectEmit(aborting, "s").emit_nowait(out(1))
    failed = request()
    failed.fail("s", StageError("boom"))
    assert not CollectEmit(failed, "s").emit_nowait(out(1))


async def test_collect_hands_on_its_own_outputs_from_the_requests_one_list():
    req = request()
    req.record("x", out(0))  # another stage's, before this one started
    collect = CollectEmit(req, "s")
    await collect.emit(out(1))
    req.record("x", out(2))  # meanwhile
    assert collect.emit_nowait(out(3, finished=True))
    assert collect.outputs() == [out(1), out(3, finished=True)]
    assert req.stage_outputs("x") == [out(0), out(2)]
    # kept once, by the request, in the order they came (what abort() returns)
    assert [o.token_ids for o in req.produced()] == [(0,), (1,), (2,), (3,)]


async def test_outbox_emit_fills_the_outbox_then_waits_for_room():
    req = request()
    outbox: OutputQueue[StageOutput] = OutputQueue(1)
    emit = OutboxEmit(req, outbox)
    assert emit.emit_nowait(out(1))
    assert not emit.emit_nowait(out(2))  # full
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emit.emit, out(2))
        await trio.testing.wait_all_tasks_blocked()
        assert outbox.receive_nowait().token_ids == (1,)  # room: the waiting emit goes on
    assert outbox.receive_nowait().token_ids == (2,)
    req.request_abort()
    assert not emit.emit_nowait(out(3))
    outbox.close()
    assert not OutboxEmit(request(), outbox).emit_nowait(out(4))  # a closed outbox
