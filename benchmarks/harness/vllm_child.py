"""The subprocess of one ``bench_vllm_pipeline.py`` run: one system on one cell. ``hand``
drives one vLLM ``AsyncLLM`` per stage from plain asyncio; ``omni`` runs the same pipeline
through ``omni_trio.open_engine`` (``omni_ta``: with every engine's worker on trio-asyncio's
loop); ``trio`` and ``shared`` are the floors under omni-trio's
design (:mod:`harness.vllm_trio`). All time the same batches (:func:`run_batches`) and report
the same fields (:func:`child_result`)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from omni_trio.backends.vllm.amx import request_amx

from .vllm_cells import (
    OMNI_LOOPS,
    PROMPTS,
    TRACED,
    TRACING_AB,
    ab_order,
    bind_for,
    engine_args,
    omni_batch,
    omni_config,
    stage_models,
)
from .vllm_procs import (
    LEFTOVER_GRACE_S,
    ExitWatch,
    descendants,
    engine_groups,
    engine_stops,
    measure_idle,
    still_there,
    stop_breakdown,
    stop_log,
    stop_one_by_one,
    thread_cpu,
)
from .vllm_summary import (
    batch_throughput,
    cpu_ms_per_request_stage,
    cpu_split_ms_per_request_stage,
)
from .vllm_trio import run_trio


def child_main(a: argparse.Namespace) -> None:
    """The subprocess: run ``a.child`` (a system of ``SYSTEMS``) and print its result as one
    ``RESULT {json}`` line on stdout (on failure the error and what is still there, then
    re-raise)."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # vLLM-CPU runs AMX instructions before asking Linux for the tile state (every system
    # here: the hand-driven programs too); omni-trio's vLLM plugin asks in the engines' own
    # processes
    request_amx()
    try:
        if a.child in ("trio", "shared"):
            result = run_trio(a, child_result, run_batches, shared=a.child == "shared")
        elif a.child in OMNI_LOOPS:
            result = run_omni(a, OMNI_LOOPS[a.child])
        elif a.child == TRACED:
            result = run_omni(a, OMNI_LOOPS["omni"], traced=True)
        elif a.child == TRACING_AB:
            result = run_omni(a, OMNI_LOOPS["omni"], ab=True)
        else:
            result = run_hand(a)
    except Exception as exc:
        # the engines are closed by now: what is still there was left by the failed run
        error = {"error": f"{type(exc).__name__}: {exc}", "children": descendants()}
        print("RESULT " + json.dumps(error), flush=True)
        raise
    print("RESULT " + json.dumps(result), flush=True)


async def run_batches(
    batch: Callable[[str], Awaitable[list[int]]], requests: int, tokens: int, batches: int
) -> dict[str, Any]:
    """A warm-up batch, then ``batches`` timed ones; wall times, CPU time of this process over
    the timed batches, and whether every request got all its last-stage tokens. Awaits
    ``batch`` only, so it runs on asyncio and on trio alike."""
    counts = await batch("warm")
    ok = counts == [tokens] * requests
    walls = []
    cpu0, threads0 = time.process_time(), thread_cpu()
    for b in range(batches):
        t0 = time.perf_counter()
        counts = await batch(f"b{b}")
        walls.append(time.perf_counter() - t0)
        ok = ok and counts == [tokens] * requests
    return {
        "walls": walls,
        "cpu_s": time.process_time() - cpu0,
        "threads": (threads0, thread_cpu()),
        "tokens_ok": ok,
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
    batches = len(timing["walls"])
    return {
        "batch_walls_s": timing["walls"],
        "requests_per_s": batch_throughput(timing["walls"], a.requests),
        "cpu_s": timing["cpu_s"],
        "cpu_ms_per_request_stage": cpu_ms_per_request_stage(
            timing["cpu_s"], a.requests, batches, a.child_stages
        ),
        "cpu_split_ms": cpu_split_ms_per_request_stage(
            *timing["threads"], a.requests, batches, a.child_stages
        ),
        "tokens_ok": timing["tokens_ok"],
        "init_s": init_s,
        "shutdown_s": shutdown_s,
        "children": procs,
        "after_close": still_there(procs),
        "stop": stop,
        "idle": idle,
    }


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

            def cores(engine: Any) -> tuple[int, ...]:
                return tuple(p.pid for p in engine.engine_core.resources.engine_manager.processes)

            shutdown_s, stop = stop_one_by_one([(cores(e), e.shutdown) for e in engines])
        return child_result(timing, init_s, shutdown_s, procs, a, stop, idle)

    return asyncio.run(main())


def _in_memory_tracer(config: Any) -> tuple[Any, Callable[[], int]]:
    """A request tracer on an in-memory exporter (every span made, ended and exported, no
    network), and how many spans it exported so far."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from omni_trio.telemetry.spans import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(config, provider), lambda: len(exporter.get_finished_spans())


async def run_ab_batches(
    batch: Callable[[str], Awaitable[list[int]]],
    tracing: Callable[[bool], None],
    a: argparse.Namespace,
) -> dict[str, Any]:
    """:func:`run_batches` with tracing switched on and off between batches
    (:func:`~harness.vllm_cells.ab_order`): the timing of every batch, and per mode its
    median requests/s and CPU per request-stage; ``ratio`` and ``cpu_ratio`` are on/off."""
    counts = await batch("warm")
    ok = counts == [a.tokens] * a.requests
    walls: list[float] = []
    modes: dict[bool, dict[str, Any]] = {
        m: {"walls": [], "cpu_s": 0.0, "threads": []} for m in (False, True)
    }
    cpu_all, threads_all = time.process_time(), thread_cpu()
    for i, traced in enumerate(ab_order(a.batches)):
        tracing(traced)
        cpu0, threads0 = time.process_time(), thread_cpu()
        t0 = time.perf_counter()
        counts = await batch(f"b{i}")
        wall = time.perf_counter() - t0
        mode = modes[traced]
        mode["walls"].append(wall)
        mode["cpu_s"] += time.process_time() - cpu0
        mode["threads"].append((threads0, thread_cpu()))
        walls.append(wall)
        ok = ok and counts == [a.tokens] * a.requests
    tracing(False)
    per_mode = {}
    for traced, mode in modes.items():
        n = len(mode["walls"])
        split = {
            group: sum(after[group] - before[group] for before, after in mode["threads"])
            for group in ("loop", "engine_threads", "other")
        }
        per_mode["on" if traced else "off"] = {
            "requests_per_s": batch_throughput(mode["walls"], a.requests),
            "cpu_ms_per_request_stage": cpu_ms_per_request_stage(
                mode["cpu_s"], a.requests, n, a.child_stages
            ),
            "cpu_split_ms": {
                g: cpu_ms_per_request_stage(s, a.requests, n, a.child_stages)
                for g, s in split.items()
            },
        }
    on, off = per_mode["on"], per_mode["off"]
    return {
        "walls": walls,
        "cpu_s": time.process_time() - cpu_all,
        "threads": (threads_all, thread_cpu()),
        "tokens_ok": ok,
        "ab": {
            **per_mode,
            "ratio": on["requests_per_s"]["median"] / off["requests_per_s"]["median"],
            "cpu_ratio": on["cpu_ms_per_request_stage"] / off["cpu_ms_per_request_stage"],
        },
    }


def run_omni(
    a: argparse.Namespace, loop: str, traced: bool = False, ab: bool = False
) -> dict[str, Any]:
    import trio
    import vllm.v1.engine.async_llm  # noqa: F401 (imported before the clock starts, as in run_hand)

    import omni_trio
    from omni_trio.transport.loop_host import require_loop

    require_loop(loop)  # its import too (trio-asyncio) before the clock starts
    config = omni_config(a.child_stages, a.child_layout, a.tokens, a.requests, loop)
    last = config["stages"][-1]["id"]

    async def main() -> dict[str, Any]:
        idle = None
        t0 = time.perf_counter()
        with stop_log() as log:
            async with omni_trio.open_engine(config) as engine:
                init_s = time.perf_counter() - t0
                spans = None
                if traced:
                    tracer, spans = _in_memory_tracer(engine.config)
                    engine.add_observer(tracer)
                if ab:
                    tracer, spans = _in_memory_tracer(engine.config)

                    attached = [False]

                    def tracing(on: bool) -> None:
                        if on and not attached[0]:
                            engine.add_observer(tracer)
                        elif attached[0] and not on:
                            engine.remove_observer(tracer)
                        attached[0] = on

                    timing = await run_ab_batches(
                        lambda tag: omni_batch(engine, last, a.requests, tag), tracing, a
                    )
                else:
                    timing = await run_batches(
                        lambda tag: omni_batch(engine, last, a.requests, tag),
                        a.requests,
                        a.tokens,
                        a.batches,
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
        result = child_result(timing, init_s, shutdown_s, procs, a, stop, idle)
        if ab:
            result["ab"] = timing["ab"]
        if spans is not None:
            result["spans"] = spans()
        return result

    return trio.run(main)
