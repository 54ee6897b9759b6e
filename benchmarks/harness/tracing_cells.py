"""The tracing cells of ``bench_orchestrator.py`` (``--tracing``): what observing and tracing
requests cost, with scripted zero-latency stages (the orchestrator's own cost, no model to
hide it).

Modes, each through ``open_engine`` on the same pipeline and workload:

- ``off``: no observer (tracing off, the default): nothing of OpenTelemetry is imported or
  called, no span object is made;
- ``routed``: an observer that overrides no hook but keeps ``routes_stages`` true (as
  ``EngineMetrics`` and every observer from before do): every stage gets a routing task and
  starts with the request; the cost of that routing alone;
- ``traced``: a :class:`~omni_trio.telemetry.spans.RequestTracer` on its own tracer provider
  with a synchronous in-memory exporter (every span made, ended and exported). It needs no
  routing: its cost is its own and OpenTelemetry's.

Cells: 1 and 3 stages x 1 and 100 concurrent requests x ``outputs`` outputs. Passes are
interleaved (the mode order rotates per pass). Per mode: CPU microseconds per request
(the process's CPU time: the machine is shared) and outputs per wall second; per cell the
median ratio of each mode's CPU per request to ``off``'s. ``spans`` counts the spans each
mode made (``off``: 0, by construction: no tracer exists).

``modes`` may leave out ``routed`` and ``traced``: ``off`` alone runs on a checkout without
the telemetry package (to compare ``off`` with the code before tracing existed).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

import omni_trio
from omni_trio.observer import EngineObserver

from .scripted_cells import PROMPT, pipeline

MODES = ("off", "routed", "traced")


class _Tracing:
    """A tracer on an in-memory exporter, counting the spans it exported."""

    def __init__(self, config: Any) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        from omni_trio.telemetry.spans import RequestTracer

        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = RequestTracer(config, provider)

    def spans(self) -> int:
        n = len(self.exporter.get_finished_spans())
        self.exporter.clear()
        return n


@asynccontextmanager
async def _engine(
    mode: str, n_stages: int, outputs: int
) -> AsyncIterator[tuple[omni_trio.Engine, _Tracing | None]]:
    """An engine on the bench pipeline, observed as ``mode`` says."""
    async with omni_trio.open_engine(pipeline(n_stages, outputs, record=False)) as engine:
        tracing = None
        if mode == "routed":
            engine.add_observer(EngineObserver())
        elif mode == "traced":
            tracing = _Tracing(engine.config)
            engine.add_observer(tracing.tracer)
        yield engine, tracing
        assert engine.statistics().requests_in_flight == 0


async def run_mode(
    mode: str, n_stages: int, concurrency: int, outputs: int, in_turn: int = 0
) -> dict[str, float]:
    """One timed run in ``mode``: ``concurrency`` requests at once, or (``in_turn``) that
    many requests one after the other (the per-request cost without concurrency)."""
    delivered = 0
    n = in_turn or concurrency
    async with _engine(mode, n_stages, outputs) as (engine, tracing):

        async def one(i: int) -> None:
            nonlocal delivered
            async with engine.generate(PROMPT, request_id=f"r{i}") as stream:
                async for _ in stream:
                    delivered += 1

        t0, c0 = time.perf_counter(), time.process_time()
        if in_turn:
            for i in range(in_turn):
                await one(i)
        else:
            async with trio.open_nursery() as nursery:
                for i in range(concurrency):
                    nursery.start_soon(one, i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        observers = len(engine.orchestrator.observers)
    assert delivered == n * outputs
    spans = tracing.spans() if tracing is not None else 0
    if mode == "traced":
        assert spans == n * (1 + n_stages), spans
    return {
        "cpu_us_per_request": 1e6 * cpu / n,
        "outputs_per_s": delivered / wall,
        "spans": spans,
        "observers": observers,
    }


async def tracing_cells(
    outputs: int, passes: int, quick: bool, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    otel_before = any(m.split(".")[0] == "opentelemetry" for m in sys.modules)
    cells = []
    for n_stages in (1, 3):
        for conc in (1, 100):
            n = conc if conc > 1 else (200 if quick else 1000)  # one at a time: many, in turn
            for mode in modes:
                await run_mode(mode, n_stages, min(conc, 10), outputs)  # warm-up
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for p in range(passes):
                order = modes[p % len(modes) :] + modes[: p % len(modes)]
                for mode in order:
                    in_turn = n if conc == 1 else 0
                    runs[mode].append(await run_mode(mode, n_stages, conc, outputs, in_turn))
            cell: dict[str, Any] = {"stages": n_stages, "concurrency": conc, "requests": n}
            for mode in modes:
                cell[mode] = {
                    "cpu_us_per_request": statistics.median(
                        r["cpu_us_per_request"] for r in runs[mode]
                    ),
                    "outputs_per_s": statistics.median(r["outputs_per_s"] for r in runs[mode]),
                    "spans_per_request": runs[mode][-1]["spans"] / n,
                    "observers": runs[mode][-1]["observers"],
                }
                if mode != "off" and "off" in modes:
                    cell[f"{mode}_cpu_ratio"] = statistics.median(
                        r["cpu_us_per_request"] / o["cpu_us_per_request"]
                        for r, o in zip(runs[mode], runs["off"], strict=True)
                    )
            cells.append(cell)
    return {
        "modes": list(modes),
        "opentelemetry_imported_before_traced_runs": otel_before,
        "cells": cells,
    }
