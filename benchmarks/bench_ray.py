"""A stage on Ray against the same stage in-process. Prints one JSON object.

The same 2-stage scripted pipeline (``a -> b``, 16 outputs per stage, no latency: what is
measured is the machinery) run twice per pass, interleaved: all local, and with ``b`` placed
on Ray (one actor on the local Ray the engine starts). Per cell (1, 100 and 1,000 concurrent
requests): requests and outputs per wall second, the frontend process's CPU per request, and
the hop latency from ``a``'s finished output to ``b``'s first output (p50 / p99, from the
engine's observer events: what crossing to the actor and back adds). Also the engine's start
and close times (Ray's own start-up included) and the ratios remote / local.

    python benchmarks/bench_ray.py [--passes 2] [--outputs 16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import trio

import omni_trio
from omni_trio.observer import EngineObserver


class HopTimer(EngineObserver):
    """Per request: when ``a`` finished and when ``b`` produced its first output."""

    def __init__(self) -> None:
        self.a_done: dict[str, float] = {}
        self.b_first: dict[str, float] = {}

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        if stage_id == "a":
            self.a_done[request_id] = t

    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None:
        if stage_id == "b" and first:
            self.b_first[request_id] = t

    def hops_ms(self) -> list[float]:
        return [(self.b_first[r] - self.a_done[r]) * 1e3 for r in self.b_first if r in self.a_done]


def config(on_ray: bool, outputs: int) -> dict[str, Any]:
    b: dict[str, Any] = {
        "id": "b",
        "inputs": ["a"],
        "final_output": True,
        "options": {"outputs": outputs, "record": 0},
    }
    if on_ray:
        b["placement"] = {"ray": {"num_cpus": 1}}
    return {
        "max_requests_in_flight": 2000,
        "stages": [{"id": "a", "options": {"outputs": outputs, "record": 0}}, b],
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_cell(engine: omni_trio.Engine, concurrency: int, total: int) -> dict[str, Any]:
    timer = HopTimer()
    engine.add_observer(timer)
    limiter = trio.CapacityLimiter(concurrency)
    outputs = 0

    async def one(i: int) -> None:
        nonlocal outputs
        async with limiter:
            outputs += len(await engine.generate("hello world", request_id=f"q{i}").collect())

    cpu0, t0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(total):
            nursery.start_soon(one, i)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    hops = timer.hops_ms()
    return {
        "concurrency": concurrency,
        "requests": total,
        "requests_per_s": round(total / wall, 1),
        "outputs_per_s": round(outputs / wall, 1),
        "frontend_cpu_ms_per_request": round(cpu / total * 1e3, 3),
        "hop_p50_ms": round(pct(hops, 0.5), 3),
        "hop_p99_ms": round(pct(hops, 0.99), 3),
    }


async def one_engine(on_ray: bool, cells: list[tuple[int, int]], outputs: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with omni_trio.open_engine(config(on_ray, outputs)) as engine:
        started = time.perf_counter() - t0
        await engine.generate("warm up").collect()
        results = [await run_cell(engine, c, n) for c, n in cells]
        t1 = time.perf_counter()
    return {
        "start_s": round(started, 2),
        "close_s": round(time.perf_counter() - t1, 2),
        "cells": results,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [(1, 50), (100, 500), (1000, 2000)]
    if args.quick:
        sizes = [(1, 10), (100, 100), (1000, 1000)]
    passes: list[dict[str, Any]] = []
    for _ in range(args.passes):
        local = await one_engine(False, sizes, args.outputs)
        remote = await one_engine(True, sizes, args.outputs)
        passes.append({"local": local, "ray": remote})
    summary = []
    for i, (c, _) in enumerate(sizes):
        loc = [p["local"]["cells"][i] for p in passes]
        ray = [p["ray"]["cells"][i] for p in passes]

        def med(cells: list[dict[str, Any]], key: str) -> float:
            return float(statistics.median(cell[key] for cell in cells))

        summary.append(
            {
                "concurrency": c,
                "local_requests_per_s": med(loc, "requests_per_s"),
                "ray_requests_per_s": med(ray, "requests_per_s"),
                "ratio_ray_over_local": round(
                    med(ray, "requests_per_s") / med(loc, "requests_per_s"), 3
                ),
                "local_hop_p50_ms": med(loc, "hop_p50_ms"),
                "ray_hop_p50_ms": med(ray, "hop_p50_ms"),
                "local_hop_p99_ms": med(loc, "hop_p99_ms"),
                "ray_hop_p99_ms": med(ray, "hop_p99_ms"),
                "local_cpu_ms_per_request": med(loc, "frontend_cpu_ms_per_request"),
                "ray_cpu_ms_per_request": med(ray, "frontend_cpu_ms_per_request"),
            }
        )
    return {
        "benchmark": "bench_ray",
        "outputs_per_stage": args.outputs,
        "passes": passes,
        "summary": summary,
    }


if __name__ == "__main__":  # Ray and vLLM spawn processes: keep the guard
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--outputs", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke runs)")
    json.dump(trio.run(main, parser.parse_args()), sys.stdout, indent=1)
    print()
