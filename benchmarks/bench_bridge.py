"""Thread bridge vs janus: the same item stream between two threads, side by side.

Three transports carry the same items from a producer thread to a consumer thread:

- ``bridge``: omni-trio's bridge between two trio loops (producer ``trio.run`` in a worker
  thread doing ``await tx.send``, consumer ``trio.run`` in the main thread doing
  ``async for``), window ``--max-buffer``.
- ``bridge_batched``: the same bridge, used the way janus_poll's consumer drains its queue:
  ``send_nowait`` while there is credit (``send`` only when the window is full), and after
  each ``receive`` every buffered item via ``receive_nowait``; so one checkpoint per batch,
  not per item.
- ``janus_poll``: janus exactly as vLLM-Omni's AsyncOmniEngine uses it for outputs: the
  orchestrator thread's asyncio loop does ``await q.async_q.put`` into an unbounded queue,
  and the caller's asyncio loop reads ``q.sync_q.get_nowait()``, sleeping 1 ms when empty.
- ``janus_blocking``: janus's best case, not what vLLM-Omni does: the same producer into a
  queue bounded like the bridge, and a consumer thread with no event loop blocking in
  ``q.sync_q.get()`` (so no poll interval, but the consumer can do nothing else).

Two runs per transport: throughput (``--items`` items as fast as possible) and latency
(``--latency-items`` items, one every ``--gap-us`` microseconds, each stamped with
``perf_counter_ns`` when sent and compared with the time it was received), plus an idle
run (the consumer waits ``--idle-s`` seconds for a producer that sends nothing; ``cpu_s``
is the process CPU time it costs). Prints one JSON object with items/s, latency p50/p99 in
microseconds, and ratios (janus / bridge for latency, bridge / janus for throughput: > 1
means the bridge is better) and the idle CPU seconds side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import trio

from omni_trio.transport import BridgeReceiver, BridgeSender, open_bridge

Result = dict[str, float]


def _summary(n: int, elapsed: float, cpu: float, latencies_ns: list[int]) -> Result:
    out: Result = {
        "items": n,
        "seconds": round(elapsed, 4),
        "items_per_s": round(n / elapsed),
        "cpu_s": round(cpu, 4),
    }
    if latencies_ns:
        us = sorted(x / 1000 for x in latencies_ns)
        out["latency_p50_us"] = round(statistics.median(us), 1)
        out["latency_p99_us"] = round(us[min(len(us) - 1, int(len(us) * 0.99))], 1)
        out["latency_max_us"] = round(us[-1], 1)
    return out


async def _send_batched(tx: BridgeSender[int], item: int) -> None:
    try:
        tx.send_nowait(item)
    except anyio.WouldBlock:
        await tx.send(item)


async def _receive_batched(rx: BridgeReceiver[int]) -> AsyncIterator[int]:
    async for item in rx:
        yield item
        while True:
            try:
                item = rx.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
            yield item


def run_bridge(
    n: int, gap_s: float, max_buffer: int, *, batched: bool = False, idle_s: float = 0.0
) -> Result:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(max_buffer, name="bench")
    stamped = gap_s > 0
    send = _send_batched if batched else BridgeSender.send

    async def produce() -> None:
        await trio.sleep(idle_s)
        async with tx:
            if not stamped:
                for i in range(n):
                    await send(tx, i)
                return
            for _ in range(n):
                await send(tx, time.perf_counter_ns())
                await trio.sleep(gap_s)

    async def consume() -> Result:
        latencies: list[int] = []
        count = 0
        start, cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, trio.run, produce)
            async for item in _receive_batched(rx) if batched else rx:
                count += 1
                if stamped:
                    latencies.append(time.perf_counter_ns() - item)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert count == n, (count, n)
        assert rx.statistics().items_in_flight == 0
        return _summary(n, elapsed, cpu, latencies)

    return trio.run(consume)


_DONE = object()


def _janus_producer(
    n: int, gap_s: float, maxsize: int, idle_s: float, ready: Callable[[Any], None]
) -> Callable[[], None]:
    import janus

    async def produce() -> None:
        # janus binds its async side to the loop that creates it: the orchestrator's loop.
        q: janus.Queue[Any] = janus.Queue(maxsize=maxsize)
        ready(q)
        await asyncio.sleep(idle_s)
        if gap_s <= 0:
            for i in range(n):
                await q.async_q.put(i)
        else:
            for _ in range(n):
                await q.async_q.put(time.perf_counter_ns())
                await asyncio.sleep(gap_s)
        await q.async_q.put(_DONE)
        await q.async_q.join()  # keep the loop alive until the consumer has taken all
        q.close()
        await q.wait_closed()

    return lambda: asyncio.run(produce())


def run_janus(n: int, gap_s: float, max_buffer: int, *, poll: bool, idle_s: float = 0.0) -> Result:
    got_queue: queue.Queue[Any] = queue.Queue()
    producer = threading.Thread(
        target=_janus_producer(n, gap_s, 0 if poll else max_buffer, idle_s, got_queue.put),
        name="orchestrator",
    )
    stamped = gap_s > 0
    latencies: list[int] = []
    start, cpu = time.perf_counter(), time.process_time()
    producer.start()
    q = got_queue.get()
    count = 0
    if poll:

        async def consume() -> int:
            count = 0
            while True:
                try:
                    item = q.sync_q.get_nowait()
                except queue.Empty:
                    await asyncio.sleep(0.001)  # vLLM-Omni's orchestration poll interval
                    continue
                q.sync_q.task_done()
                if item is _DONE:
                    return count
                count += 1
                if stamped:
                    latencies.append(time.perf_counter_ns() - item)

        count = asyncio.run(consume())
    else:
        while True:
            item = q.sync_q.get()
            q.sync_q.task_done()
            if item is _DONE:
                break
            count += 1
            if stamped:
                latencies.append(time.perf_counter_ns() - item)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    producer.join()
    assert count == n, (count, n)
    return _summary(n, elapsed, cpu, latencies)


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200_000, help="throughput run size")
    parser.add_argument("--latency-items", type=int, default=5_000)
    parser.add_argument("--gap-us", type=float, default=200.0, help="pacing of the latency run")
    parser.add_argument("--max-buffer", type=int, default=64)
    parser.add_argument("--idle-s", type=float, default=1.0, help="idle run: consumer waits")
    args = parser.parse_args(argv)
    gap_s = args.gap_us / 1e6
    transports: dict[str, Callable[..., Result]] = {
        "bridge": lambda n, g, **kw: run_bridge(n, g, args.max_buffer, **kw),
        "bridge_batched": lambda n, g, **kw: run_bridge(n, g, args.max_buffer, batched=True, **kw),
        "janus_poll": lambda n, g, **kw: run_janus(n, g, args.max_buffer, poll=True, **kw),
        "janus_blocking": lambda n, g, **kw: run_janus(n, g, args.max_buffer, poll=False, **kw),
    }
    results: dict[str, Any] = {
        "benchmark": "bridge",
        "python": sys.version.split()[0],
        "params": vars(args),
    }
    for name, run in transports.items():
        results[name] = {
            "throughput": run(args.items, 0.0),
            "latency": run(args.latency_items, gap_s),
            "idle": run(0, 0.0, idle_s=args.idle_s),
        }
    ratios: dict[str, float] = {}
    for mine in ("bridge", "bridge_batched"):
        bridge = results[mine]
        for name in ("janus_poll", "janus_blocking"):
            other = results[name]
            ratios[f"throughput_{mine}_over_{name}"] = _ratio(
                bridge["throughput"]["items_per_s"], other["throughput"]["items_per_s"]
            )
            for q in ("p50", "p99"):
                ratios[f"latency_{q}_{name}_over_{mine}"] = _ratio(
                    other["latency"][f"latency_{q}_us"], bridge["latency"][f"latency_{q}_us"]
                )
        ratios[f"idle_cpu_s_{mine}"] = bridge["idle"]["cpu_s"]
    for name in ("janus_poll", "janus_blocking"):
        ratios[f"idle_cpu_s_{name}"] = results[name]["idle"]["cpu_s"]
    results["ratios"] = ratios
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
