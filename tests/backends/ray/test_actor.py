"""The trio side of a Ray replica actor (``ReplicaHost``), without Ray: what a request's run
posts, in what order, and the wire form of a failure."""

from __future__ import annotations

import pytest
import trio

from omni_trio import StageError, load_config
from omni_trio.backends.ray.actor import STARTED, ReplicaHost, error_record, raise_record
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.errors import ReplicaDeadError
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.stages import StageAborted
from omni_trio.transport import codec


def host(*, stream_input: bool) -> ReplicaHost:
    stage = {"id": "b", "final_output": True, "stream_input": stream_input}
    c = load_config({"stages": [{**stage, "options": {"outputs": 3}}]})
    return ReplicaHost(ScriptedBackend(c.stages[0], stage_index=0))


def chunk(*tokens: int, final: bool) -> bytes:
    return codec.encode_inputs([StageInput(token_ids=tokens, final=final)])


async def run(
    h: ReplicaHost, first: bytes, *, more: bool, posted: list, started: trio.Event, announce=None
):
    def post(item):
        posted.append(item)
        if item[0] == STARTED:
            started.set()

    none = codec.encode_value(None)
    await h.run(
        "r", first, none, True, None, more, more if announce is None else announce, 16, post
    )


async def test_a_request_with_more_input_says_started_before_anything_else(autojump_clock):
    # the caller sends its next chunks only after STARTED: a chunk that reaches the host
    # before the request's run is refused (Ray and trio start calls in no set order)
    h = host(stream_input=True)
    posted: list = []
    started = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.serve)
        assert await h.send_input("r", chunk(5, final=False)) is False
        async with trio.open_nursery() as runs:
            runs.start_soon(
                lambda: run(h, chunk(1, final=False), more=True, posted=posted, started=started)
            )
            await started.wait()
            assert posted[0] == (STARTED, None)
            assert await h.send_input("r", chunk(2, 3, final=True)) is True
        nursery.cancel_scope.cancel()
    outs = [item[1] for item in posted[1:]]
    assert all(isinstance(o, StageOutput) for o in outs)
    assert [t for o in outs for t in o.token_ids] == [2, 3, 4]
    assert outs[-1].finished and len(outs) == 3
    assert h.backend.statistics().requests_in_flight == 0
    # the request has ended: a late chunk is refused, not queued
    assert await h.send_input("r", chunk(9, final=True)) is False


async def test_an_announced_request_takes_interactions_once_started(autojump_clock):
    # a backend that takes interactions: every request is announced, and an interaction
    # that crosses after STARTED finds it (the caller sends none before)
    h = host(stream_input=False)
    assert h.backend.takes_interactions
    posted: list = []
    started = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.serve)
        assert await h.interact("r", codec.encode_value({"stop": True})) is False
        async with trio.open_nursery() as runs:
            runs.start_soon(
                lambda: run(
                    h,
                    chunk(1, final=True),
                    more=False,
                    posted=posted,
                    started=started,
                    announce=True,
                )
            )
            await started.wait()
            assert posted[0] == (STARTED, None)
            assert await h.interact("r", codec.encode_value({"stop": True})) is True
        nursery.cancel_scope.cancel()
    assert posted[-1][1].finished and posted[-1][1].finish_reason == "stop"
    assert h.backend.interactions["r"] == [{"stop": True}]


async def test_a_request_with_all_its_input_posts_no_started(autojump_clock):
    h = host(stream_input=False)
    posted: list = []
    async with trio.open_nursery() as nursery:
        await nursery.start(h.serve)
        await run(h, chunk(1, 2, final=True), more=False, posted=posted, started=trio.Event())
        nursery.cancel_scope.cancel()
    assert STARTED not in [kind for kind, _ in posted]
    assert len(posted) == 3 and posted[-1][1].finished


@pytest.mark.parametrize(
    ("exc", "raised"),
    [
        (ReplicaDeadError("gone", stage_id="b"), ReplicaDeadError),
        (StageAborted("aborted"), StageAborted),
        (KeyError("x"), StageError),
    ],
)
def test_a_failure_crosses_as_a_record_and_keeps_its_type(exc, raised):
    record = error_record(exc)
    with pytest.raises(raised) as info:
        raise_record(record, "r")
    if raised is StageError:
        assert str(info.value).startswith("KeyError")


def test_the_actor_freezes_its_startup_heap_from_start_to_stop():
    # ReplicaActor is a plain class until ray.remote makes it an actor: run it on an asyncio
    # loop here, as Ray's actor process would
    import asyncio
    import gc

    import msgspec

    from omni_trio.backends.ray.actor import ReplicaActor

    stage = load_config({"stages": [{"id": "a", "final_output": True}]}).stages[0]
    frozen: list[int] = []

    async def life() -> str | None:
        actor = ReplicaActor(msgspec.json.encode(stage), 0, 0, 5.0)
        try:
            frozen.append(gc.get_freeze_count())
            await actor.start()
            frozen.append(gc.get_freeze_count())
            failure = await actor.stop()
            frozen.append(gc.get_freeze_count())
            return failure
        finally:
            actor.close()  # its trio thread: left to the collector, it may hang a later test

    assert asyncio.run(life()) is None
    # not before it started, through its serving, not after it stopped
    assert frozen[0] == 0 and frozen[1] > 0 and frozen[2] == 0


def test_an_actor_whose_start_fails_never_freezes_the_heap():
    import asyncio
    import gc

    import msgspec

    from omni_trio.backends.ray.actor import ReplicaActor

    stage = load_config(
        {"stages": [{"id": "a", "final_output": True, "options": {"fail_start": True}}]}
    ).stages[0]

    async def life() -> tuple[BaseException | None, int, str | None]:
        actor = ReplicaActor(msgspec.json.encode(stage), 0, 0, 5.0)
        try:
            try:
                await actor.start()
            except Exception as exc:
                failed: BaseException | None = exc
            else:
                failed = None
            frozen = gc.get_freeze_count()
            return failed, frozen, await actor.stop()
        finally:
            actor.close()

    failed, frozen, _ = asyncio.run(life())
    assert failed is not None and "fail_start" in str(failed)
    assert frozen == 0 and gc.get_freeze_count() == 0
