"""A 2-stage tiny vLLM pipeline (thinker -> talker, token hand-off), omni-trio vs hand-driven.

In one run, each in a fresh subprocess (same engine args, same CPU binding: thinker on core
0, talker on core 1):

- ``hand``: a plain asyncio program driving two ``AsyncLLM`` engines directly; each request
  streams stage 1 and, when it finishes, submits stage 2 with stage 1's token ids as prompt;
- ``omni``: the same pipeline through ``omni_trio.open_engine``.

``--requests`` requests (all submitted at once) x ``--tokens`` tokens per stage
(``ignore_eos``, temperature 0). Reports throughput (requests/s) of each and the ratio
omni/hand, time to first output (the first stage-1 delta) p50/p99 and the overhead; engine
start-up is excluded (a warm-up batch runs first). Prints one JSON object.

    python benchmarks/bench_vllm_pipeline.py [--requests 64] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPTS = [f"request {i}: the tiny omni model sings a song about the river" for i in range(997)]
THINKER = {"model": "tiny:thinker"}
TALKER = {"model": "tiny:talker"}
BIND = ("0", "1")


def _summary(t_total: float, ttfo: list[float], n: int, tokens_ok: bool) -> dict[str, Any]:
    ttfo = sorted(ttfo)
    return {
        "wall_s": round(t_total, 4),
        "requests_per_s": round(n / t_total, 3),
        "ttfo_p50_ms": round(1000 * statistics.median(ttfo), 2),
        "ttfo_p99_ms": round(1000 * ttfo[min(len(ttfo) - 1, int(0.99 * len(ttfo)))], 2),
        "all_tokens_received": tokens_ok,
    }


# -- (b) hand-driven asyncio --------------------------------------------------------------
def run_hand(n: int, tokens: int) -> dict[str, Any]:
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from omni_trio.models import resolve_model
    from omni_trio.stages._vllm_protocol import CPU_ENGINE_DEFAULTS

    def build(args: dict[str, Any], bind: str) -> Any:
        merged = {**CPU_ENGINE_DEFAULTS, **args, "model": resolve_model(args["model"])}
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # inherited by this engine's core
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**merged))

    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def render(engine: Any, raw: Any) -> Any:
        parsed = parse_model_prompt(engine.model_config, raw)
        (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
        return rendered

    async def one(e1: Any, e2: Any, i: int, tag: str, t0: float, ttfo: list[float]) -> int:
        toks: list[int] = []
        first = True
        async for out in e1.generate(await render(e1, PROMPTS[i]), params, f"{tag}-{i}-1"):
            if first:
                ttfo.append(time.perf_counter() - t0)
                first = False
            toks.extend(out.outputs[0].token_ids)
        got = 0
        prompt2 = await render(e2, {"prompt_token_ids": toks})
        async for out in e2.generate(prompt2, params, f"{tag}-{i}-2"):
            got += len(out.outputs[0].token_ids)
        return len(toks) + got

    async def batch(e1: Any, e2: Any, tag: str) -> tuple[float, list[float], bool]:
        ttfo: list[float] = []
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(e1, e2, i, tag, t0, ttfo) for i in range(n)))
        return time.perf_counter() - t0, ttfo, all(c == 2 * tokens for c in counts)

    async def main() -> dict[str, Any]:
        e1, e2 = build(THINKER, BIND[0]), build(TALKER, BIND[1])
        try:
            await batch(e1, e2, "warm")
            wall, ttfo, ok = await batch(e1, e2, "run")
            return _summary(wall, ttfo, n, ok)
        finally:
            e1.shutdown(timeout=1.0)
            e2.shutdown(timeout=1.0)

    return asyncio.run(main())


# -- (a) omni-trio ------------------------------------------------------------------------
def run_omni(n: int, tokens: int) -> dict[str, Any]:
    import trio

    import omni_trio

    greedy = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    config = {
        "name": "bench-tiny-chain",
        "max_requests_in_flight": max(4096, 2 * n),
        "stages": [
            {
                "id": "thinker",
                "backend": "vllm",
                "engine_args": THINKER,
                "default_sampling_params": greedy,
                "options": {"cpu_bind": BIND[0]},
            },
            {
                "id": "talker",
                "backend": "vllm",
                "inputs": ["thinker"],
                "engine_args": TALKER,
                "final_output": True,
                "output_type": "tokens",
                "default_sampling_params": greedy,
                "options": {"cpu_bind": BIND[1]},
            },
        ],
    }

    async def batch(engine: Any, tag: str) -> tuple[float, list[float], bool]:
        ttfo: list[float] = []
        counts: list[int] = []
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            got = 0
            first = True
            stream = engine.generate(
                PROMPTS[i], request_id=f"{tag}-{i}", output_stages=["thinker", "talker"]
            )
            async with stream:
                async for out in stream:
                    if first:
                        ttfo.append(time.perf_counter() - t0)
                        first = False
                    got += len(out.token_ids)
            counts.append(got)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        return time.perf_counter() - t0, ttfo, all(c == 2 * tokens for c in counts)

    async def main() -> dict[str, Any]:
        async with omni_trio.open_engine(config) as engine:
            await batch(engine, "warm")
            wall, ttfo, ok = await batch(engine, "run")
            return _summary(wall, ttfo, n, ok)

    return trio.run(main)


# -- driver -------------------------------------------------------------------------------
def _child(mode: str, n: int, tokens: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--mode", mode, "--requests", str(n), "--tokens", str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"{mode} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--mode", choices=("hand", "omni"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if a.mode:
        result = (run_hand if a.mode == "hand" else run_omni)(a.requests, a.tokens)
        print("RESULT " + json.dumps(result), flush=True)
        return
    hand = _child("hand", a.requests, a.tokens)
    omni = _child("omni", a.requests, a.tokens)
    print(
        json.dumps(
            {
                "benchmark": "vllm_pipeline",
                "workload": {
                    "stages": "thinker -> talker (token hand-off)",
                    "requests": a.requests,
                    "tokens_per_stage": a.tokens,
                },
                "hand_asyncio": hand,
                "omni_trio": omni,
                "throughput_ratio": round(omni["requests_per_s"] / hand["requests_per_s"], 3),
                "ttfo_p50_overhead_ms": round(omni["ttfo_p50_ms"] - hand["ttfo_p50_ms"], 2),
                "ttfo_p99_overhead_ms": round(omni["ttfo_p99_ms"] - hand["ttfo_p99_ms"], 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
