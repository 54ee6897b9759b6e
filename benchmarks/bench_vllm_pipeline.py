"""Tiny vLLM pipelines of 1-3 stages: omni-trio against engines driven by hand.

Cells: 1, 2 and 3 stages x two CPU layouts. Stage 1 is ``tiny:thinker``, stages 2 and 3 are
``tiny:talker``; stage k+1's prompt is stage k's token ids (``{"prompt_token_ids": ...}``).
Every engine gets the same engine args in both systems: omni-trio's CPU defaults
(``CPU_ENGINE_DEFAULTS``) plus the model. Layouts (``VLLM_CPU_OMP_THREADS_BIND`` per engine):
``core0`` puts every engine on core 0; ``spread`` puts the k-th stage (counting from 0) on core
k % 2, so 2 stages get one core each. With 1 stage both layouts are the same configuration
(the cell is a repeat measurement).

Systems, each run in a fresh subprocess:

- ``hand``: the strongest fair baseline, a plain asyncio program driving one ``AsyncLLM`` per
  stage. Each request runs its stages in turn; intermediate stages ask vLLM for
  ``FINAL_ONLY`` output (nobody streams them), the last stage for ``DELTA``. Engines are built
  one after the other and shut down one after the other with vLLM's default timeout, as a
  plain program would.
- ``omni``: the same pipeline through ``omni_trio.open_engine``, ``output_stages=[last]``.
- ``omni_ta`` (only with ``--systems``): ``omni`` with every vllm stage on ``loop:
  trio-asyncio`` (each engine's worker thread runs trio with trio-asyncio's loop, the design
  card's choice, instead of a plain asyncio loop). ``omni_ta_ratio`` and ``omni_ta_cpu_ratio``
  compare it with ``hand``; ``loop_ratio`` and ``loop_cpu_ratio`` with ``omni``, run for run
  (above 1: trio-asyncio's loop is faster, or costs more CPU).
- ``omni_traced`` (only with ``--systems``): ``omni`` with OpenTelemetry tracing on, spans
  exported to an in-memory exporter (``spans`` counts them). ``tracing_ratio`` and
  ``tracing_cpu_ratio`` compare it with ``omni``, run for run (below 1: tracing costs
  throughput; above 1: it costs CPU).
- ``tracing_ab`` (only with ``--systems``): ``omni`` with tracing switched on (the in-memory
  exporter) and off between batches in one process, ABBA (``2 x --batches`` timed batches):
  the same engines on the same cores, so the run-to-run spread of separate processes does not
  enter. ``tracing_ab_ratio`` and ``tracing_ab_cpu_ratio`` are on/off of each run's median
  batch requests/s and CPU per request-stage; ``tracing_ab_loop_ms`` the trio loop's CPU per
  request-stage, off and on.
- ``trio`` (only with ``--systems``): the floor under omni-trio's design, the least a trio
  program pays to drive the same engines from worker threads with no orchestrator
  (``harness/vllm_trio.py``). ``trio_ratio`` and ``trio_cpu_ratio`` compare it with
  ``hand`` as ``ratio`` and ``cpu_ratio`` compare omni-trio: what the design costs, and what
  omni-trio adds on top of it.
- ``shared`` (only with ``--systems``): the same floor with every engine on one shared worker
  thread instead of one each (``shared_ratio``, ``shared_cpu_ratio``): whether one vLLM host
  thread per process would cost less than a thread per engine.

Workload: a warm-up batch, then ``--batches`` timed batches; a batch submits ``--requests``
requests at once, ``--tokens`` tokens per stage (greedy, ``ignore_eos``); the caller consumes
the last stage's stream only. Each pass runs, cell after cell, both systems back to back (the
order alternates per pass), so slow drift on the shared machine hits both alike.

Reading the output (one JSON object on stdout; progress on stderr):

- ``ratio``: omni/hand of requests/s of the median batch, per pass; a cell reports the median
  over passes and its spread (min, max). Above 1 omni-trio is faster.
- ``cpu_ms_per_request_stage``: CPU time of the subprocess itself (all its threads; the
  EngineCore processes are not counted) over the timed batches, divided by requests x batches
  x stages. This is the frontend's cost; when the engines keep the cores busy (``spread``) it
  is what the ratio follows.
- ``cpu_ms_by_thread`` (per run: ``cpu_split_ms``): the same, split by thread. ``loop`` is the
  main thread (omni-trio's trio loop with the orchestrator and the callers, or the hand
  program's asyncio loop with its AsyncLLMs); ``engine_threads`` are omni-trio's vllm stage
  threads (a worker loop and an AsyncLLM each); ``other`` is everything else (vLLM's and
  ZMQ's own threads). omni-trio's ``engine_threads`` do what the hand program's ``loop``
  does; its ``loop`` is what omni-trio adds.
- ``init_s``: engine construction to ready; ``shutdown_s``: start of close to its return.
- ``stop``: where the close's time went (:func:`stop_breakdown`). An engine's own stop runs
  from the moment its stop begins (omni-trio's vllm backend logs it at debug level; the hand
  program calls ``shutdown()``) until its EngineCore and that core's workers have exited (seen
  on pidfds); ``gap`` is the close minus the slowest engine's own stop (target: at most 1 s).
- ``idle`` (with ``--idle-s``): CPU seconds of the frontend process and of each engine's
  processes (EngineCore and workers) while the engine sits idle, from ``IDLE_SETTLE_S`` after
  the last batch; ``idle.settle``: the same over the ``IDLE_SETTLE_S`` before (vLLM's readers
  still spinning).
- Processes: each run records what it spawned just before close (``children``) and which of
  those still exist right after close returned (``after_close``). Once the subprocess has
  exited, ``leftover.at_exit`` lists the ones still there (a zombie shows with its status) and
  ``leftover.after_grace`` those still there after ``grace_s``. multiprocessing's resource
  tracker normally shows in ``at_exit`` only: it exits by itself when its parent has gone.

    python benchmarks/bench_vllm_pipeline.py [--stages 1,2,3] [--layouts core0,spread]
        [--passes 3] [--requests 64] [--tokens 16] [--batches 3]
        [--systems hand,omni[,omni_ta][,omni_traced][,tracing_ab][,trio][,shared]]
        [--idle-s 0]
        [--child-timeout 1200]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# benchmarks/ is on sys.path (this file runs as a script, also in its subprocesses)
from harness.vllm_cells import DEFAULT_SYSTEMS, LAYOUTS, SYSTEMS, Run, cell_name, plan_runs
from harness.vllm_child import child_main
from harness.vllm_procs import leftover
from harness.vllm_summary import describe, rounded, summarize_cell, summary_row

from omni_trio.backends.vllm.protocol import CPU_ENGINE_DEFAULTS


def run_child(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    """One system on one cell in a fresh subprocess (its own session, so a hung run can be
    killed with everything it spawned); then which of its children outlived it."""
    cmd = [sys.executable, __file__, "--child", run.system]
    cmd += ["--child-stages", str(run.n_stages), "--child-layout", run.layout]
    cmd += ["--requests", str(a.requests), "--tokens", str(a.tokens), "--batches", str(a.batches)]
    cmd += ["--idle-s", str(a.idle_s)]
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=a.child_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"error": f"no result within {a.child_timeout} s (killed)", "stderr": err[-2000:]}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            break
    else:
        return {"error": f"exit {proc.returncode} without a result", "stderr": err[-4000:]}
    if "error" in result:
        result["stderr"] = err[-4000:]
    result["leftover"] = leftover(result["children"])
    return result


def vllm_version() -> str | None:
    """The installed vLLM's version (the CPU build is its own distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def csv(
    kind: Callable[[str], Any], choices: Sequence[Any] | None = None
) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(v) for v in text.split(",") if v]
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {choices}, got {text!r}")
        return values

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--stages", type=csv(int, (1, 2, 3)), default=[1, 2, 3])
    ap.add_argument("--layouts", type=csv(str, LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--systems", type=csv(str, SYSTEMS), default=list(DEFAULT_SYSTEMS))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument(
        "--idle-s", type=float, default=0.0, help="seconds idle after the batches (CPU)"
    )
    ap.add_argument("--child-timeout", type=float, default=1200.0, help="seconds per subprocess")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--child-stages", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def iter_cells(a: argparse.Namespace) -> Iterator[tuple[int, str]]:
    for n in a.stages:
        for layout in a.layouts:
            yield n, layout


def main() -> None:
    a = parse_args()
    if a.child:
        child_main(a)
        return
    runs = plan_runs(a.passes, a.stages, a.layouts, a.systems)
    # cell -> one {system: result} per pass
    results: dict[tuple[int, str], list[dict[str, dict[str, Any]]]] = {
        cell: [{} for _ in range(a.passes)] for cell in iter_cells(a)
    }
    progress(f"{len(runs)} subprocess runs: {a.passes} passes x {len(results)} cells")
    for i, run in enumerate(runs, 1):
        progress(f"run {i}/{len(runs)}: {cell_name(run.n_stages, run.layout)} {run.system}")
        result = run_child(run, a)
        results[(run.n_stages, run.layout)][run.pass_index][run.system] = result
        progress(describe(run, result))
    cells = [summarize_cell(n, layout, results[(n, layout)], a.systems) for n, layout in results]
    for cell, (n, layout) in zip(cells, results, strict=True):
        cell["passes"] = results[(n, layout)]
    report = {
        "benchmark": "vllm_pipeline",
        "workload": {
            "stages": "tiny:thinker, then tiny:talker (token hand-off); last stage streamed",
            "requests_per_batch": a.requests,
            "tokens_per_stage": a.tokens,
            "timed_batches": a.batches,
            "passes": a.passes,
            "engine_args": CPU_ENGINE_DEFAULTS,
            "vllm": vllm_version(),
        },
        "summary": {cell["cell"]: summary_row(cell) for cell in cells},
        "cells": cells,
    }
    print(json.dumps(rounded(report), indent=2))


if __name__ == "__main__":
    main()
