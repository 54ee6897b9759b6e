"""The cells of ``bench_vllm_pipeline.py``: what runs where. The stage models, the CPU layouts,
the engine args (the same in both systems), omni-trio's pipeline config, and the order of the
subprocess runs. Pure: no vLLM, no processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_trio.backends.vllm.protocol import CPU_ENGINE_DEFAULTS

PROMPTS = [f"request {i}: the tiny omni model sings a song about the river" for i in range(997)]
LAYOUTS = ("core0", "spread")
SYSTEMS = ("hand", "omni", "omni_ta", "omni_traced", "tracing_ab", "trio", "shared")
#: what runs unless asked: ``omni_ta`` (omni-trio with its engines on trio-asyncio's loop),
#: ``trio`` and ``shared`` (the floors under omni-trio's design, with a thread per engine or one
#: for all) only on request
DEFAULT_SYSTEMS = ("hand", "omni")
#: the systems besides ``omni`` that a cell compares with ``hand``, each in its
#: ``{system}_ratio`` and ``{system}_cpu_ratio``
VERSUS_HAND = ("omni_ta", "trio", "shared")
#: the worker loop (the vllm stage option ``loop``) of each omni-trio system; a cell compares
#: the second with the first in ``loop_ratio`` and ``loop_cpu_ratio``
OMNI_LOOPS = {"omni": "asyncio", "omni_ta": "trio-asyncio"}
#: ``omni`` with OpenTelemetry tracing on (an in-memory exporter); a cell compares it with
#: ``omni`` run for run in ``tracing_ratio`` and ``tracing_cpu_ratio``
TRACED = "omni_traced"
#: ``omni`` with tracing switched on and off batch by batch in one process (the same engines
#: on the same cores): ``tracing_ab_ratio`` and ``tracing_ab_cpu_ratio``, on/off
TRACING_AB = "tracing_ab"


def ab_order(batches: int) -> list[bool]:
    """Whether each of ``2 * batches`` timed batches runs traced: ABBA pairs (off on, on
    off, ...), so a drift over the run hits both alike. Pure."""
    return [(i % 2 == 1) != (i // 2 % 2 == 1) for i in range(2 * batches)]


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


def omni_config(
    n_stages: int, layout: str, tokens: int, requests: int, loop: str = "asyncio"
) -> dict[str, Any]:
    """The pipeline config: a chain of vllm stages, the last one the only output stage, every
    engine's worker on a ``loop`` loop."""
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
            "options": {"cpu_bind": bind_for(layout, k), "loop": loop},
        }
        if k:
            stage["inputs"] = [f"stage{k}"]
        stages.append(stage)
    return {
        "name": f"bench-tiny-chain-{n_stages}",
        "max_requests_in_flight": max(4096, 2 * requests),
        "stages": stages,
    }


async def omni_batch(engine: Any, last: str, requests: int, tag: str) -> list[int]:
    """One batch through an open omni-trio engine: ``requests`` requests at once (request i
    asks ``PROMPTS[i]``), reading stage ``last``; the tokens each request got."""
    import trio

    counts = [0] * requests

    async def one(i: int) -> None:
        stream = engine.generate(PROMPTS[i], request_id=f"{tag}-{i}", output_stages=[last])
        async with stream:
            async for out in stream:
                counts[i] += len(out.token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(one, i)
    return counts
