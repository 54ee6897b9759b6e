"""Cancellation at every checkpoint a consumer passes, with omni_trio.testing's public harness.

For 1-, 2- and 3-stage chains, with and without ``stream_input``, and for every way a
consumer can hold a request (``async with`` + ``async for``, ``collect()``, a plain
``async for``, ``abort()`` mid-stream, leaving early), the harness counts the consumer's
checkpoints and cancels it exactly at each one. After every run: nothing in flight in any
layer, and at most one terminal per output stage, never an output after it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable

import pytest
import trio

import omni_trio
from omni_trio import Engine, OmniOutput
from omni_trio.testing import (
    CancellationReport,
    cancel_at_every_checkpoint,
    in_flight_problems,
    scripted_pipeline,
)


class Seen:
    """What one consumer saw; the invariant every run must keep."""

    def __init__(self, output_stages: tuple[str, ...]) -> None:
        self.output_stages = output_stages
        self.outputs: list[OmniOutput] = []
        self.read_to_the_end = False

    def check(self, engine: Engine) -> None:
        terminals: dict[str, int] = defaultdict(int)
        for out in self.outputs:
            assert terminals[out.stage_id] == 0, f"output after the terminal of {out.stage_id}"
            if out.finished:
                terminals[out.stage_id] += 1
        if self.read_to_the_end:
            # a consumer that read its stream to the end got exactly one terminal per stage
            assert dict(terminals) == dict.fromkeys(self.output_stages, 1), dict(terminals)
        stats = engine.statistics()
        ended = stats.requests_finished + stats.requests_aborted + stats.requests_failed
        assert ended == stats.requests_total, f"{stats} counts do not add up"
        self.outputs.clear()
        self.read_to_the_end = False


async def with_block(engine: Engine, seen: Seen) -> None:
    async with engine.generate([1, 2, 3]) as stream:
        async for out in stream:
            seen.outputs.append(out)
    seen.read_to_the_end = True


async def collect(engine: Engine, seen: Seen) -> None:
    seen.outputs.extend(await engine.generate([1, 2, 3]).collect())
    seen.read_to_the_end = True


async def plain_for(engine: Engine, seen: Seen) -> None:
    async for out in engine.generate([1, 2, 3]):
        seen.outputs.append(out)
    seen.read_to_the_end = True


async def leave_early(engine: Engine, seen: Seen) -> None:
    async with engine.generate([1, 2, 3]) as stream:
        seen.outputs.append(await stream.receive())


async def abort_mid_stream(engine: Engine, seen: Seen) -> None:
    async with engine.generate([1, 2, 3], request_id="to-abort") as stream:
        seen.outputs.append(await stream.receive())
        await engine.abort("to-abort")
        async for out in stream:
            seen.outputs.append(out)
    seen.read_to_the_end = True


SCENARIOS: dict[str, Callable[[Engine, Seen], Awaitable[None]]] = {
    "with_block": with_block,
    "collect": collect,
    "plain_for": plain_for,
    "leave_early": leave_early,
    "abort_mid_stream": abort_mid_stream,
}


async def run_harness(engine: Engine, scenario: str) -> CancellationReport:
    seen = Seen(tuple(engine.stage_ids))  # every stage is an output stage here

    async def run(engine: Engine) -> None:
        await SCENARIOS[scenario](engine, seen)

    return await cancel_at_every_checkpoint(engine, run, invariant=seen.check)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("stream_input", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("n_stages", [1, 2, 3])
async def test_cancel_at_every_checkpoint(autojump_clock, n_stages, stream_input, scenario):
    cfg = scripted_pipeline(
        n_stages,
        outputs=3,
        latency_s=0.25,
        stream_input=stream_input,
        final_outputs=[f"s{i}" for i in range(n_stages)],
    )
    async with omni_trio.open_engine(cfg) as engine:
        report = await run_harness(engine, scenario)
        report.raise_if_failed()
        # every checkpoint was probed, and there are more than a handful
        assert report.runs == report.checkpoints + 1 >= 4
        assert in_flight_problems(engine) == []


async def test_harness_reports_a_leak(autojump_clock):
    """The harness itself can fail: a consumer that leaves a request running for nobody (a
    task spawned into a nursery that outlives the scenario) is reported at every k."""
    cfg = scripted_pipeline(1, outputs=2, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine, trio.open_nursery() as outliving:

        async def leaky(engine: Engine) -> None:
            async def consume() -> None:
                await engine.generate("x").collect()

            outliving.start_soon(consume)
            await trio.sleep(0.5)

        report = await cancel_at_every_checkpoint(engine, leaky)
        assert not report.ok
        assert all("in flight" in f.problem for f in report.failures)
        with pytest.raises(AssertionError, match="broke an invariant"):
            report.raise_if_failed()


async def test_harness_reports_a_run_that_stalls_instead_of_hanging(autojump_clock):
    """A run that waits for what never comes, before its k-th checkpoint, would never be
    cancelled: it is cut at run_timeout and reported (as a lost wake-up was not, once)."""
    calls = 0

    async def stalls_when_probed(engine: Engine) -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            await trio.sleep_forever()  # one checkpoint, then nothing ever wakes it
        await engine.generate("x").collect()

    cfg = scripted_pipeline(1, outputs=2, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        t0 = trio.current_time()
        report = await cancel_at_every_checkpoint(engine, stalls_when_probed, run_timeout=30.0)
        stalled = [f.k for f in report.failures if "run_timeout=30.0s" in f.problem]
        assert stalled == list(range(2, report.runs))  # k=0 and k=1 are cancelled in time
        assert trio.current_time() - t0 >= 30.0 * len(stalled)
        calls = 1  # from now on every call stalls, the uncancelled one too
        with pytest.raises(trio.TooSlowError, match="the uncancelled run"):
            await cancel_at_every_checkpoint(engine, stalls_when_probed, run_timeout=30.0)
        assert in_flight_problems(engine) == []


async def test_cancel_every_checkpoint_of_rpc_and_of_aborting_many(autojump_clock):
    """collective_rpc and abort([...]) cancelled at each of their checkpoints leave no RPC
    pending, no request half-aborted, and the engine serving."""
    cfg = scripted_pipeline(2, outputs=3, latency_s=0.25, replicas=2)
    async with omni_trio.open_engine(cfg) as engine:

        async def rpc(engine: Engine) -> None:
            assert len(await engine.collective_rpc("sleep", args=[0.5])) == 4

        async def abort_many(engine: Engine) -> None:
            async with engine.generate("a", request_id="a") as s1:
                async with engine.generate("b", request_id="b") as s2:
                    await s1.receive()
                    await s2.receive()
                    await engine.abort(["a", "b", "unknown"])

        def still_serving(engine: Engine) -> None:
            assert not engine.closed
            assert engine.statistics().stage("s0").live_replicas == 2

        for scenario in (rpc, abort_many):
            report = await cancel_at_every_checkpoint(engine, scenario, invariant=still_serving)
            report.raise_if_failed()
            assert report.checkpoints >= 3
        # nothing of a cancelled RPC is left: a new one answers at once on every replica
        assert len(await engine.collective_rpc("echo")) == 4
