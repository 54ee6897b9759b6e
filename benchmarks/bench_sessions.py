"""Live sessions against the same pipeline driven as one-shot requests. Prints one JSON object.

1. Open/close rates (``rates``, scripted stages, in process): ``--sessions`` operations per
   system and pass, one at a time and ``--concurrency`` at once, on a 2-stage scripted
   pipeline (the entry stage takes streaming input, ``--outputs`` outputs per response, no
   latency). Systems: ``one_shot`` (``engine.generate`` read to its end),
   ``one_shot_streaming_input`` (the same with ``streaming_input=True``: the request a turn
   makes), ``session_one_turn`` (a session opened, one turn: append, commit, its response
   read to ``ResponseDone``, closed), ``session_turns`` (that turn in a session kept open)
   and ``session_open_close`` (a session opened and closed, no turn). Per system: operations per
   wall second, process CPU microseconds per operation, and each against ``one_shot`` in the
   same pass (``rate_vs_one_shot``: above 1 faster; ``cpu_vs_one_shot``: above 1 costlier).
   The systems alternate within a pass (their order rotated), median over passes.
2. Barge-in latency (``barge_in``, scripted): a response that would stream for minutes
   (``STREAM_OUTPUTS`` outputs, 2 ms apart) is cut at its first delta, ``--barge-runs`` times
   a side: ``session`` calls ``barge_in()`` (turns of one session), ``one_shot`` calls
   ``engine.abort(request_id)`` on a request read by another task. ``to_cancelled``: the cut
   call to the reader holding the response's cancelled end (``ResponseDone("cancelled")``;
   the request's first ``finish_reason="abort"`` output); ``to_ended``: to the end of what the
   reader reads (the same event; the request's stream ending); ``to_return``: to the cut
   call's return (every stage dropped it). p50/p99 in ms; ``ratios`` are one_shot/session
   p50 (above 1: the session's is shorter). Twice: stages that drop a request at once
   (``scripted``), and stages whose abort takes ``--slow-abort`` seconds
   (``scripted_slow_abort``, a real engine's abort).
3. Over the wire (``websocket``, unless ``--skip-ws``): ``harness/session_ws.py``: a session
   per socket on ``WS /v1/realtime`` against ``POST /v1/completions``, one server in process,
   clients in threads; the same figures as 1 against ``http_one_shot``.
4. tiny-omni (``tiny_omni``, unless ``--skip-vllm``; real vLLM thinker and talker, torch
   vocoder): ``first_audio``: the same prompt as a session turn (one session), as a one-shot
   request, and as a one-shot request with ``streaming_input=True`` (the request a turn
   makes, without the session), ``--vllm-runs`` rounds, the sides' order rotated: seconds
   from the turn's first append (the request's ``generate``) to its first text delta, its
   first audio delta and its end, p50 and p90; ``ratios``: each one-shot side's p50 over the
   session's (above 1: the session's came sooner); whether every response had the same text
   tokens (greedy). ``barge_in``: as 2, cut at the
   first text delta (the thinker streaming) and at the first audio delta (the talker and the
   vocoder streaming).

Timings are wall (``perf_counter``) and process CPU; nothing is asserted on them. Every
response is checked (its status, its number of outputs) and every wait on an engine is
bounded by ``--bound-s``. Run real engines alone on the machine.

    python benchmarks/bench_sessions.py [--passes 3] [--sessions 500] [--concurrency 1,16]
        [--barge-runs 200] [--ws-sessions 200] [--vllm-runs 20] [--skip-ws] [--skip-vllm]
        [--parts rates,barge_in,websocket,tiny_omni] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import trio

# benchmarks/ is on sys.path (this file runs as a script)
from bench_qwen_omni import percentile, print_report
from bench_vllm_pipeline import csv, progress, vllm_version
from harness.session_cells import (
    RATE_SYSTEMS,
    Cut,
    RateRun,
    Watch,
    aborts,
    barge_ins,
    first_audio_runs,
    rate_run,
)
from harness.session_ws import WS_SYSTEMS, serving, ws_run
from harness.vllm_summary import spread

import omni_trio
from omni_trio.pipelines import pipeline_path
from omni_trio.testing import scripted_pipeline

#: a scripted entry stage's input tokens are the prompt's bytes (one output per token)
PROMPT = "Tell me about the mountains."
#: outputs of a response that a barge-in cuts (it would stream for minutes)
STREAM_OUTPUTS = 100_000
STREAM_LATENCY_S = 0.002
#: the benchmark's parts, in the order they run
PARTS = ("rates", "barge_in", "websocket", "tiny_omni")


# -- pure helpers ---------------------------------------------------------------------------
def rotated(items: Sequence[str], k: int) -> list[str]:
    """``items`` rotated by ``k`` (each takes every position over ``len(items)`` passes)."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def rate_cell(concurrency: int, runs: Sequence[RateRun], base: str) -> dict[str, Any]:
    """Each system's rate and CPU per operation, and against ``base`` pass by pass (the runs
    of a pass are consecutive, one per system)."""
    systems = list(dict.fromkeys(r.system for r in runs))
    by_pass = [runs[i : i + len(systems)] for i in range(0, len(runs), len(systems))]
    out: dict[str, Any] = {"concurrency": concurrency, "ops": runs[0].ops, "systems": {}}
    for system in systems:
        rates, cpus, rate_ratios, cpu_ratios = [], [], [], []
        for one_pass in by_pass:
            run = next(r for r in one_pass if r.system == system)
            ref = next(r for r in one_pass if r.system == base)
            rates.append(run.ops / run.wall_s)
            cpus.append(run.cpu_s / run.ops * 1e6)
            rate_ratios.append((run.ops / run.wall_s) / (ref.ops / ref.wall_s))
            cpu_ratios.append((run.cpu_s / run.ops) / (ref.cpu_s / ref.ops))
        figures: dict[str, Any] = {
            "ops_per_s": spread(rates),
            "cpu_us_per_op": statistics.median(cpus),
        }
        if system != base:
            figures["rate_vs_" + base] = spread(rate_ratios)
            figures["cpu_vs_" + base] = spread(cpu_ratios)
        out["systems"][system] = figures
    return out


def p50_p99_ms(values: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99)}


def cut_summary(cuts: Sequence[Cut]) -> dict[str, Any]:
    return {
        "runs": len(cuts),
        "to_cancelled_ms": p50_p99_ms([c.to_cancelled_s for c in cuts]),
        "to_ended_ms": p50_p99_ms([c.to_ended_s for c in cuts]),
        "to_return_ms": p50_p99_ms([c.to_return_s for c in cuts]),
        "outputs_before_cut": statistics.median(c.outputs_before for c in cuts),
    }


def ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else top / bottom


def barge_summary(session: Sequence[Cut], one_shot: Sequence[Cut]) -> dict[str, Any]:
    """Both sides' cuts and one_shot/session of each p50 (above 1: the session's is shorter)."""
    s, o = cut_summary(session), cut_summary(one_shot)
    keys = ("to_cancelled_ms", "to_ended_ms", "to_return_ms")
    return {
        "session": s,
        "one_shot": o,
        "ratios": {k: ratio(o[k]["p50"], s[k]["p50"]) for k in keys},
    }


def watch_summary(watches: Sequence[Watch]) -> dict[str, Any]:
    def seconds(milestone: str) -> dict[str, float | None]:
        values = [v for w in watches if (v := w.since(milestone)) is not None]
        return {"p50": percentile(values, 50), "p90": percentile(values, 90), "n": len(values)}

    return {
        "first_text_s": seconds("first_text"),
        "first_audio_s": seconds("first_audio"),
        "ended_s": seconds("ended"),
        "text_tokens": statistics.median(len(w.text_ids) for w in watches),
        "audio_samples": statistics.median(w.audio_samples for w in watches),
    }


def first_audio_summary(runs: Mapping[str, Sequence[Watch]]) -> dict[str, Any]:
    """Each side's figures, each one-shot side's p50 over the session's (above 1: the
    session's came sooner), and whether every response streamed the first one's text
    tokens (greedy: they should)."""
    sides = {side: watch_summary(watches) for side, watches in runs.items()}
    keys = ("first_text_s", "first_audio_s", "ended_s")
    session = sides["session"]
    every = [w.text_ids for watches in runs.values() for w in watches]
    return {
        "runs": len(runs["session"]),
        **sides,
        "ratios": {
            side: {k: ratio(figures[k]["p50"], session[k]["p50"]) for k in keys}
            for side, figures in sides.items()
            if side != "session"
        },
        "same_text_tokens": all(ids == every[0] for ids in every),
    }


# -- the parts ------------------------------------------------------------------------------
def scripted_config(
    outputs: int, latency_s: float = 0.0, **options: Any
) -> omni_trio.PipelineConfig:
    sessions = {"max_sessions": 4096, "detach_grace_s": 0.05}
    return scripted_pipeline(
        ["thinker", "talker"],
        stream_input=True,
        outputs=outputs,
        latency_s=latency_s,
        record=False,
        engine_options={"sessions": sessions, "max_requests_in_flight": 4096},
        **options,
    )


async def rate_cells(a: argparse.Namespace) -> list[dict[str, Any]]:
    cells = []
    async with omni_trio.open_engine(scripted_config(a.outputs)) as engine:
        for system in RATE_SYSTEMS:  # warm-up
            await rate_run(engine, system, PROMPT, 20, 2, a.bound_s)
        for c in a.concurrency:
            runs = []
            for p in range(a.passes):
                for system in rotated(RATE_SYSTEMS, p):
                    runs.append(await rate_run(engine, system, PROMPT, a.sessions, c, a.bound_s))
            cells.append(rate_cell(c, runs, "one_shot"))
            progress(f"rates, concurrency {c}: done")
    return cells


async def cut_both(
    engine: omni_trio.Engine,
    prompt: Any,
    sampling: Any,
    point: str,
    runs: int,
    passes: int,
    bound_s: float,
    tag: str,
) -> dict[str, Any]:
    """``runs`` barge-ins and ``runs`` aborts at ``point``, in ``passes`` alternating blocks."""
    session: list[Cut] = []
    one_shot: list[Cut] = []
    block = max(1, runs // passes)
    for p in range(passes):
        for side in rotated(("session", "one_shot"), p):
            if side == "session":
                config = None if sampling is None else {"sampling_params": sampling}
                session += await barge_ins(engine, prompt, config, point, block, bound_s)
            else:
                one_shot += await aborts(
                    engine, prompt, sampling, point, block, bound_s, f"{tag}-{p}"
                )
    return barge_summary(session, one_shot)


async def scripted_barge_in(a: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name, delay in (("scripted", 0.0), ("scripted_slow_abort", a.slow_abort)):
        cfg = scripted_config(STREAM_OUTPUTS, STREAM_LATENCY_S, abort_delay_s=delay)
        async with omni_trio.open_engine(cfg) as engine:
            out[name] = await cut_both(
                engine, PROMPT, None, "first_text", a.barge_runs, a.passes, a.bound_s, name
            )
            out[name]["abort_delay_s"] = delay
        progress(f"barge-in, {name}: done")
    return out


async def websocket_cells(a: argparse.Namespace) -> list[dict[str, Any]]:
    async def body(engine: omni_trio.Engine, base: str) -> list[dict[str, Any]]:
        for system in WS_SYSTEMS:  # warm-up
            await ws_run(engine, base, system, PROMPT, 4, 1, a.bound_s)
        cells = []
        for c in a.concurrency:
            runs = []
            for p in range(a.passes):
                for system in rotated(WS_SYSTEMS, p):
                    runs.append(
                        await ws_run(engine, base, system, PROMPT, a.ws_sessions, c, a.bound_s)
                    )
            cells.append(rate_cell(c, runs, "http_one_shot"))
            progress(f"websocket, concurrency {c}: done")
        return cells

    result: list[dict[str, Any]] = await serving(scripted_config(a.outputs), body, a.bound_s)
    return result


async def tiny_omni(a: argparse.Namespace) -> dict[str, Any]:
    sampling = {
        "thinker": {"max_tokens": a.thinker_tokens, "temperature": 0.0},
        "talker": {"max_tokens": a.talker_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    cfg = omni_trio.load_config(str(pipeline_path("tiny-omni")))
    progress("opening tiny-omni")
    t0 = time.perf_counter()
    async with omni_trio.open_engine(cfg) as engine:
        open_s = time.perf_counter() - t0
        progress(f"tiny-omni open in {open_s:.1f} s")
        await first_audio_runs(engine, PROMPT, sampling, 1, a.bound_s)  # warm-up
        runs = await first_audio_runs(engine, PROMPT, sampling, a.vllm_runs, a.bound_s)
        progress("tiny-omni first audio: done")
        cuts = {}
        for point in ("first_text", "first_audio"):
            cuts[point] = await cut_both(
                engine, PROMPT, sampling, point, a.vllm_runs, 2, a.bound_s, point
            )
            progress(f"tiny-omni barge-in at {point}: done")
    return {
        "engine_open_s": open_s,
        "sampling_params": sampling,
        "first_audio": first_audio_summary(runs),
        "barge_in": cuts,
    }


async def run(a: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "benchmark": "sessions",
        "workload": {
            "prompt": PROMPT,
            "scripted": "2 stages (thinker -> talker, stream_input), no latency",
            "outputs_per_response": a.outputs,
            "sessions_per_system_and_pass": a.sessions,
            "concurrency": a.concurrency,
            "passes": a.passes,
            "barge_runs": a.barge_runs,
            "barge_stream": {"outputs": STREAM_OUTPUTS, "latency_s": STREAM_LATENCY_S},
            "python": sys.version.split()[0],
            "trio": trio.__version__,
        },
    }
    if "rates" in a.parts:
        report["rates"] = await rate_cells(a)
    if "barge_in" in a.parts:
        report["barge_in"] = await scripted_barge_in(a)
    if "websocket" in a.parts:
        report["workload"]["ws_sessions_per_system_and_pass"] = a.ws_sessions
        report["websocket"] = await websocket_cells(a)
    if "tiny_omni" in a.parts:
        report["workload"]["vllm"] = vllm_version()
        report["workload"]["vllm_runs"] = a.vllm_runs
        report["tiny_omni"] = await tiny_omni(a)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=500, help="operations per system and pass")
    ap.add_argument("--concurrency", type=csv(int), default=[1, 16])
    ap.add_argument("--outputs", type=int, default=8, help="scripted outputs per response")
    ap.add_argument("--barge-runs", type=int, default=200, help="barge-ins (and aborts)")
    ap.add_argument("--slow-abort", type=float, default=0.02, help="seconds a slow abort takes")
    ap.add_argument("--ws-sessions", type=int, default=200, help="operations per system and pass")
    ap.add_argument("--vllm-runs", type=int, default=20, help="tiny-omni runs per side and cell")
    ap.add_argument("--thinker-tokens", type=int, default=32)
    ap.add_argument("--talker-tokens", type=int, default=160)
    ap.add_argument("--bound-s", type=float, default=120.0, help="bound on each wait")
    ap.add_argument("--parts", type=csv(str, PARTS), default=list(PARTS))
    ap.add_argument("--skip-ws", action="store_true", help="no websocket part")
    ap.add_argument("--skip-vllm", action="store_true", help="no tiny_omni part")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke runs)")
    a = ap.parse_args(argv)
    skipped = {"websocket": a.skip_ws, "tiny_omni": a.skip_vllm}
    a.parts = [p for p in a.parts if not skipped.get(p)]
    if a.quick:
        a.passes, a.sessions, a.barge_runs, a.ws_sessions, a.vllm_runs = 1, 20, 10, 6, 2
        a.concurrency = [1, 4]
    return a


if __name__ == "__main__":
    print_report(run, parse_args())
