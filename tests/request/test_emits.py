"""The emit each kind of stage run gives its backend (request/emits.py): what the awaited emit
does, and when the fast path refuses (nothing changed) so that the awaited one decides. The
consumer's side is the request's own (``next_output``). MockClock: a read that would wait
fails at once."""

import trio
import trio.testing

from omni_trio.context import RequestContext
from omni_trio.errors import StageError
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.request.emits import CollectEmit, OutboxEmit, pulled_emitter
from omni_trio.request.planning import RequestPlan
from omni_trio.request.state import Request
from omni_trio.transport.queue import OutputQueue


def out(tok: int, finished: bool = False) -> StageOutput:
    return StageOutput(token_ids=(tok,), finished=finished)


def request(window: int = 2, stages: tuple[str, ...] = ("s",)) -> Request:
    # the consumer reads (stage id, output) pairs: what the stages sent, as they sent it
    plan = RequestPlan(active=stages, outputs=stages, entries=stages[:1])
    return Request(
        "r",
        plan,
        StageInput(token_ids=(1,), final=True),
        RequestContext("r", [1], sampling_params=dict.fromkeys(stages)),
        window,
        lambda rid, sid, o: (sid, o),  # type: ignore[arg-type,return-value]
    )


async def take(req: Request, n: int) -> list[tuple[str, StageOutput]]:
    """The next ``n`` items the consumer reads; fails if fewer are queued (nothing else
    would run: the clock jumps)."""
    with trio.fail_after(1):
        return [await req.next_output() for _ in range(n)]  # type: ignore[misc]


async def queued(req: Request) -> list[tuple[str, StageOutput]]:
    """Every item the consumer finds to read now (it reads until it would wait)."""
    items = []
    while True:
        with trio.move_on_after(1) as waited:
            items.append(await req.next_output())
        if waited.cancelled_caught:
            return items  # type: ignore[return-value]


async def test_pulled_fast_path_fills_the_window_then_refuses_and_emit_waits(autojump_clock):
    req = request(window=2)
    emit = pulled_emitter(req, "s")
    assert emit.nowait(out(1)) and emit.nowait(out(2))
    assert not emit.nowait(out(3))  # the window is full: nothing changed
    assert req.n_produced == 2
    # the awaited emit takes the room there is without a checkpoint, else waits for room
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emit, out(3))
        await trio.testing.wait_all_tasks_blocked()
        assert req.n_produced == 3  # recorded, waiting for room
        assert await take(req, 2) == [("s", out(1)), ("s", out(2))]
    assert await take(req, 1) == [("s", out(3))]
    with trio.testing.assert_no_checkpoints():
        await emit(out(4))
    assert await take(req, 1) == [("s", out(4))]
    assert await queued(req) == []


async def test_pulled_refuses_once_aborting_or_failed(autojump_clock):
    req = request()
    assert pulled_emitter(req, "s").nowait(out(1, finished=True))
    assert req.stage_finished("s")
    failed = request()
    failed.fail("s", StageError("boom"))
    assert not pulled_emitter(failed, "s").nowait(out(1))
    aborting = request()
    aborting.request_abort()
    assert not pulled_emitter(aborting, "s").nowait(out(1))
    assert await queued(aborting) == [] and aborting.n_produced == 0
    gone = request()
    gone.close_receiver()
    assert not pulled_emitter(gone, "s").nowait(out(1)) and gone.n_produced == 0


async def test_deliver_a_finished_output_never_waits_for_the_window(autojump_clock):
    req = request(window=1)
    await req.deliver("s", out(1))
    with trio.testing.assert_no_checkpoints():
        await req.deliver("s", out(2, finished=True))  # past the full window
    assert await take(req, 2) == [("s", out(1)), ("s", out(2, finished=True))]


async def test_deliver_to_a_consumer_gone_aborts_the_request():
    req = request()
    req.close_receiver()
    await req.deliver("s", out(1))
    assert req.stopping and not req.failed
    assert req.end() == "aborted"


async def test_collect_keeps_every_output_in_order_and_refuses_once_aborting_or_failed():
    req = request()
    collect = CollectEmit(req, "s")
    with trio.testing.assert_no_checkpoints():
        await collect.emit(out(1))
    assert collect.emit_nowait(out(2, finished=True))
    assert [o.token_ids for o in collect.outputs()] == [(1,), (2,)]
    assert req.stage_finished("s") and req.n_produced == 2
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
    assert req.produced() == [("x", out(0)), ("s", out(1)), ("x", out(2)), ("s", out(3, True))]


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
