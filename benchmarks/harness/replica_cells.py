"""The replica pool cells of ``bench_replicas.py`` (whose docstring says what each cell
measures and why the shape is what it is): 3 scripted stages of replicas under load, the
balancing policies, a replica killed (with and without restart) and one added mid-run.
``bench_orchestrator.py --replicas`` runs them too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

import omni_trio
from omni_trio import ReplicaDeadError, StageError, load_config
from omni_trio.config import PipelineConfig
from omni_trio.engine.engine import Engine

STAGES = ("s0", "s1", "s2")
MIDDLE = "s1"
KILLED = 1  # the replica index of the middle stage that the kill cells kill
POLICIES = ("least_loaded", "round_robin", "random")
CELLS = (*POLICIES, "kill", "kill_restart", "add")
PROMPT = list(range(1, 17))


@dataclass(frozen=True)
class Shape:
    requests: int = 1000
    replicas: int = 4
    outputs: int = 16
    latency_s: float = 0.01
    middle_latency_s: float = 0.02  # the middle stage is the bottleneck (see the docstring)
    slots: int | None = 8  # max_in_flight_per_replica; None: no limit
    seed: int = 1234
    restart_backoff_s: float = 0.05


def replica_config(shape: Shape, policy: str, *, restart: bool = False) -> PipelineConfig:
    """3 chained scripted stages of ``shape.replicas`` replicas; the last one's outputs go
    to the caller; the middle one restarts a dead replica when ``restart``."""
    stages: list[dict[str, Any]] = []
    for i, sid in enumerate(STAGES):
        stage: dict[str, Any] = {
            "id": sid,
            "backend": "scripted",
            "inputs": [STAGES[i - 1]] if i else [],
            "replicas": shape.replicas,
            # record: false keeps the scripted stages' request records flat
            "options": {
                "outputs": shape.outputs,
                "latency_s": shape.middle_latency_s if sid == MIDDLE else shape.latency_s,
                "record": False,
            },
            "final_output": i == len(STAGES) - 1,
        }
        if shape.slots is not None:
            stage["max_in_flight_per_replica"] = shape.slots
        if restart and sid == MIDDLE:
            stage |= {"restart": "on-failure", "restart_backoff_s": shape.restart_backoff_s}
        stages.append(stage)
    return load_config(
        {
            "name": "bench-replicas",
            "stages": stages,
            "max_requests_in_flight": max(1000, shape.requests),
            "lb_policy": policy,
            "lb_seed": shape.seed,
        }
    )


@dataclass
class Load:
    """One run's requests: who is in flight, who finished, who failed and why."""

    total: int
    in_flight: set[str] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)
    failures: dict[str, StageError] = field(default_factory=dict)
    outputs: int = 0
    third: trio.Event = field(default_factory=trio.Event)

    @property
    def completed(self) -> int:
        return len(self.latencies)


async def run_load(engine: Engine, load: Load, tag: str) -> None:
    """Start every request at once; return when all of them ended (finished or failed)."""

    async def one(i: int) -> None:
        rid = f"{tag}-{i}"
        load.in_flight.add(rid)
        t0 = time.perf_counter()
        try:
            async with engine.generate(PROMPT, request_id=rid) as stream:
                async for _ in stream:
                    load.outputs += 1
        except StageError as exc:  # ReplicaDeadError in the kill cells; counted, not hidden
            load.failures[rid] = exc
        else:
            load.latencies.append(time.perf_counter() - t0)
            if load.completed >= load.total // 3:
                load.third.set()
        finally:
            load.in_flight.discard(rid)

    async with trio.open_nursery() as nursery:
        for i in range(load.total):
            nursery.start_soon(one, i)


# -- what happens once a third of the requests finished ------------------------------------
Action = Callable[[Engine, Load, dict[str, Any]], Awaitable[None]]


async def kill_middle_replica(engine: Engine, load: Load, report: dict[str, Any]) -> None:
    """Note the requests bound to the middle stage's replica ``KILLED``, kill it in the same
    step (no checkpoint between: the set is exact), then time its restart if it has one."""
    pool = engine.pools[MIDDLE]
    victim = pool.replica(KILLED)
    bound = {rid for rid in load.in_flight if pool.replica_of(rid) is victim}
    t0 = trio.current_time()
    victim.kill(RuntimeError("bench_replicas: replica killed mid-run"))
    report["bound_at_kill"] = bound
    report["completed_at_kill"] = load.completed
    if pool.config.restart == "on-failure":
        # nothing to wait on but the pool's own state: poll it every millisecond
        while pool.statistics().replicas[KILLED].state != "ready":  # noqa: ASYNC110
            await trio.sleep(0.001)
        report["restart_s"] = trio.current_time() - t0
        report["live_after_restart"] = engine.check_health().stage(MIDDLE).live_replicas


async def add_middle_replica(engine: Engine, load: Load, report: dict[str, Any]) -> None:
    t0 = trio.current_time()
    report["added_index"] = await engine.add_replica(MIDDLE)
    report["add_s"] = trio.current_time() - t0
    report["completed_at_add"] = load.completed


ACTIONS: dict[str, Action] = {
    "kill": kill_middle_replica,
    "kill_restart": kill_middle_replica,
    "add": add_middle_replica,
}


async def run_cell(shape: Shape, cell: str, tag: str) -> dict[str, Any]:
    """One run of ``cell`` on a fresh engine (its start is not timed)."""
    policy = cell if cell in POLICIES else "least_loaded"
    action = ACTIONS.get(cell)
    cfg = replica_config(shape, policy, restart=cell == "kill_restart")
    load = Load(shape.requests)
    report: dict[str, Any] = {}
    async with omni_trio.open_engine(cfg) as engine:
        t0, c0 = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            if action is not None:

                async def at_a_third(action: Action = action) -> None:
                    await load.third.wait()
                    await action(engine, load, report)

                nursery.start_soon(at_a_third)
            await run_load(engine, load, tag)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = engine.statistics()
        health = engine.check_health()
        assert stats.requests_in_flight == 0, stats
    per_replica = {st.stage_id: [r.requests_finished for r in st.replicas] for st in stats.stages}
    result: dict[str, Any] = {
        "wall_s": wall,
        "cpu_s": cpu,
        "completed": load.completed,
        "failed": len(load.failures),
        "requests_per_s": load.completed / wall,
        "outputs_per_s": load.outputs / wall,
        "outputs_per_cpu_s": load.outputs / cpu,
        "latencies": sorted(load.latencies),
        "per_replica": per_replica,
        "live_middle": health.stage(MIDDLE).live_replicas,
    }
    if "bound_at_kill" in report:
        bound = report.pop("bound_at_kill")
        lost = {
            rid
            for rid, exc in load.failures.items()
            if isinstance(exc, ReplicaDeadError) and (exc.stage_id, exc.replica) == (MIDDLE, KILLED)
        }
        result |= {
            "bound_at_kill": len(bound),
            "lost": len(lost),
            "lost_equals_bound": lost == bound,
            "other_failures": len(load.failures) - len(lost),
        }
    if "added_index" in report:
        (added,) = [r for r in stats.stage(MIDDLE).replicas if r.replica == report["added_index"]]
        result["added_served"] = added.requests_finished
    return result | report


def capacity(shape: Shape) -> dict[str, float] | None:
    """Requests per second each stage can finish at most: replicas x slots / (outputs x
    latency); ``None`` with no slot limit. Pure."""
    if shape.slots is None:
        return None
    return {
        sid: round(
            shape.replicas
            * shape.slots
            / (shape.outputs * (shape.middle_latency_s if sid == MIDDLE else shape.latency_s)),
            1,
        )
        for sid in STAGES
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of an ascending list, nearest rank. Pure."""
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's passes: medians of the throughput and latency figures, the spread over
    every pass, and the kill / add figures of each pass. Pure."""

    def med(key: str, scale: float = 1.0, digits: int = 1) -> float:
        return round(statistics.median(r[key] for r in runs) * scale, digits)

    out: dict[str, Any] = {
        "requests_per_s": med("requests_per_s"),
        "outputs_per_s": med("outputs_per_s"),
        "outputs_per_cpu_s": med("outputs_per_cpu_s"),
        "wall_s": med("wall_s", digits=3),
        "cpu_s": med("cpu_s", digits=3),
        "p50_ms": round(statistics.median(percentile(r["latencies"], 0.5) for r in runs) * 1e3, 1),
        "p99_ms": round(statistics.median(percentile(r["latencies"], 0.99) for r in runs) * 1e3, 1),
        "completed": [r["completed"] for r in runs],
        # per stage, over every pass: the fewest / most requests one replica finished
        "spread_min_max": {
            sid: [
                min(min(r["per_replica"][sid]) for r in runs),
                max(max(r["per_replica"][sid]) for r in runs),
            ]
            for sid in STAGES
        },
        "middle_per_replica": runs[-1]["per_replica"][MIDDLE],
        "live_middle_at_end": [r["live_middle"] for r in runs],
    }
    for key in (
        "bound_at_kill",
        "lost",
        "lost_equals_bound",
        "other_failures",
        "completed_at_kill",
    ):
        if key in runs[0]:
            out[key] = [r[key] for r in runs]
    for key in ("restart_s", "add_s"):
        if key in runs[0]:
            out[key] = [round(r[key], 4) for r in runs]
    for key in ("live_after_restart", "added_served", "completed_at_add"):
        if key in runs[0]:
            out[key] = [r[key] for r in runs]
    return out


def pass_order(p: int) -> list[str]:
    """Pass ``p`` runs every cell, the order rotated by ``p`` (no cell always first). Pure."""
    k = p % len(CELLS)
    return list(CELLS[k:] + CELLS[:k])


async def replica_cells(shape: Shape, passes: int) -> dict[str, Any]:
    """Every cell, ``passes`` interleaved passes; the summary per cell."""
    await run_cell(replace(shape, requests=min(shape.requests, 50)), "least_loaded", "warm")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CELLS}
    for p in range(passes):
        for cell in pass_order(p):
            runs[cell].append(await run_cell(shape, cell, f"p{p}-{cell}"))
    cells = {cell: summarize(rs) for cell, rs in runs.items()}
    base = cells["least_loaded"]
    for cell in ("kill", "kill_restart", "add"):
        # against the undisturbed least_loaded runs of the same passes
        cells[cell]["requests_per_s_vs_least_loaded"] = round(
            cells[cell]["requests_per_s"] / base["requests_per_s"], 3
        )
    return {
        "shape": {
            "stages": len(STAGES),
            "replicas": shape.replicas,
            "requests": shape.requests,
            "outputs": shape.outputs,
            "latency_s": shape.latency_s,
            "middle_latency_s": shape.middle_latency_s,
            "max_in_flight_per_replica": shape.slots,
            "lb_seed": shape.seed,
            "restart_backoff_s": shape.restart_backoff_s,
            "killed": f"{MIDDLE}[{KILLED}]",
            "capacity_requests_per_s": capacity(shape),
        },
        "passes": passes,
        "cells": cells,
    }
