"""Aborting through the engine (issue 31, items 4 and 5): a request waiting for admission is
reached by every abort route (it leaves the queue at once, never runs, its consumer gets its
abort terminals, the next waiter gets the slot); an abort's wait ends with the caller's cancel
scope while the abort completes in the background, and leaving a stream still waits for every
stage. Scripted stages on the MockClock."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from trio.testing import assert_checkpoints, wait_all_tasks_blocked

import omni_trio
from omni_trio import Engine, OmniOutput
from omni_trio.engine.admission import AdmissionGate
from omni_trio.engine.orchestrator import Orchestrator
from omni_trio.engine.streams import RequestStream
from omni_trio.observer import EngineObserver
from omni_trio.request.companions import Companion
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
    scripted_pipeline,
    wait_until_idle,
)

#: where ``make_artifacts`` makes its directories (set per test by the ``root`` fixture)
ROOT = Path("/nonexistent")


def make_artifacts(prompt, request_id):
    top = ROOT / request_id
    top.mkdir(parents=True)
    (top / "image.bin").write_bytes(b"\x00" * 64)
    return prompt, [top]


def negative(prompt, sampling_params):
    return [Companion("negative", "a blurry picture")]


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    return tmp_path


def gated(**options: object) -> omni_trio.PipelineConfig:
    """Two hanging stages, both output stages, one request in flight at most."""
    return scripted_pipeline(
        ["a", "b"],
        hang=True,
        final_outputs=["a", "b"],
        engine_options={"max_requests_in_flight": 1},
        **options,
    )


def ran(engine: Engine) -> set[str]:
    """Every request id a stage's backend was given (the scripted backends' records)."""
    return {rid for sid in ("a", "b") for b in scripted_backends(engine, sid) for rid in b.received}


def assert_abort_terminals(outs: list[OmniOutput], rid: str) -> None:
    # what an aborted running request ends with: one terminal per output stage
    assert [(o.request_id, o.stage_id, o.finished, o.finish_reason) for o in outs] == [
        (rid, "a", True, "abort"),
        (rid, "b", True, "abort"),
    ]


class Consumer:
    """Enters a stream (waiting for admission), records when it is admitted, what it reads
    and its final status; leaves at once if ``leave`` (an abort of a running request)."""

    def __init__(self, stream: RequestStream, admitted: list[str], *, leave: bool) -> None:
        self.stream = stream
        self.admitted = admitted
        self.leave = leave
        self.outs: list[OmniOutput] | None = None

    async def run(self) -> None:
        async with self.stream as stream:
            self.admitted.append(stream.request_id)
            if self.leave:
                await wait_all_tasks_blocked()  # its stages have it: then it is aborted
            else:
                self.outs = [out async for out in stream]


async def queue(
    engine: Engine, nursery: trio.Nursery, rid: str, admitted: list[str], *, leave: bool = True
) -> Consumer:
    consumer = Consumer(engine.generate(rid, request_id=rid), admitted, leave=leave)
    nursery.start_soon(consumer.run)
    await wait_all_tasks_blocked()
    return consumer


async def read_into(stream: RequestStream, outs: list[OmniOutput]) -> None:
    async with stream:
        outs.extend([out async for out in stream])


async def hold_and_queue(
    engine: Engine, nursery: trio.Nursery, admitted: list[str], *others: str
) -> tuple[RequestStream, Consumer]:
    """Admit h (it holds the one slot), then queue w (reading its outputs) and ``others``
    (each leaving once admitted)."""
    holder = engine.generate("h", request_id="h")
    await holder.__aenter__()
    w = await queue(engine, nursery, "w", admitted, leave=False)
    for rid in others:
        await queue(engine, nursery, rid, admitted)
    return holder, w


ROUTES = ["engine.abort", "abort_nowait", "stream.abort", "abort_many", "abort_nowait_many"]


@pytest.mark.parametrize("route", ROUTES)
async def test_an_aborted_waiting_request_never_runs_and_its_consumer_gets_its_terminals(
    autojump_clock, route
):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        async with omni_trio.open_engine(gated()) as engine:
            admitted: list[str] = []
            async with trio.open_nursery() as nursery:
                holder, w = await hold_and_queue(engine, nursery, admitted, "x", "y")
                assert engine.statistics().requests_waiting == 3
                assert w.stream.status == "pending"

                if route == "engine.abort":
                    with assert_checkpoints():
                        assert await engine.abort("w") == []
                elif route == "abort_nowait":
                    engine.abort_nowait("w")
                elif route == "stream.abort":
                    with assert_checkpoints():
                        assert await w.stream.abort() == []
                elif route == "abort_many":
                    assert await engine.abort(["w", "unknown"]) == {"w": [], "unknown": []}
                else:
                    engine.abort_nowait(["unknown", "w"])
                # at once: out of the queue, not in flight, its consumer has its terminals
                stats = engine.statistics()
                assert (stats.requests_waiting, stats.requests_in_flight) == (2, 1)
                assert engine.orchestrator.admission.in_flight == 1  # h's slot only
                await wait_all_tasks_blocked()
                assert w.outs is not None
                assert_abort_terminals(w.outs, "w")
                assert w.stream.status == "aborted"
                assert admitted == ["w"]  # its stream was entered; its request never ran
                assert engine.statistics().requests_waiting == 2
                await holder.__aexit__(None, None, None)  # h's slot goes to x, then y
            assert admitted == ["w", "x", "y"]  # first-in first-out after the abort
            assert ran(engine) == {"h", "x", "y"}  # never w
            stats = engine.statistics()
            assert (stats.requests_total, stats.requests_aborted) == (4, 4)
            assert (stats.requests_waiting, stats.requests_in_flight) == (0, 0)
            assert engine.orchestrator.admission.in_flight == 0
            assert_nothing_in_flight(engine)


class _AbortOnFinish(EngineObserver):
    """Aborts ``w`` in the same step as ``h`` ends: its slot was just handed to ``w``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def request_finished(self, request_id: str, status: str, t: float) -> None:
        if request_id == "h":
            self.engine.abort_nowait("w")


async def test_a_waiter_aborted_as_its_slot_is_handed_over_passes_it_on(autojump_clock):
    with trio.fail_after(60):
        async with omni_trio.open_engine(gated()) as engine:
            admitted: list[str] = []
            async with trio.open_nursery() as nursery:
                holder, w = await hold_and_queue(engine, nursery, admitted, "x")
                engine.add_observer(_AbortOnFinish(engine))
                await holder.__aexit__(None, None, None)
            assert w.outs is not None
            assert_abort_terminals(w.outs, "w")
            assert sorted(admitted) == ["w", "x"]  # w's stream was entered, x's request ran
            assert ran(engine) == {"h", "x"}
            assert engine.orchestrator.admission.in_flight == 0
            assert_nothing_in_flight(engine)


async def test_an_abort_landing_as_admission_returns_gives_the_slot_back(
    autojump_clock, monkeypatch
):
    """The admission's last schedule point, with room: an abort that lands there wins (the
    request never runs) and the slot it had just taken is given back."""
    real_admit = AdmissionGate.admit

    async def admit_then_abort(gate: AdmissionGate) -> None:
        await real_admit(gate)
        engine.abort_nowait("w")  # as if it came during admit()'s last schedule point

    def no_room(*args: object) -> None:
        raise trio.WouldBlock

    with trio.fail_after(60):
        async with omni_trio.open_engine(gated()) as engine:
            with monkeypatch.context() as patch:
                patch.setattr(Orchestrator, "submit_nowait", no_room)  # take the waiting path
                patch.setattr(AdmissionGate, "admit", admit_then_abort)
                async with engine.generate("w", request_id="w") as stream:
                    outs = [out async for out in stream]
            assert_abort_terminals(outs, "w")
            assert engine.orchestrator.admission.in_flight == 0  # the slot was given back
            assert ran(engine) == set()
            async with engine.generate("x", request_id="x") as stream:
                await wait_all_tasks_blocked()
                assert ran(engine) == {"x"}
            assert_nothing_in_flight(engine)


async def test_a_waiting_plain_async_for_reads_the_abort_terminals_and_a_second_abort_is_a_no_op(
    autojump_clock,
):
    with trio.fail_after(60):
        async with omni_trio.open_engine(gated()) as engine:
            outs: list[OmniOutput] = []

            async def iterate() -> None:
                async for out in engine.generate("w", request_id="w"):  # no async with
                    outs.append(out)

            async with engine.generate("h", request_id="h"), trio.open_nursery() as nursery:
                nursery.start_soon(iterate)
                await wait_all_tasks_blocked()
                assert engine.statistics().requests_waiting == 1
                assert await engine.abort("w") == []
                assert await engine.abort("w") == []  # it ended: unknown now
                assert engine.abort_nowait("w") is None
            assert_abort_terminals(outs, "w")
            assert ran(engine) == {"h"}
            assert_nothing_in_flight(engine)


async def test_a_cancelled_waiter_leaves_at_once_and_an_unentered_stream_aborts_nothing(
    autojump_clock,
):
    """Leaving a waiting stream (its consumer cancelled) takes it out of the queue and
    nothing runs; stream.abort() on a stream not entered is a no-op, and does not touch a
    waiting request of the same id."""
    with trio.fail_after(60):
        async with omni_trio.open_engine(gated()) as engine:
            admitted: list[str] = []
            w_scope = trio.CancelScope()

            async def leaves() -> None:
                with w_scope:
                    async with engine.generate("w", request_id="w"):
                        admitted.append("w")

            async with trio.open_nursery() as nursery:
                holder = engine.generate("h", request_id="h")
                await holder.__aenter__()
                nursery.start_soon(leaves)
                await wait_all_tasks_blocked()
                await queue(engine, nursery, "x", admitted)
                unentered = engine.generate("w", request_id="w")  # same id, never entered
                with assert_checkpoints():
                    assert await unentered.abort() == []
                assert engine.statistics().requests_waiting == 2  # the waiting w is untouched
                w_scope.cancel()
                assert engine.statistics().requests_waiting == 1  # at once
                await holder.__aexit__(None, None, None)  # h's slot goes to x
            assert w_scope.cancelled_caught
            assert admitted == ["x"]
            assert ran(engine) == {"h", "x"}
            stats = engine.statistics()
            assert (stats.requests_total, stats.requests_aborted) == (2, 2)  # never w
            assert_nothing_in_flight(engine)


async def test_an_aborted_waiter_has_its_artifacts_deleted_and_its_companions_never_run(root):
    # no autojump clock: the artifacts are deleted in a worker thread
    cfg = omni_trio.load_config(
        {
            "max_requests_in_flight": 1,
            "stages": [
                {
                    "id": "a",
                    "prompt_transform": "tests.engine.test_abort:make_artifacts",
                    "prompt_expand": "tests.engine.test_abort:negative",
                    "options": {"hang": True},
                },
                {"id": "b", "inputs": ["a"], "final_output": True},
            ],
        }
    )
    with trio.fail_after(60):
        async with omni_trio.open_engine(cfg) as engine:
            outs: list[OmniOutput] = []
            async with engine.generate("h", request_id="h"), trio.open_nursery() as nursery:
                nursery.start_soon(read_into, engine.generate("w", request_id="w"), outs)
                await wait_all_tasks_blocked()
                assert (root / "w").is_dir()
                assert await engine.abort("w") == []
                assert not (root / "w").exists()  # deleted before abort() returned
                assert (root / "h").is_dir()  # h still runs
            assert [(o.stage_id, o.finish_reason) for o in outs] == [("b", "abort")]
            received = set(scripted_backends(engine, "a")[0].received)
            assert received == {"h", "h:negative"}  # w and its companion never ran
            assert not (root / "h").exists()
            assert_nothing_in_flight(engine)


async def test_cancel_at_every_checkpoint_of_aborting_a_waiting_request(autojump_clock):
    async with omni_trio.open_engine(gated()) as engine:
        aborted: list[str] = []

        async def waits(stream: RequestStream) -> None:
            async with stream:
                outs = [out async for out in stream]
            assert_abort_terminals(outs, stream.request_id)
            aborted.append(stream.request_id)

        async def scenario(engine: Engine) -> None:
            async with engine.generate("h", request_id="h"), trio.open_nursery() as nursery:
                w = engine.generate("w", request_id="w")
                nursery.start_soon(waits, w)
                await wait_all_tasks_blocked()
                assert await engine.abort("w") == []
                assert engine.statistics().requests_waiting == 0

        def never_ran(engine: Engine) -> None:
            assert "w" not in ran(engine)
            assert engine.orchestrator.admission.in_flight == 0

        report = await cancel_at_every_checkpoint(engine, scenario, invariant=never_ran)
        report.raise_if_failed()
        assert report.checkpoints >= 5
        assert aborted[0] == "w"  # the uncancelled run read its terminals


ABORTS = ["engine.abort", "stream.abort", "abort_many"]


@pytest.mark.parametrize("route", ABORTS)
async def test_the_callers_scope_ends_an_aborts_wait_and_the_abort_completes_anyway(
    autojump_clock, route
):
    """A stage whose abort cleanup takes 100 s: the caller's move_on_after(1) ends its wait
    at its deadline; the abort goes on in the request's own task and completes; leaving the
    stream still waits for every stage to drop the request."""
    cfg = scripted_pipeline(["a", "b"], hang=True, stream_input=True, abort_delay_s=100.0)
    with trio.fail_after(600):
        async with omni_trio.open_engine(cfg) as engine:
            async with engine.generate("x", request_id="r") as stream:
                await wait_all_tasks_blocked()
                t0 = trio.current_time()
                with trio.move_on_after(1) as scope:
                    if route == "engine.abort":
                        await engine.abort("r")
                    elif route == "stream.abort":
                        await stream.abort()
                    else:
                        await engine.abort(["r", "unknown"])
                assert scope.cancelled_caught
                assert trio.current_time() - t0 == pytest.approx(1.0)
                # committed: every stage is cleaning up, the request has not ended yet
                assert stream.status == "running"
                assert engine.statistics().requests_in_flight == 1
                assert scripted_backends(engine, "a")[0].aborted == ["r"]
            # __aexit__ waited (shielded) until every stage dropped it
            assert trio.current_time() - t0 == pytest.approx(100.0)
            assert engine.statistics().requests_aborted == 1
            assert_nothing_in_flight(engine)


async def test_an_abort_cancelled_while_waiting_completes_in_the_background(autojump_clock):
    cfg = scripted_pipeline(1, hang=True, abort_delay_s=100.0)
    with trio.fail_after(600):
        async with omni_trio.open_engine(cfg) as engine:
            outs: list[OmniOutput] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_into, engine.generate("x", request_id="r"), outs)
                await wait_all_tasks_blocked()
                with trio.move_on_after(1):
                    await engine.abort("r")
                assert engine.statistics().requests_in_flight == 1
                await wait_until_idle(engine)  # no caller waits: the request's task ends it
            assert [(o.stage_id, o.finish_reason) for o in outs] == [("s0", "abort")]
            assert engine.statistics().requests_aborted == 1
            assert_nothing_in_flight(engine)
