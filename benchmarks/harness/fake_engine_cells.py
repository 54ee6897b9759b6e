"""The fake engine cells of ``bench_orchestrator.py``: stages that behave like a batching
engine with fixed-time steps (:mod:`omni_trio.testing.fake_engine`), through omni-trio and
chained by hand in plain trio.

``TimedFakeEngineBackend`` is omni-trio's side (the public fake engine stage, noting when a
request's input arrived and when it finished for :func:`~harness.scripted_cells.hop_stats`);
``run_fake_floor`` chains the same engines by hand. The engine runs on the same trio loop
as the orchestrator, so the wall-time ratio is what the orchestrator's CPU per step costs
the engines (``fake_engine_cells``).

Every microsecond the loop works after an engine's ``trio.sleep(step_s)`` call lengthens that
step by as much, even when the work is far shorter than the step (the loop's timeouts are
whole milliseconds: see :mod:`omni_trio.testing.exact_clock`). So the wall ratio follows the
loop's CPU per engine step, which each cell reports beside it (``cpu_us_per_step``). Under
:class:`~omni_trio.testing.ExactStepClock` a step takes its ``step_s`` whatever the loop does
meanwhile, as a model's step on its own device would: the same cells then say what the
orchestrator costs engines whose steps the loop's timer does not stretch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

import omni_trio
from omni_trio.config import load_config
from omni_trio.testing import FakeEngine, FakeEngineBackend, fake_engine_backends

from .scripted_cells import FINISHED_AT, INPUT_AT, PROMPT, hop_stats

#: steps taken by the fake engines of every pass so far, either side
_steps_taken = 0


def _count_steps(steps: int) -> None:
    global _steps_taken
    _steps_taken += steps


def _omni_steps(engine: Any) -> int:
    """The steps taken so far by the fake engines inside ``engine``'s stages."""
    return sum(b.engine.steps for sid in engine.pools for b in fake_engine_backends(engine, sid))


class TimedFakeEngineBackend(FakeEngineBackend):
    """The fake engine stage, noting in ``INPUT_AT`` / ``FINISHED_AT`` when a request's
    whole input arrived and when its last tokens were in."""

    def _on_input(self, request_id: str) -> None:
        INPUT_AT[(self.stage_id, request_id)] = time.perf_counter()

    def _on_finished(self, request_id: str) -> None:
        FINISHED_AT[(self.stage_id, request_id)] = time.perf_counter()


def fake_pipeline(n_stages: int, shape: dict[str, Any]):
    stages = [
        {
            "id": f"s{i}",
            "backend": f"{__name__}:TimedFakeEngineBackend",
            "inputs": [f"s{i - 1}"] if i else [],
            "options": shape,
            "final_output": i == n_stages - 1,
        }
        for i in range(n_stages)
    ]
    return load_config({"name": f"fake-{n_stages}", "stages": stages})


async def run_fake_omni(engine: Any, n_requests: int, tag: str, tokens: int) -> float:
    delivered = 0
    steps_before = _omni_steps(engine)

    async def one(i: int) -> None:
        nonlocal delivered
        async with engine.generate(PROMPT, request_id=f"{tag}-{i}") as stream:
            async for out in stream:
                delivered += len(out.token_ids)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n_requests):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - t0
    assert delivered == n_requests * tokens
    _count_steps(_omni_steps(engine) - steps_before)
    return wall


async def run_fake_floor(n_stages: int, n_requests: int, shape: dict[str, Any]) -> float:
    """The same fake engines chained by hand: each request's task feeds stage k's finished
    output to stage k+1 and reads the last stage's tokens as they come."""
    engines = [FakeEngine(**shape) for _ in range(n_stages)]
    delivered = 0
    async with trio.open_nursery() as nursery:
        for e in engines:
            nursery.start_soon(e.serve)

        async def one() -> None:
            nonlocal delivered
            tokens = list(PROMPT)
            for k, e in enumerate(engines):
                request = e.add(tokens, final_only=k < n_stages - 1)
                got: list[int] = []
                while True:
                    delta, done = await request.receive()
                    got.extend(delta)
                    if done:
                        break
                tokens = got
            delivered += len(tokens)

        t0 = time.perf_counter()
        async with trio.open_nursery() as inner:
            for _ in range(n_requests):
                inner.start_soon(one)
        wall = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    assert delivered == n_requests * shape["tokens"]
    _count_steps(sum(e.steps for e in engines))
    return wall


async def _cpu_per_step(run: Awaitable[float]) -> tuple[float, float]:
    """Run one pass -> (its wall seconds, the trio thread's CPU microseconds per engine step
    it took)."""
    c0, s0 = time.thread_time(), _steps_taken
    wall = await run
    return wall, (time.thread_time() - c0) * 1e6 / max(1, _steps_taken - s0)


async def fake_engine_cells(
    n_requests: int, passes: int, shape: dict[str, Any], cpu_figures: bool = True
) -> list[Any]:
    """Per stage count (1, 2, 3): interleaved passes of omni-trio and the floor; the median
    wall ratio, each side's median wall, the loop's CPU per engine step of each side (what
    the ratio follows, see the module docstring; left out with ``cpu_figures=False``, for a
    clock that polls) and the hop latency."""
    cells = []
    for n_stages in (1, 2, 3):
        FINISHED_AT.clear()
        INPUT_AT.clear()
        walls: dict[str, list[float]] = {"omni": [], "floor": []}
        cpu: dict[str, list[float]] = {"omni": [], "floor": []}
        async with omni_trio.open_engine(fake_pipeline(n_stages, shape)) as engine:
            await run_fake_omni(engine, n_requests, "warm", shape["tokens"])
            await run_fake_floor(n_stages, n_requests, shape)
            FINISHED_AT.clear()
            INPUT_AT.clear()
            for p in range(passes):
                # interleaved, alternating which side goes first
                for side in ("omni", "floor") if p % 2 else ("floor", "omni"):
                    run = (
                        run_fake_omni(engine, n_requests, f"p{p}", shape["tokens"])
                        if side == "omni"
                        else run_fake_floor(n_stages, n_requests, shape)
                    )
                    wall, us = await _cpu_per_step(run)
                    walls[side].append(wall)
                    cpu[side].append(us)
        ratios = [o / f for o, f in zip(walls["omni"], walls["floor"], strict=True)]
        cell: dict[str, Any] = {
            "stages": n_stages,
            "requests": n_requests,
            "omni_wall_s_median": round(statistics.median(walls["omni"]), 4),
            "floor_wall_s_median": round(statistics.median(walls["floor"]), 4),
            "wall_ratio_median": round(statistics.median(ratios), 3),
            "wall_ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        }
        if cpu_figures:
            cell["cpu_us_per_step"] = {k: round(statistics.median(v), 1) for k, v in cpu.items()}
        cell["hop"] = {k: round(v, 4) for k, v in hop_stats(n_stages).items()}
        cells.append(cell)
    return cells


#: the token counts of ``fake_cpu_cells``: one output per request, then 16
CPU_TOKENS = (1, 16)


def cost_split(us_per_request: dict[int, float]) -> dict[str, float]:
    """Thread CPU microseconds per request at each of :data:`CPU_TOKENS` -> the fixed cost
    of a request (its 1-token figure, which includes that one output) and the cost of each
    further output (the slope between the two). Pure."""
    few, many = CPU_TOKENS
    per_output = (us_per_request[many] - us_per_request[few]) / (many - few)
    return {"fixed_us_per_request": us_per_request[few], "us_per_output": per_output}


async def _omni_batch(engine: Any, n_requests: int, tokens: int, b: int) -> None:
    await run_fake_omni(engine, n_requests, f"cpu-{tokens}-{b}", tokens)


async def _floor_batch(n_stages: int, n_requests: int, shape: dict[str, Any], b: int) -> None:
    await run_fake_floor(n_stages, n_requests, shape)


async def _thread_cpu_us(
    run: Callable[[int], Awaitable[None]], batches: int, n_requests: int
) -> float:
    c0 = time.thread_time()
    for b in range(batches):
        await run(b)
    return (time.thread_time() - c0) * 1e6 / (batches * n_requests)


async def fake_cpu_cells(n_requests: int, passes: int, batches: int) -> list[dict[str, Any]]:
    """The trio thread's CPU per request, omni-trio against the floor, with fake engines
    whose steps take no time (``step_s=0``, every request in a slot): what is left is each
    side's own Python work per request, as a vllm stage's trio side does it (outputs handed
    on through ``emit.nowait``). 1 and 3 stages, 1 and 16 tokens per request; per stage
    count, :func:`cost_split` of each side's medians: the fixed cost of a request and the
    cost of each further output. Interleaved passes of ``batches`` batches each."""
    cells = []
    for n_stages in (1, 3):
        medians: dict[str, dict[int, float]] = {"omni": {}, "floor": {}}
        for tokens in CPU_TOKENS:
            shape = {"slots": n_requests, "step_s": 0.0, "tokens": tokens}
            omni_us, floor_us = [], []
            async with omni_trio.open_engine(fake_pipeline(n_stages, shape)) as engine:
                omni = partial(_omni_batch, engine, n_requests, tokens)
                floor = partial(_floor_batch, n_stages, n_requests, shape)
                await omni(-1)  # warm-up
                await floor(-1)
                for p in range(passes):
                    # interleaved, alternating which side goes first
                    if p % 2:
                        omni_us.append(await _thread_cpu_us(omni, batches, n_requests))
                        floor_us.append(await _thread_cpu_us(floor, batches, n_requests))
                    else:
                        floor_us.append(await _thread_cpu_us(floor, batches, n_requests))
                        omni_us.append(await _thread_cpu_us(omni, batches, n_requests))
            medians["omni"][tokens] = statistics.median(omni_us)
            medians["floor"][tokens] = statistics.median(floor_us)
        cell: dict[str, Any] = {"stages": n_stages, "requests": n_requests}
        for side, by_tokens in medians.items():
            cell[side] = {
                **{f"us_per_request_{t}_tokens": round(v, 1) for t, v in by_tokens.items()},
                **{k: round(v, 2) for k, v in cost_split(by_tokens).items()},
            }
        cells.append(cell)
    return cells
