"""Prefill/decode disaggregation on CPU: the ``tiny-pd`` pipeline against one engine.

Both systems run through ``omni_trio.open_engine`` in one process, open side by side, and
take the same prompts, interleaved:

- ``pd``: the shipped ``tiny-pd`` pipeline: a prefill engine computes the prompt's KV cache
  and vLLM's ExampleConnector writes it to a store (a temporary directory); the decode engine
  loads it from there and answers.
- ``single``: one engine of the same model with the same engine args (the decode's, without
  the connector): it computes the prompt itself.

``--layout``: ``default`` leaves vLLM's CPU binding (every engine's worker on core 0), as
the shipped pipeline does; ``spread`` puts the prefill engine on core 0 and the decode
engine, and the single engine, on core 1 (the decode then shares its core with nobody while
it runs, as on machines of their own). On a 2-core machine the point is what the handoff
costs and that it is right, not a speed-up.

Workload: prompts of seeded random token ids, their lengths cycling over ``--lengths``
(tokens; none one more than a multiple of the block size, 32: ExampleConnector never finds
those), each prompt new to every engine (no prefix cache hit anywhere); greedy,
``--tokens`` tokens each, ``ignore_eos``. A warm-up runs ``--concurrency`` requests on each
system; then each of ``--passes`` passes runs four cells, ``single`` and ``pd``, each
``sequential`` (one request after another) and ``concurrent`` (``--concurrency`` in flight),
``--requests`` requests each; both systems of a mode take the same prompts; the order of the
cells rotates per pass, so slow drift on the shared machine hits all alike.

Reading the output (one JSON object on stdout; progress on stderr):

- ``cells``: per cell ``requests_per_s`` (median, min, max over passes), ``ttft_s`` (from
  ``generate()`` to the first answer token the caller gets; for ``pd`` the decode's, after
  the prefill ran and handed over: p50, p90), ``latency_s``, ``arrival_s`` (from
  ``generate()`` to the answering engine's arrival time: for ``pd`` the prefill's whole run,
  its cache written, and the handoff), ``engine_ttft_s`` (the answering engine's own
  ``first_token_latency``, from its arrival: for ``pd`` the decode engine's, which loads the
  cache and computes only the prompt's last partial block) and ``cpu_s_per_request`` (this process
  and the cell's engine processes, median over passes).
- ``ratios`` (``pd`` against ``single``; above 1: ``pd`` better): ``sequential_rps`` and
  ``concurrent_rps`` (pd/single, paired per pass), ``sequential_ttft_p50`` and
  ``concurrent_ttft_p50`` (single/pd), ``cpu_per_request`` (single/pd, sequential).
- ``check``: ``same_tokens`` (every ``pd`` answer equals ``single``'s for its prompt),
  ``loaded_as_expected`` (every decode's ``num_cached_tokens`` is what ExampleConnector
  loads: the prompt's whole blocks less its last token; the decode has no prefix cache, so
  they all came through the connector), the prompt tokens the decode loaded and computed,
  the first mismatches.
- ``engine_open_s``: each system's start (pd: two engines in parallel).

    python benchmarks/bench_pd.py [--passes 5] [--requests 32] [--concurrency 8]
        [--tokens 16] [--lengths 48,80,112,144,176,208] [--seed 0]
        [--layout default|spread] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio

# benchmarks/ is on sys.path (this file runs as a script)
from bench_qwen_omni import p50_p90, print_report
from bench_vllm_pipeline import csv, progress, vllm_version
from harness.pd_hand import BLOCK_SIZE, loaded_tokens
from harness.vllm_procs import cpu_seconds
from harness.vllm_summary import spread

import omni_trio
from omni_trio.config import PipelineConfig
from omni_trio.pipelines import pipeline_path

SYSTEMS = ("single", "pd")
MODES = ("sequential", "concurrent")
CELLS = tuple(f"{s}_{m}" for m in MODES for s in SYSTEMS)
MAX_MODEL_LEN = 256  # tiny-pd's
#: per layout, each engine's ``cpu_bind`` (``VLLM_CPU_OMP_THREADS_BIND``; None: vLLM's
#: default, which puts every engine's worker on core 0)
LAYOUTS: dict[str, dict[str, str | None]] = {
    "default": {"prefill": None, "decode": None, "single": None},
    "spread": {"prefill": "0", "decode": "1", "single": "1"},
}
#: token ids the prompts draw from: the tiny thinker's vocabulary less its special tokens
FIRST_ID, VOCAB = 3, 512


@dataclass
class Reply:
    """One request: its prompt, timings, answer and the answering engine's counters."""

    prompt: int
    arrival_s: float | None
    ttft_s: float
    latency_s: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    engine_ttft_s: float | None


@dataclass
class CellRun:
    """One cell of one pass: its wall time, CPU seconds and replies."""

    cell: str
    pass_index: int
    wall_s: float
    cpu_s: float
    replies: list[Reply] = field(default_factory=list)


# -- pure helpers -------------------------------------------------------------------------
def check_lengths(lengths: Sequence[int], tokens: int) -> list[int]:
    """``lengths`` if ExampleConnector moves some of a prompt of each and it fits the model
    with ``tokens`` more; otherwise ValueError naming the length."""
    for n in lengths:
        if loaded_tokens(n) == 0:
            raise ValueError(
                f"a prompt of {n} tokens loads nothing through ExampleConnector (it needs "
                f"{BLOCK_SIZE + 2} tokens or more, and n - 1 not a multiple of {BLOCK_SIZE})"
            )
        if n + tokens > MAX_MODEL_LEN:
            raise ValueError(f"{n} prompt tokens + {tokens} exceed max_model_len {MAX_MODEL_LEN}")
    return list(lengths)


def make_prompts(lengths: Sequence[int], count: int, rng: random.Random) -> list[list[int]]:
    """``count`` prompts of random token ids, lengths cycling over ``lengths``."""
    return [
        [rng.randrange(FIRST_ID, VOCAB) for _ in range(lengths[k % len(lengths)])]
        for k in range(count)
    ]


def folders_in(store: str) -> int:
    """How many prompts ExampleConnector stored in ``store`` (a folder each)."""
    return sum(1 for d in Path(store).iterdir() if d.is_dir())


def cell_order(pass_index: int) -> list[str]:
    """The cells of a pass, rotated by the pass index (each cell takes every position)."""
    k = pass_index % len(CELLS)
    return [*CELLS[k:], *CELLS[:k]]


def single_config(pd: PipelineConfig, bind: str | None = None) -> dict[str, Any]:
    """One engine of the pair's model: the decode stage's engine args without the
    connector, as a pipeline of one stage (its worker on core ``bind``, if given)."""
    decode = pd.stage("decode")
    args = {k: v for k, v in decode.engine_args.items() if k != "kv_transfer_config"}
    stage = {"id": "single", "backend": "vllm", "engine_args": args, "final_output": True}
    if bind is not None:
        stage["options"] = {"cpu_bind": bind}
    return {"name": "tiny-single", "stages": [stage]}


def pd_overrides(store: str, layout: str) -> dict[str, dict[str, Any]]:
    """``stage_overrides`` of tiny-pd: both halves' store in ``store``, each on its core of
    ``layout``."""
    kv = {"kv_transfer_config": {"kv_connector_extra_config": {"shared_storage_path": store}}}
    out: dict[str, dict[str, Any]] = {}
    for sid in ("prefill", "decode"):
        out[sid] = {"engine_args": kv}
        if LAYOUTS[layout][sid] is not None:
            out[sid]["options"] = {"cpu_bind": LAYOUTS[layout][sid]}
    return out


def check_replies(runs: Sequence[CellRun]) -> dict[str, Any]:
    """Each ``pd`` reply against the ``single`` reply of the same prompt (the same pass and
    mode), and each decode's ``num_cached_tokens`` against :func:`loaded_tokens`."""
    by_cell = {(run.pass_index, run.cell): run for run in runs}
    mismatches: list[dict[str, Any]] = []
    same = loaded_ok = True
    loaded = computed = checked = 0
    for (p, cell), run in sorted(by_cell.items()):
        if not cell.startswith("pd_"):
            continue
        single = by_cell[(p, cell.replace("pd_", "single_"))]
        for i, (got, want) in enumerate(zip(run.replies, single.replies, strict=True)):
            checked += 1
            expected = loaded_tokens(got.prompt_tokens)
            differs = []
            if got.token_ids != want.token_ids:
                differs.append("tokens")
                same = False
            if got.cached_tokens != expected:
                differs.append(f"loaded {got.cached_tokens}, expected {expected}")
                loaded_ok = False
            loaded += got.cached_tokens
            computed += got.prompt_tokens - got.cached_tokens
            if differs:
                mismatches.append({"pass": p, "cell": cell, "request": i, "differs": differs})
    return {
        "same_tokens": same,
        "loaded_as_expected": loaded_ok,
        "requests_checked": checked,
        "decode_prompt_tokens": {"loaded": loaded, "computed": computed},
        "mismatches": mismatches[:10],
        "mismatch_count": len(mismatches),
    }


def summarize_cell(runs: Sequence[CellRun]) -> dict[str, Any]:
    """A cell's figures over its passes (see the module docstring)."""
    replies = [r for run in runs for r in run.replies]
    engine = [r.engine_ttft_s for r in replies if r.engine_ttft_s is not None]
    arrival = [r.arrival_s for r in replies if r.arrival_s is not None]
    return {
        "requests": len(replies),
        "requests_per_s": spread([len(run.replies) / run.wall_s for run in runs]),
        "ttft_s": p50_p90([r.ttft_s for r in replies]),
        "latency_s": p50_p90([r.latency_s for r in replies]),
        "arrival_s": p50_p90(arrival) if arrival else None,
        "engine_ttft_s": p50_p90(engine) if engine else None,
        "cpu_s_per_request": statistics.median(run.cpu_s / len(run.replies) for run in runs),
    }


def ratios(cells: Mapping[str, dict[str, Any]], runs: Sequence[CellRun]) -> dict[str, Any]:
    """``pd`` against ``single``, each above 1 when ``pd`` is better."""

    def per_pass_rps(cell: str) -> list[float]:
        return [len(r.replies) / r.wall_s for r in runs if r.cell == cell]

    out: dict[str, Any] = {}
    for mode in MODES:
        pd, single = per_pass_rps(f"pd_{mode}"), per_pass_rps(f"single_{mode}")
        out[f"{mode}_rps"] = spread([a / b for a, b in zip(pd, single, strict=True)])
        ttft = (cells[f"single_{mode}"]["ttft_s"]["p50"], cells[f"pd_{mode}"]["ttft_s"]["p50"])
        out[f"{mode}_ttft_p50"] = ttft[0] / ttft[1]
    seq = (cells["single_sequential"], cells["pd_sequential"])
    out["cpu_per_request"] = seq[0]["cpu_s_per_request"] / seq[1]["cpu_s_per_request"]
    return out


# -- the run ------------------------------------------------------------------------------
async def request(engine: omni_trio.Engine, k: int, prompt: list[int], tokens: int) -> Reply:
    """One greedy request, its answer streamed to the end."""
    sampling = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    ids: list[int] = []
    first: float | None = None
    metrics: Mapping[str, Any] = {}
    t0, wall0 = time.perf_counter(), time.time()
    async with engine.generate(prompt, sampling_params=sampling) as stream:
        async for out in stream:
            if out.token_ids and first is None:
                first = time.perf_counter() - t0
            ids.extend(out.token_ids)
            if out.finished and isinstance(out.metrics, Mapping):
                metrics = out.metrics
    latency = time.perf_counter() - t0
    engine_ttft, arrival = metrics.get("first_token_latency"), metrics.get("arrival_time")
    return Reply(
        prompt=k,
        arrival_s=arrival - wall0 if isinstance(arrival, (int, float)) and arrival else None,
        ttft_s=latency if first is None else first,
        latency_s=latency,
        token_ids=ids,
        prompt_tokens=int(metrics.get("num_prompt_tokens", len(prompt))),
        cached_tokens=int(metrics.get("num_cached_tokens", 0)),
        engine_ttft_s=float(engine_ttft) if isinstance(engine_ttft, (int, float)) else None,
    )


async def engine_pids(engine: omni_trio.Engine) -> list[int]:
    """The engine's vLLM processes: each EngineCore and what it spawned (its workers)."""
    pids: list[int] = []
    for replica in await engine.collective_rpc("engine_core_pids"):
        assert isinstance(replica, (list, tuple))
        for pid in replica:
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    return pids


@dataclass
class System:
    engine: omni_trio.Engine
    pids: list[int]


async def run_cell(
    system: System, cell: str, p: int, prompts: list[list[int]], a: argparse.Namespace
) -> CellRun:
    """``prompts`` through ``system``, one at a time or ``--concurrency`` in flight."""
    replies: dict[int, Reply] = {}
    indices = iter(range(len(prompts)))

    async def worker() -> None:
        for k in indices:
            replies[k] = await request(system.engine, k, prompts[k], a.tokens)

    in_flight = a.concurrency if cell.endswith("_concurrent") else 1
    cpu0, t0 = cpu_seconds(system.pids) + time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(in_flight):
            nursery.start_soon(worker)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(system.pids) + time.process_time() - cpu0
    return CellRun(cell, p, wall, cpu, [replies[k] for k in range(len(prompts))])


async def open_system(
    stack: contextlib.AsyncExitStack, name: str, cfg: Any, opened: dict[str, float]
) -> System:
    progress(f"opening {name}")
    t0 = time.perf_counter()
    engine = await stack.enter_async_context(omni_trio.open_engine(cfg))
    opened[name] = time.perf_counter() - t0
    progress(f"{name} open in {opened[name]:.1f} s")
    return System(engine, await engine_pids(engine))


async def run(a: argparse.Namespace) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="bench-pd-store-")
    pd_cfg = omni_trio.load_config(
        pipeline_path("tiny-pd"), stage_overrides=pd_overrides(store, a.layout)
    )
    single_cfg = single_config(pd_cfg, LAYOUTS[a.layout]["single"])
    rng = random.Random(a.seed)
    opened: dict[str, float] = {}
    runs: list[CellRun] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            systems = {
                "single": await open_system(stack, "single", single_cfg, opened),
                "pd": await open_system(stack, "pd", pd_cfg, opened),
            }
            warm = make_prompts(a.lengths, a.concurrency, rng)
            for name, system in systems.items():
                await run_cell(system, f"{name}_concurrent", -1, warm, a)
            for p in range(a.passes):
                prompts = {m: make_prompts(a.lengths, a.requests, rng) for m in MODES}
                for cell in cell_order(p):
                    name, mode = cell.split("_")
                    one = await run_cell(systems[name], cell, p, prompts[mode], a)
                    runs.append(one)
                    rps = len(one.replies) / one.wall_s
                    progress(f"pass {p + 1}/{a.passes} {cell}: {rps:.2f} req/s")
            stored = await trio.to_thread.run_sync(folders_in, store)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    cells = {c: summarize_cell([r for r in runs if r.cell == c]) for c in CELLS}
    return {
        "benchmark": "pd",
        "workload": {
            "model": "tiny:thinker",
            "pipeline": "tiny-pd (ExampleConnector, block_size 32, decode without prefix cache)",
            "single": "one engine, the decode's engine args without the connector",
            "prompt_lengths": a.lengths,
            "tokens": a.tokens,
            "requests_per_cell": a.requests,
            "concurrency": a.concurrency,
            "passes": a.passes,
            "seed": a.seed,
            "layout": {"name": a.layout, "cpu_bind": LAYOUTS[a.layout]},
            "prompts_stored": stored,
            "engine_open_s": opened,
            "versions": {"vllm": vllm_version()},
        },
        "cells": cells,
        "ratios": ratios(cells, runs),
        "check": check_replies(runs),
        "passes": [{"cell": r.cell, "wall_s": r.wall_s, "cpu_s": r.cpu_s} for r in runs],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--requests", type=int, default=32, help="requests per cell and pass")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent cells' in flight")
    ap.add_argument("--tokens", type=int, default=16, help="answer tokens per request")
    ap.add_argument("--lengths", type=csv(int), default=[48, 80, 112, 144, 176, 208])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="default")
    ap.add_argument("--quick", action="store_true", help="1 pass of 4 requests, 2 in flight")
    a = ap.parse_args(argv)
    if a.quick:
        a.passes, a.requests, a.concurrency, a.lengths = 1, 4, 2, [48, 112]
    try:
        check_lengths(a.lengths, a.tokens)
    except ValueError as exc:
        ap.error(str(exc))
    return a


def main() -> None:
    print_report(run, parse_args())


if __name__ == "__main__":
    main()
