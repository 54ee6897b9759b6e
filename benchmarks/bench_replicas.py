"""Replica pools under load, with model-free stages. Prints one JSON object.

3 scripted stages x 4 replicas, 1,000 requests at once (``max_requests_in_flight`` admits them
all: the latency is admission to last output, with no admission wait in it), 16 outputs per
request per stage, one fresh engine per run on the real trio clock. Cells:

1. ``least_loaded``, ``round_robin`` and ``random`` (seeded ``lb_seed``): requests and
   outputs per wall second and per CPU second, wall and CPU time, p50 / p99 request latency,
   and how evenly requests spread (per stage: the fewest and most requests one replica
   finished, over every pass).
2. ``kill`` (least_loaded): once a third of the requests finished, replica 1 of the middle
   stage is killed. In the same step (no checkpoint in between) the benchmark notes which
   in-flight requests are bound to it (``pool.replica_of``); after the run, the set that
   failed with :class:`ReplicaDeadError` must be exactly that set (``lost_equals_bound``).
   ``kill_restart``: the same with ``restart: on-failure`` on the middle stage: the time
   from the kill to the replica being ready again (the 0.05 s backoff included) and the
   stage's live replicas at the end (4 again).
3. ``add`` (least_loaded): at the same moment a 5th replica joins the middle stage
   (``engine.add_replica``): how long the add took, how many requests the new replica
   finished, and the throughput.

The shape, and why. A scripted replica has no capacity of its own: each request sleeps on
its own timer, so with no per-replica limit all 1,000 requests run at once whatever the
replicas, and the run is bound by the CPU of the one trio loop (with zero latency it is
nothing else): replicas and policies would change only the counters. So each replica gets
a capacity like a batching engine's: ``max_in_flight_per_replica: 8`` (8 requests at once;
the others wait first-in first-out in the pool) and ``latency_s: 0.01`` per output
(16 x 10 ms a request), and the middle stage is twice as slow (``latency_s: 0.02``), so it
is the pipeline's bottleneck: 4 x 8 / (16 x 0.02 s) = 100 requests/s, against 200 for the
others (``capacity_requests_per_s`` in the output; timer overshoot makes the measured rate
lower). Killing one of its replicas then removes a quarter of the pipeline's capacity and
adding one adds a quarter, which is what cells 2 and 3 are about. At 2 ms per output
(16 x 2 ms, 8 slots: 1,000 requests/s a stage) the run was CPU-bound (CPU time = wall
time, about 280 requests/s on this machine) and a kill or an add did not show. The
orchestrator's CPU per request is about 3.5-4.5 ms here, so the loop is about a third
busy. Read the policy figures with this in mind: when every slot is taken, a freed slot
goes to the first waiter, on the replica that freed it, whatever the policy, so at
saturation the policies differ by their CPU cost and spread, not by latency. ``--slots 0``
(no limit) shows the policies' own spread, but there every request runs at once and they
all finish together, CPU-bound, so the kill and add cells fire with nothing left in flight
(0 bound, 0 lost, the added replica serves none). The machine is shared: compare
CPU-time figures and the interleaved medians (every pass runs every cell, in an order
rotated per pass).

Its cells are in ``harness/replica_cells.py``.

    python benchmarks/bench_replicas.py [--requests 1000] [--passes 3] [--slots 8]
        [--latency-s 0.01] [--middle-factor 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

import trio

# benchmarks/ is on sys.path (this file runs as a script)
from harness.replica_cells import Shape, replica_cells


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(
        requests=args.requests,
        outputs=args.outputs,
        latency_s=args.latency_s,
        middle_latency_s=args.latency_s * args.middle_factor,
        slots=args.slots or None,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1000, help="requests at once")
    parser.add_argument("--outputs", type=int, default=16, help="outputs per request per stage")
    parser.add_argument("--latency-s", type=float, default=0.01, help="seconds per output")
    parser.add_argument(
        "--middle-factor", type=float, default=2.0, help="the middle stage's latency, times"
    )
    parser.add_argument(
        "--slots", type=int, default=8, help="max_in_flight_per_replica (0: no limit)"
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    shape = shape_of(args)
    if args.quick:
        shape = replace(shape, requests=min(shape.requests, 100))
    return {
        "benchmark": "replicas",
        "python": sys.version.split()[0],
        "trio": trio.__version__,
        **await replica_cells(shape, 1 if args.quick else args.passes),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--passes", type=int, default=3, help="interleaved passes per cell")
    parser.add_argument("--quick", action="store_true", help="100 requests, one pass")
    print(json.dumps(trio.run(main, parser.parse_args()), indent=2))
