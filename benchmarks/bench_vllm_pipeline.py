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
        [--passes 3] [--requests 64] [--tokens 16] [--batches 3] [--systems hand,omni]
        [--idle-s 0] [--child-timeout 1200]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from omni_trio.stages._vllm_protocol import CPU_ENGINE_DEFAULTS

PROMPTS = [f"request {i}: the tiny omni model sings a song about the river" for i in range(997)]
LAYOUTS = ("core0", "spread")
SYSTEMS = ("hand", "omni")
#: how long the parent watches leftover processes go away after a subprocess exited
LEFTOVER_GRACE_S = 5.0
#: idle CPU is measured from this long after the last batch: vLLM's shared-memory readers
#: (EngineCore and worker) busy-poll their queue for 1 s after their last read
IDLE_SETTLE_S = 2.0


# -- pure helpers -------------------------------------------------------------------------
def stage_models(n_stages: int) -> list[str]:
    """The model of each stage: the thinker, then talkers."""
    return ["tiny:thinker"] + ["tiny:talker"] * (n_stages - 1)


def bind_for(layout: str, index: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of the stage at ``index`` (from 0) in ``layout``."""
    if layout == "core0":
        return "0"
    if layout == "spread":
        return str(index % 2)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def engine_args(model: str) -> dict[str, Any]:
    """The engine args of one stage, the same in both systems."""
    return {**CPU_ENGINE_DEFAULTS, "model": model}


def cell_name(n_stages: int, layout: str) -> str:
    return f"{n_stages} stage{'s' if n_stages > 1 else ''} {layout}"


@dataclass(frozen=True)
class Run:
    pass_index: int
    n_stages: int
    layout: str
    system: str


def plan_runs(
    passes: int, stages: Sequence[int], layouts: Sequence[str], systems: Sequence[str]
) -> list[Run]:
    """Every subprocess run, in order: pass by pass, cell by cell, the systems of a cell back
    to back, their order reversed on every other pass."""
    runs: list[Run] = []
    for p in range(passes):
        order = list(systems) if p % 2 == 0 else list(reversed(systems))
        for n in stages:
            for layout in layouts:
                runs.extend(Run(p, n, layout, s) for s in order)
    return runs


def batch_throughput(walls: Sequence[float], requests: int) -> dict[str, float]:
    """Requests/s of the best and of the median batch."""
    rates = [requests / w for w in walls]
    return {"best": max(rates), "median": statistics.median(rates)}


def cpu_ms_per_request_stage(cpu_s: float, requests: int, batches: int, stages: int) -> float:
    return 1000.0 * cpu_s / (requests * batches * stages)


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max of ``values`` (None when there are none)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratios(
    passes: Sequence[dict[str, dict[str, Any]]], key: Callable[[dict[str, Any]], float]
) -> list[float]:
    """omni/hand of ``key`` for every pass where both systems produced a result."""
    return [key(p["omni"]) / key(p["hand"]) for p in passes if succeeded(p, "hand", "omni")]


def succeeded(one_pass: dict[str, dict[str, Any]], *systems: str) -> bool:
    """Whether every one of ``systems`` ran in this pass and produced a result."""
    return all(s in one_pass and "error" not in one_pass[s] for s in systems)


def _rps(result: dict[str, Any]) -> float:
    return float(result["requests_per_s"]["median"])


def _cpu(result: dict[str, Any]) -> float:
    return float(result["cpu_ms_per_request_stage"])


def summarize_cell(
    n_stages: int, layout: str, passes: Sequence[dict[str, dict[str, Any]]], systems: Sequence[str]
) -> dict[str, Any]:
    """One cell of the report from its passes (``{system: child result}`` each)."""

    def per_pass(system: str, field: Callable[[dict[str, Any]], Any]) -> list[Any]:
        """``field`` of the system's result in every pass (None where it failed)."""
        return [field(p[system]) if succeeded(p, system) else None for p in passes]

    return {
        "cell": cell_name(n_stages, layout),
        "stages": n_stages,
        "layout": layout,
        "binds": [bind_for(layout, k) for k in range(n_stages)],
        "ratio": spread(paired_ratios(passes, _rps)),
        "cpu_ratio": spread(paired_ratios(passes, _cpu)),
        "requests_per_s": {s: per_pass(s, _rps) for s in systems},
        "best_batch_requests_per_s": {
            s: per_pass(s, lambda r: r["requests_per_s"]["best"]) for s in systems
        },
        "cpu_ms_per_request_stage": {s: per_pass(s, _cpu) for s in systems},
        "cpu_ms_per_request_stage_median": {s: _median(per_pass(s, _cpu)) for s in systems},
        "init_s": {s: per_pass(s, lambda r: r["init_s"]) for s in systems},
        "shutdown_s": {s: per_pass(s, lambda r: r["shutdown_s"]) for s in systems},
        "tokens_ok": {s: per_pass(s, lambda r: r["tokens_ok"]) for s in systems},
        "stop": {s: per_pass(s, lambda r: r["stop"]) for s in systems},
        "idle": {s: per_pass(s, lambda r: r.get("idle")) for s in systems},
        "leftover": {
            s: [
                {"pass": i, **p[s]["leftover"]}
                for i, p in enumerate(passes)
                if s in p and p[s].get("leftover", {}).get("at_exit")
            ]
            for s in systems
        },
        "errors": {
            s: [p[s]["error"] for p in passes if s in p and "error" in p[s]] for s in systems
        },
    }


def summary_row(cell: dict[str, Any]) -> dict[str, Any]:
    """The compact line of a cell: median ratio, its spread, frontend CPU of each system."""
    ratio, cpu_ratio = cell["ratio"], cell["cpu_ratio"]

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "ratio": ratio and r3(ratio["median"]),
        "spread": ratio and [r3(ratio["min"]), r3(ratio["max"])],
        "cpu_ms_hand": r3(cell["cpu_ms_per_request_stage_median"].get("hand")),
        "cpu_ms_omni": r3(cell["cpu_ms_per_request_stage_median"].get("omni")),
        "cpu_ratio": cpu_ratio and r3(cpu_ratio["median"]),
        "init_s": {s: _median(cell["init_s"][s]) for s in cell["init_s"]},
        "shutdown_s": {s: _median(cell["shutdown_s"][s]) for s in cell["shutdown_s"]},
        "slowest_own_stop_s": {s: _stop_median(cell, s, "slowest_own_stop") for s in cell["stop"]},
        "stop_gap_s": {s: _stop_median(cell, s, "gap") for s in cell["stop"]},
        "idle_cpu_s": {s: _idle_median(cell["idle"][s]) for s in cell["idle"]},
        "left_at_exit": sum(len(r["at_exit"]) for v in cell["leftover"].values() for r in v),
        "left_after_grace": sum(
            len(r["after_grace"]) for v in cell["leftover"].values() for r in v
        ),
        "failed_runs": sum(len(v) for v in cell["errors"].values()),
    }


def _stop_median(cell: dict[str, Any], system: str, field: str) -> float | None:
    """The median over passes of one figure of the stop breakdowns of ``system``."""
    return _median([None if stop is None else stop[field] for stop in cell["stop"][system]])


def _idle_median(idles: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Median over passes of the idle CPU seconds of the frontend and of all engines."""
    present = [i for i in idles if i is not None]
    if not present:
        return None
    return {
        "seconds": present[0]["seconds"],
        "frontend": _median([i["frontend_cpu_s"] for i in present]),
        "engines": _median([sum(i["engines_cpu_s"].values()) for i in present]),
    }


def _median(values: Sequence[float | None]) -> float | None:
    """The median of the values present (None when none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to 4 digits (for the printed report)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


# -- in the subprocess: shared measurement ------------------------------------------------
async def run_batches(
    batch: Callable[[str], Awaitable[list[int]]], requests: int, tokens: int, batches: int
) -> dict[str, Any]:
    """A warm-up batch, then ``batches`` timed ones; wall times, CPU time of this process over
    the timed batches, and whether every request got all its last-stage tokens. Awaits
    ``batch`` only, so it runs on asyncio and on trio alike."""
    counts = await batch("warm")
    ok = counts == [tokens] * requests
    walls = []
    cpu0 = time.process_time()
    for b in range(batches):
        t0 = time.perf_counter()
        counts = await batch(f"b{b}")
        walls.append(time.perf_counter() - t0)
        ok = ok and counts == [tokens] * requests
    return {"walls": walls, "cpu_s": time.process_time() - cpu0, "tokens_ok": ok}


def descendants() -> list[list[Any]]:
    """[pid, create_time, what] of every process this one spawned (recursively); ``what`` is
    the process name, or the start of its command line for a bare ``python`` (multiprocessing's
    resource tracker is one)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            what = p.name()
            if what.startswith("python"):
                exe, *args = p.cmdline()
                what = " ".join([os.path.basename(exe), *args])[:100]
            found.append([p.pid, p.create_time(), what])
    return found


def still_there(procs: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Which of ``procs`` ([pid, create_time, what]) still exist, with their status; a pid
    reused by a newer process does not count."""
    found = []
    for pid, created, what in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                found.append({"pid": pid, "what": what, "status": p.status()})
        except psutil.NoSuchProcess:
            pass
    return found


# -- in the subprocess: each engine's own stop ---------------------------------------------
#: the logger whose debug records mark where each omni-trio engine's stop begins and ends
STOP_LOGGER = "omni_trio.stages._vllm_process"


def engine_groups() -> dict[int, list[int]]:
    """EngineCore pid -> the pids of it and every process it spawned (its workers). An
    EngineCore is a child of this process titled ``VLLM::EngineCore`` (vLLM sets the title;
    before that, its command line is multiprocessing's ``spawn_main``)."""
    groups: dict[int, list[int]] = {}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            line = child.cmdline()
            if line[:1] == ["VLLM::EngineCore"] or any("spawn_main" in p for p in line):
                groups[child.pid] = [child.pid] + [g.pid for g in child.children(recursive=True)]
    return groups


class ExitWatch:
    """When each watched process exits (``time.monotonic()``), seen by a thread polling their
    pidfds: a pidfd turns readable the moment its process ends (zombie or reaped), whoever
    its parent is. Costs nothing while the processes live."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.exited: dict[int, float] = {}
        self._fds: dict[int, int] = {}  # pidfd -> pid
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                self.exited[pid] = time.monotonic()  # gone before the watch began
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        for fd in [*self._fds, self._wake_r]:
            poller.register(fd, select.POLLIN)
        pending = set(self._fds)
        while pending:
            ready = poller.poll()
            now = time.monotonic()
            for fd, _ in ready:
                if fd == self._wake_r:
                    return
                self.exited[self._fds[fd]] = now
                poller.unregister(fd)
                pending.discard(fd)

    def close(self, wait: float = 0.0) -> dict[int, float]:
        """Stop watching, after up to ``wait`` seconds for the processes still alive; pid ->
        exit time of every watched process that exited."""
        self._thread.join(wait)
        os.write(self._wake_w, b"x")
        self._thread.join()
        for fd in [*self._fds, self._wake_r, self._wake_w]:
            os.close(fd)
        return dict(self.exited)


class StopLog(logging.Handler):
    """Collects the stop phases omni-trio's vllm backend logs at debug level:
    (phase, EngineCore pids, monotonic time)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.phases: list[tuple[str, tuple[int, ...], float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "stop_phase", None)
        if phase is not None:
            pids, t = getattr(record, "core_pids", ()), getattr(record, "t", None)
            if t is not None:
                self.phases.append((phase, tuple(pids), float(t)))


@contextlib.contextmanager
def stop_log() -> Iterator[StopLog]:
    handler = StopLog()
    log = logging.getLogger(STOP_LOGGER)
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def engine_stops(
    groups: dict[int, list[int]],
    phases: Sequence[tuple[str, Sequence[int], float]],
    exited: dict[int, float],
) -> list[dict[str, Any]]:
    """One record per engine (EngineCore pid -> its processes): when its stop began and its
    stop call returned (from ``phases``: (``begin``/``end``, EngineCore pids, time)), and
    when the last of its processes exited (``gone``, None if one never did)."""
    marks: dict[tuple[str, int], float] = {}
    for phase, pids, t in phases:
        for pid in pids:
            marks.setdefault((phase, pid), t)
    stops = []
    for core, pids in groups.items():
        exits = [exited.get(pid) for pid in pids]
        gone = None if None in exits else max(e for e in exits if e is not None)
        stops.append(
            {
                "core_pid": core,
                "processes": len(pids),
                "begin": marks.get(("begin", core)),
                "end": marks.get(("end", core)),
                "gone": gone,
            }
        )
    return stops


def stop_breakdown(
    t_close: float, t_closed: float, stops: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Where a close's time went, in seconds. Per engine: ``began`` (its stop began, from the
    start of close), ``own_stop`` (from that moment until its EngineCore and workers were
    gone), ``call`` (the stop call itself, reaping included), ``gone`` (from the start of
    close). For the close: ``close`` (start to return), ``slowest_own_stop``, ``gap``
    (close minus the slowest own stop: the target is at most 1 s), ``before_first_stop`` and
    ``after_last_gone``. Figures that cannot be computed (a stop never logged, a process
    never seen to exit) are None."""

    def since(t: float | None, origin: float | None) -> float | None:
        return None if t is None or origin is None else t - origin

    engines = [
        {
            "core_pid": s["core_pid"],
            "processes": s["processes"],
            "began": since(s["begin"], t_close),
            "own_stop": since(s["gone"], s["begin"]),
            "call": since(s["end"], s["begin"]),
            "gone": since(s["gone"], t_close),
        }
        for s in stops
    ]
    own = [e["own_stop"] for e in engines]
    slowest = None if not own or None in own else max(own)
    begins = [s["begin"] for s in stops]
    gones = [s["gone"] for s in stops]
    close = t_closed - t_close
    return {
        "close": close,
        "slowest_own_stop": slowest,
        "gap": None if slowest is None else close - slowest,
        "before_first_stop": None if not begins or None in begins else min(begins) - t_close,
        "after_last_gone": None if not gones or None in gones else t_closed - max(gones),
        "engines": engines,
    }


def child_result(
    timing: dict[str, Any],
    init_s: float,
    shutdown_s: float,
    procs: list[list[Any]],
    a: argparse.Namespace,
    stop: dict[str, Any],
    idle: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "batch_walls_s": timing["walls"],
        "requests_per_s": batch_throughput(timing["walls"], a.requests),
        "cpu_s": timing["cpu_s"],
        "cpu_ms_per_request_stage": cpu_ms_per_request_stage(
            timing["cpu_s"], a.requests, a.batches, a.child_stages
        ),
        "tokens_ok": timing["tokens_ok"],
        "init_s": init_s,
        "shutdown_s": shutdown_s,
        "children": procs,
        "after_close": still_there(procs),
        "stop": stop,
        "idle": idle,
    }


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of ``pids`` (each process alone, not its children)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def idle_snapshot(groups: dict[int, list[int]]) -> dict[str, Any]:
    """CPU seconds so far of this process (the frontend) and of each engine's processes."""
    return {
        "frontend": time.process_time(),
        "engines": {core: cpu_seconds(pids) for core, pids in groups.items()},
    }


async def measure_idle(
    groups: dict[int, list[int]], sleep: Callable[[float], Awaitable[None]], seconds: float
) -> dict[str, Any]:
    """:func:`idle_cpu` over ``seconds`` from ``IDLE_SETTLE_S`` on, and the settling time
    before (as ``settle``). Awaits ``sleep`` only, so it runs on asyncio and on trio alike."""
    after_work = idle_snapshot(groups)
    await sleep(IDLE_SETTLE_S)
    settled = idle_snapshot(groups)
    await sleep(seconds)
    idle = idle_cpu(settled, idle_snapshot(groups), seconds)
    idle["settle"] = idle_cpu(after_work, settled, IDLE_SETTLE_S)
    return idle


def idle_cpu(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """CPU seconds used between two :func:`idle_snapshot` s taken ``seconds`` apart."""
    return {
        "seconds": seconds,
        "frontend_cpu_s": after["frontend"] - before["frontend"],
        "engines_cpu_s": {
            str(core): after["engines"][core] - cpu for core, cpu in before["engines"].items()
        },
    }


# -- hand-driven asyncio ------------------------------------------------------------------
def run_hand(a: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from omni_trio.models import resolve_model

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(
            max_tokens=a.tokens, temperature=0.0, ignore_eos=True, output_kind=kind
        )

    inner, last = params(RequestOutputKind.FINAL_ONLY), params(RequestOutputKind.DELTA)

    def build(model: str, bind: str) -> Any:
        args = {**engine_args(model), "model": resolve_model(model)}
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # inherited by this engine's core only
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    def render(engine: Any, raw: Any) -> Any:
        parsed = parse_model_prompt(engine.model_config, raw)
        (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
        return rendered

    async def one(engines: list[Any], i: int, tag: str) -> int:
        prompt: Any = PROMPTS[i]
        for k, engine in enumerate(engines[:-1]):
            final = None
            async for out in engine.generate(render(engine, prompt), inner, f"{tag}-{i}-{k}"):
                final = out
            assert final is not None, "a FINAL_ONLY request ended without output"
            prompt = {"prompt_token_ids": list(final.outputs[0].token_ids)}
        got = 0
        engine = engines[-1]
        rid = f"{tag}-{i}-{len(engines) - 1}"
        async for out in engine.generate(render(engine, prompt), last, rid):
            got += len(out.outputs[0].token_ids)
        return got

    async def main() -> dict[str, Any]:
        engines: list[Any] = []
        idle = None
        t0 = time.perf_counter()
        try:
            for k, model in enumerate(stage_models(a.child_stages)):
                engines.append(build(model, bind_for(a.child_layout, k)))
            init_s = time.perf_counter() - t0

            async def batch(tag: str) -> list[int]:
                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(one(engines, i, tag)) for i in range(a.requests)]
                return [t.result() for t in tasks]

            timing = await run_batches(batch, a.requests, a.tokens, a.batches)
            if a.idle_s > 0:
                idle = await measure_idle(engine_groups(), asyncio.sleep, a.idle_s)
            procs = descendants()
        finally:
            groups = engine_groups()
            watch = ExitWatch([pid for group in groups.values() for pid in group])
            phases: list[tuple[str, tuple[int, ...], float]] = []
            t_close, m_close = time.perf_counter(), time.monotonic()
            for engine in engines:
                manager = engine.engine_core.resources.engine_manager
                cores = tuple(p.pid for p in manager.processes)
                phases.append(("begin", cores, time.monotonic()))
                engine.shutdown()
                phases.append(("end", cores, time.monotonic()))
            shutdown_s = time.perf_counter() - t_close
            m_closed = time.monotonic()
            # vLLM's own stop may leave the worker of a killed EngineCore behind: its exit
            # still ends the engine's own stop (not part of close, which has returned)
            stops = engine_stops(groups, phases, watch.close(wait=LEFTOVER_GRACE_S))
        stop = stop_breakdown(m_close, m_closed, stops)
        return child_result(timing, init_s, shutdown_s, procs, a, stop, idle)

    return asyncio.run(main())


# -- omni-trio ----------------------------------------------------------------------------
def omni_config(n_stages: int, layout: str, tokens: int, requests: int) -> dict[str, Any]:
    """The pipeline config: a chain of vllm stages, the last one the only output stage."""
    greedy = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    stages: list[dict[str, Any]] = []
    for k, model in enumerate(stage_models(n_stages)):
        stage: dict[str, Any] = {
            "id": f"stage{k + 1}",
            "backend": "vllm",
            "engine_args": engine_args(model),
            "output_type": "text" if k == 0 else "tokens",
            "final_output": k == n_stages - 1,
            "default_sampling_params": greedy,
            "options": {"cpu_bind": bind_for(layout, k)},
        }
        if k:
            stage["inputs"] = [f"stage{k}"]
        stages.append(stage)
    return {
        "name": f"bench-tiny-chain-{n_stages}",
        "max_requests_in_flight": max(4096, 2 * requests),
        "stages": stages,
    }


def run_omni(a: argparse.Namespace) -> dict[str, Any]:
    import trio
    import vllm.v1.engine.async_llm  # noqa: F401 (imported before the clock starts, as in run_hand)

    import omni_trio

    config = omni_config(a.child_stages, a.child_layout, a.tokens, a.requests)
    last = config["stages"][-1]["id"]

    async def batch(engine: omni_trio.Engine, tag: str) -> list[int]:
        counts = [0] * a.requests

        async def one(i: int) -> None:
            stream = engine.generate(PROMPTS[i], request_id=f"{tag}-{i}", output_stages=[last])
            async with stream:
                async for out in stream:
                    counts[i] += len(out.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(a.requests):
                nursery.start_soon(one, i)
        return counts

    async def main() -> dict[str, Any]:
        idle = None
        t0 = time.perf_counter()
        with stop_log() as log:
            async with omni_trio.open_engine(config) as engine:
                init_s = time.perf_counter() - t0
                timing = await run_batches(
                    lambda tag: batch(engine, tag), a.requests, a.tokens, a.batches
                )
                groups = engine_groups()
                if a.idle_s > 0:
                    idle = await measure_idle(groups, trio.sleep, a.idle_s)
                procs = descendants()
                watch = ExitWatch([pid for group in groups.values() for pid in group])
                t_close, m_close = time.perf_counter(), time.monotonic()
            shutdown_s = time.perf_counter() - t_close
            m_closed = time.monotonic()
        stops = engine_stops(groups, log.phases, watch.close(wait=LEFTOVER_GRACE_S))
        stop = stop_breakdown(m_close, m_closed, stops)
        return child_result(timing, init_s, shutdown_s, procs, a, stop, idle)

    return trio.run(main)


# -- driver -------------------------------------------------------------------------------
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
    at_exit = still_there(result["children"])
    watched = []
    for p in at_exit:
        with contextlib.suppress(psutil.NoSuchProcess):
            watched.append(psutil.Process(p["pid"]))
    _, alive = psutil.wait_procs(watched, timeout=LEFTOVER_GRACE_S)
    result["leftover"] = {
        "at_exit": at_exit,
        "grace_s": LEFTOVER_GRACE_S,
        "after_grace": [{"pid": p.pid, "status": _status(p)} for p in alive],
    }
    return result


def _status(p: psutil.Process) -> str:
    try:
        return str(p.status())
    except psutil.NoSuchProcess:
        return "gone"


def vllm_version() -> str | None:
    """The installed vLLM's version (the CPU build is its own distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def describe(run: Run, result: dict[str, Any]) -> str:
    head = f"pass {run.pass_index + 1} {cell_name(run.n_stages, run.layout)} {run.system}:"
    if "error" in result:
        return f"{head} FAILED {result['error']}\n{result.get('stderr', '')}"
    left, stop = result["leftover"], result["stop"]
    return (
        f"{head} {result['requests_per_s']['median']:.1f} req/s (best "
        f"{result['requests_per_s']['best']:.1f}), cpu {result['cpu_ms_per_request_stage']:.2f} "
        f"ms/request-stage, init {result['init_s']:.1f} s, shutdown {result['shutdown_s']:.1f} s"
        f" (slowest engine's own stop {_seconds(stop['slowest_own_stop'])}, gap "
        f"{_seconds(stop['gap'])})"
        + ("" if result["tokens_ok"] else ", TOKENS MISSING")
        + (_describe_idle(result["idle"]) if result.get("idle") else "")
        + (f", left at exit: {left['at_exit']}" if left["at_exit"] else "")
        + (
            f", STILL THERE after {left['grace_s']:g} s: {left['after_grace']}"
            if left["after_grace"]
            else ""
        )
    )


def _describe_idle(idle: dict[str, Any]) -> str:
    engines = ", ".join(f"{cpu:.3f}" for cpu in idle["engines_cpu_s"].values())
    return (
        f", idle {idle['seconds']:g} s: frontend {idle['frontend_cpu_s']:.3f} s CPU,"
        f" engines {engines} s"
    )


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"


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
    ap.add_argument("--systems", type=csv(str, SYSTEMS), default=list(SYSTEMS))
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
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        try:
            result = (run_hand if a.child == "hand" else run_omni)(a)
        except Exception as exc:
            # the engines are closed by now: what is still there was left by the failed run
            error = {"error": f"{type(exc).__name__}: {exc}", "children": descendants()}
            print("RESULT " + json.dumps(error), flush=True)
            raise
        print("RESULT " + json.dumps(result), flush=True)
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
