"""The fake engine cells of ``bench_orchestrator.py``: stages that behave like a batching
engine with fixed-time steps, through omni-trio and chained by hand in plain trio.

``FakeEngine`` runs ``slots`` requests at once, one step of ``step_s`` emits one token to each
active request, a request waits for a free slot. ``FakeEngineBackend`` is omni-trio's side (a
stage whose replica drives one); ``run_fake_floor`` chains the same engines by hand. The
engine runs on the same trio loop as the orchestrator, so the wall-time ratio is what the
orchestrator's CPU per step costs the engines (``fake_engine_cells``).

Every microsecond the loop works after an engine's ``trio.sleep(step_s)`` call lengthens that
step by as much, even when the work is far shorter than the step: the loop computes its
timeout once the work is done and the kernel's timeout is in whole milliseconds, rounded up
(measured here: a 2 ms sleep with 0 / 100 / 500 us of other work after it takes 2.14 / 2.31
/ 2.74 ms). So the wall ratio follows the loop's CPU per engine step, which each cell reports
beside it (``cpu_us_per_step``). Under :class:`ExactStepClock` a step takes its ``step_s``
whatever the loop does meanwhile, as a model's step on its own device would: the same cells
then say what the orchestrator costs engines whose steps the loop's timer does not stretch.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

# benchmarks/ is on sys.path (bench_orchestrator.py runs as a script)
from _orchestrator_scripted import FINISHED_AT, INPUT_AT, PROMPT, hop_stats

import omni_trio
from omni_trio.config import load_config
from omni_trio.outputs import StageOutput
from omni_trio.stages import StageBackend
from omni_trio.stages.emit import Emit, EmitNowait, nowait_of
from omni_trio.stages.input_stream import InputStream


class ExactStepClock(trio.abc.Clock):
    """trio's default clock (``time.perf_counter``), except that the loop's timeout stops
    1 ms short of the next deadline and the loop then polls until it is due: a sleeping task
    wakes at its deadline, not on the next whole millisecond after the loop's work (the
    kernel's timeout). Costs up to 1 ms of polling per wake-up, so only wall time means
    anything under it, not CPU time. ``now`` is the time source (for tests)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now()

    def deadline_to_sleep_time(self, deadline: float) -> float:
        """Seconds the loop may block for ``deadline``: all but the last millisecond, then
        none. Pure (but for the time source)."""
        return max(0.0, deadline - self._now() - 0.001)


class _Sequence:
    """One request inside a FakeEngine: its pending tokens and whoever waits for them (the
    engine's own per-request output collector, as vLLM's). ``fast`` is the request's
    ``emit.nowait`` (omni-trio's side only): while the reader waits with nothing pending, an
    engine step hands it an unfinished output directly, as a vllm replica's demultiplexer
    does, instead of waking the reader."""

    __slots__ = (
        "cancelled",
        "done",
        "fast",
        "final_only",
        "index",
        "pending",
        "prompt",
        "tokens",
        "waiter",
    )

    def __init__(
        self, prompt: list[int], tokens: int, final_only: bool, fast: EmitNowait | None
    ) -> None:
        self.prompt = prompt or [0]
        self.tokens = tokens
        self.index = 0
        self.final_only = final_only
        self.fast = fast
        self.pending: list[int] = []
        self.done = False
        self.cancelled = False
        self.waiter: trio.lowlevel.Task | None = None

    def step(self) -> None:
        # one token per engine step; a final-only request wakes its reader at the end only
        token = self.prompt[self.index % len(self.prompt)] + 1
        self.index += 1
        self.done = self.index == self.tokens
        waiter = self.waiter
        if waiter is not None and not self.done and not self.final_only:
            fast = self.fast
            if fast is not None and fast(StageOutput(token_ids=(token,))):
                return
        self.pending.append(token)
        if (self.done or not self.final_only) and waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    async def receive(self) -> tuple[tuple[int, ...], bool]:
        """The tokens produced since the last call and whether the request finished. Waits
        only when nothing is pending (like vLLM's output collector). Always checkpoints."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while not self.pending or (self.final_only and not self.done):
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
            waited = True
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        delta, self.pending = tuple(self.pending), []
        return delta, self.done

    def _abort_wait(self, _: Any) -> trio.lowlevel.Abort:
        # a cancelled reader: nothing takes the fast path any more
        self.waiter = None
        self.fast = None
        return trio.lowlevel.Abort.SUCCEEDED


class FakeEngine:
    """``slots`` requests run at once; one step of ``step_s`` emits one token to each active
    request; a request waits for a free slot; ``tokens`` tokens per request."""

    #: steps taken by every FakeEngine of the process (omni-trio's are inside its backends)
    all_steps = 0

    def __init__(self, slots: int = 8, step_s: float = 0.002, tokens: int = 16) -> None:
        self.slots = slots
        self.step_s = step_s
        self.tokens = tokens
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._work = trio.lowlevel.ParkingLot()
        self.steps = 0

    def add(
        self, prompt: list[int], *, final_only: bool = False, fast: EmitNowait | None = None
    ) -> _Sequence:
        seq = _Sequence(prompt, self.tokens, final_only, fast)
        self._waiting.append(seq)
        if self._work:
            self._work.unpark()
        return seq

    async def run(self) -> None:
        while True:
            while self._waiting and len(self._active) < self.slots:
                seq = self._waiting.popleft()
                if not seq.cancelled:
                    self._active.append(seq)
            if not self._active:
                await self._work.park()
                continue
            await trio.sleep(self.step_s)
            self.steps += 1
            FakeEngine.all_steps += 1
            for seq in self._active:
                if not seq.cancelled:
                    seq.step()
            self._active = [s for s in self._active if not (s.done or s.cancelled)]


class FakeEngineBackend(StageBackend):
    """omni-trio's side of the fake engine shape: a stage whose replica drives a FakeEngine.
    Options: ``slots``, ``step_s``, ``tokens``. A stage whose outputs nobody streams asks
    its engine for the finished output only (as the vllm backend asks for FINAL_ONLY)."""

    backend_name = "fake-engine"

    def __init__(self, config: Any, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        self.engine = FakeEngine(**dict(config.options))

    async def _start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _serve_forever(self) -> None:
        await self.engine.run()

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: Any, emit: Emit
    ) -> None:
        key = (self.stage_id, request_id)
        prompt: list[int] = []
        async for chunk in inputs:
            prompt.extend(chunk.token_ids)
            if chunk.final:
                break
        INPUT_AT[key] = time.perf_counter()
        streamed = self.outputs_streamed(request_id)
        seq = self.engine.add(prompt, final_only=not streamed, fast=nowait_of(emit))
        try:
            while True:
                delta, done = await seq.receive()
                if done:
                    seq.fast = None
                    FINISHED_AT[key] = time.perf_counter()
                    await emit(StageOutput(token_ids=delta, finished=True, finish_reason="length"))
                    return
                await emit(StageOutput(token_ids=delta))
        finally:
            seq.cancelled = True


def fake_pipeline(n_stages: int, shape: dict[str, Any]):
    stages = [
        {
            "id": f"s{i}",
            "backend": f"{__name__}:FakeEngineBackend",
            "inputs": [f"s{i - 1}"] if i else [],
            "options": shape,
            "final_output": i == n_stages - 1,
        }
        for i in range(n_stages)
    ]
    return load_config({"name": f"fake-{n_stages}", "stages": stages})


async def run_fake_omni(engine: Any, n_requests: int, tag: str, tokens: int) -> float:
    delivered = 0

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
    return wall


async def run_fake_floor(n_stages: int, n_requests: int, shape: dict[str, Any]) -> float:
    """The same fake engines chained by hand: each request's task feeds stage k's finished
    output to stage k+1 and reads the last stage's tokens as they come."""
    engines = [FakeEngine(**shape) for _ in range(n_stages)]
    delivered = 0
    async with trio.open_nursery() as nursery:
        for e in engines:
            nursery.start_soon(e.run)

        async def one() -> None:
            nonlocal delivered
            tokens = list(PROMPT)
            for k, e in enumerate(engines):
                seq = e.add(tokens, final_only=k < n_stages - 1)
                got: list[int] = []
                while True:
                    delta, done = await seq.receive()
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
    return wall


async def _cpu_per_step(run: Awaitable[float]) -> tuple[float, float]:
    """Run one pass -> (its wall seconds, the trio thread's CPU microseconds per engine step
    it took)."""
    c0, s0 = time.thread_time(), FakeEngine.all_steps
    wall = await run
    return wall, (time.thread_time() - c0) * 1e6 / max(1, FakeEngine.all_steps - s0)


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
