"""Orchestrator overhead with scripted zero-latency stages.

For 1 and 3 stages and 1 / 100 / 1000 concurrent requests x 16 outputs, in one run:

- ``omni``: the pipeline through ``open_engine`` (request tasks, routing, bounded channels);
- ``floor``: the same scripted backends chained by hand (no orchestrator, no channels to a
  caller), the least any orchestrator could cost;

and reports outputs/s for both and their ratio, the per-hop latency (a stage's finished
output -> the next stage holding its input) p50/p99, peak RSS per in-flight request, and
the engine's CPU time while idle for 5 s. Prints one JSON object.

    python benchmarks/bench_orchestrator.py [--outputs 16] [--idle-seconds 5] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from typing import Any

import psutil
import trio

import omni_trio
from omni_trio.config import load_config
from omni_trio.outputs import StageInput
from omni_trio.stages.scripted import ScriptedBackend

# (stage_id, request_id) -> perf_counter of the finished output / of the input's arrival
FINISHED_AT: dict[tuple[str, str], float] = {}
INPUT_AT: dict[tuple[str, str], float] = {}


class TimedScripted(ScriptedBackend):
    """A scripted stage that timestamps its input arrival and its finished output."""

    async def _run(self, request_id, inputs, sampling_params, emit):  # type: ignore[override]
        sid = self.stage_id
        send, receive = trio.open_memory_channel[StageInput](64)

        async def relay() -> None:
            async with send:
                first = True
                async for chunk in inputs:
                    if first:
                        INPUT_AT[(sid, request_id)] = time.perf_counter()
                        first = False
                    await send.send(chunk)

        async def timed_emit(out):
            if out.finished:
                FINISHED_AT[(sid, request_id)] = time.perf_counter()
            await emit(out)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay)
            async with receive:
                await super()._run(request_id, receive, sampling_params, timed_emit)


def pipeline(n_stages: int, outputs: int, timed: bool = False, **opts: Any):
    backend = f"{__name__}:TimedScripted" if timed else "scripted"
    stages = [
        {
            "id": f"s{i}",
            "backend": backend,
            "inputs": [f"s{i - 1}"] if i else [],
            "options": {"outputs": outputs, **opts},
            "final_output": i == n_stages - 1,
        }
        for i in range(n_stages)
    ]
    return load_config(
        {"name": f"bench-{n_stages}", "stages": stages, "max_requests_in_flight": 100_000}
    )


PROMPT = list(range(1, 17))


async def run_omni(n_stages: int, concurrency: int, outputs: int) -> dict[str, float]:
    cfg = pipeline(n_stages, outputs)
    delivered = 0
    async with omni_trio.open_engine(cfg) as engine:

        async def one(i: int) -> None:
            nonlocal delivered
            async with engine.generate(PROMPT, request_id=f"r{i}") as stream:
                async for _ in stream:
                    delivered += 1

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - t0
        assert engine.statistics().requests_in_flight == 0
    assert delivered == concurrency * outputs
    return {"wall_s": wall, "outputs_per_s": delivered / wall}


async def run_floor(n_stages: int, concurrency: int, outputs: int) -> dict[str, float]:
    """The same backends chained by hand: the cost of the stages alone."""
    cfg = pipeline(n_stages, outputs)
    backends = [ScriptedBackend(st, stage_index=i) for i, st in enumerate(cfg.stages)]
    delivered = 0
    async with trio.open_nursery() as nursery:
        for b in backends:
            await nursery.start(b.serve)

        async def one(i: int) -> None:
            nonlocal delivered
            chunk = StageInput(token_ids=tuple(PROMPT))
            for k, b in enumerate(backends):
                send, receive = trio.open_memory_channel[StageInput](1)
                send.send_nowait(chunk)
                send.close()
                got: list[int] = []

                async def emit(out, got=got) -> None:
                    got.extend(out.token_ids)

                await b.run_request(f"r{i}", receive, None, emit)
                if k == len(backends) - 1:
                    delivered += len(got)
                chunk = StageInput(token_ids=tuple(got))

        t0 = time.perf_counter()
        async with trio.open_nursery() as inner:
            for i in range(concurrency):
                inner.start_soon(one, i)
        wall = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    assert delivered == concurrency * outputs
    return {"wall_s": wall, "outputs_per_s": delivered / wall}


async def hop_latency(n_requests: int, outputs: int) -> dict[str, float]:
    FINISHED_AT.clear()
    INPUT_AT.clear()
    cfg = pipeline(3, outputs, timed=True)
    async with omni_trio.open_engine(cfg) as engine:
        # one at a time: the hop itself, not queueing behind other requests
        for i in range(n_requests):
            await engine.generate(PROMPT, request_id=f"h{i}").collect()
    hops = []
    for (sid, rid), t_in in INPUT_AT.items():
        idx = int(sid[1:])
        if idx == 0:
            continue
        hops.append((t_in - FINISHED_AT[(f"s{idx - 1}", rid)]) * 1e3)
    hops.sort()
    return {
        "hops": len(hops),
        "p50_ms": statistics.median(hops),
        "p99_ms": hops[min(len(hops) - 1, int(len(hops) * 0.99))],
        "max_ms": hops[-1],
    }


async def rss_per_request(n: int) -> dict[str, float]:
    # tracemalloc sees every Python allocation; RSS alone hides them in freed arenas
    proc = psutil.Process()
    cfg = pipeline(3, 16, hang=True)
    async with omni_trio.open_engine(cfg) as engine:
        gc.collect()
        tracemalloc.start()
        traced0 = tracemalloc.get_traced_memory()[0]
        before = proc.memory_info().rss
        streams = []
        for i in range(n):
            s = engine.generate(PROMPT, request_id=f"m{i}")
            await s.__aenter__()
            streams.append(s)
        await trio.sleep(0.05)  # let every request task reach its stages
        gc.collect()
        after = proc.memory_info().rss
        traced = tracemalloc.get_traced_memory()[0] - traced0
        tracemalloc.stop()
        in_flight = engine.statistics().requests_in_flight
        for s in streams:
            await s.__aexit__(None, None, None)
        assert engine.statistics().requests_in_flight == 0
    return {
        "requests_in_flight": in_flight,
        "rss_delta_mib": (after - before) / 2**20,
        "rss_per_request_kib": (after - before) / max(1, in_flight) / 1024,
        "python_heap_per_request_kib": traced / max(1, in_flight) / 1024,
    }


async def idle_cpu(seconds: float) -> dict[str, float]:
    cfg = pipeline(3, 16)
    proc = psutil.Process()
    async with omni_trio.open_engine(cfg):
        c0 = proc.cpu_times()
        t0 = time.perf_counter()
        await trio.sleep(seconds)
        c1 = proc.cpu_times()
        wall = time.perf_counter() - t0
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {"idle_wall_s": wall, "idle_cpu_s": cpu, "idle_cpu_s_per_10s": cpu * 10 / wall}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "benchmark": "orchestrator",
        "outputs_per_request": args.outputs,
        "python": sys.version.split()[0],
        "trio": trio.__version__,
        "throughput": [],
    }
    concurrencies = [1, 100] if args.quick else [1, 100, 1000]
    for n_stages in (1, 3):
        for conc in concurrencies:
            # warm-up once, then alternate so neither side gets the warmer caches
            await run_omni(n_stages, min(conc, 10), args.outputs)
            floor = await run_floor(n_stages, conc, args.outputs)
            omni = await run_omni(n_stages, conc, args.outputs)
            results["throughput"].append(
                {
                    "stages": n_stages,
                    "concurrency": conc,
                    "omni_outputs_per_s": round(omni["outputs_per_s"]),
                    "floor_outputs_per_s": round(floor["outputs_per_s"]),
                    "omni_over_floor_throughput": round(
                        omni["outputs_per_s"] / floor["outputs_per_s"], 3
                    ),
                    "omni_wall_s": round(omni["wall_s"], 4),
                    "floor_wall_s": round(floor["wall_s"], 4),
                }
            )
    results["hop_latency"] = {
        k: round(v, 4)
        for k, v in (await hop_latency(50 if args.quick else 300, args.outputs)).items()
    }
    results["memory"] = {
        k: round(v, 3) for k, v in (await rss_per_request(200 if args.quick else 1000)).items()
    }
    results["idle"] = {k: round(v, 4) for k, v in (await idle_cpu(args.idle_seconds)).items()}
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (for smoke runs)")
    print(json.dumps(trio.run(main, parser.parse_args()), indent=2))
