"""The torch backend with the tiny vocoder: dynamic batching and streamed decoding.

In one run, on the same machine and module:

- ``batching``: N concurrent requests x C codes through ``TorchBackend.run_request`` with
  ``max_batch_size`` 1 (no batching) and larger sizes; reports requests/s, seconds of audio
  made per wall second, batches run, and each size's throughput ratio to size 1;
- ``streaming``: one request whose codes arrive at a talker-like pace (``--code-interval``
  seconds per code), with ``stream_input`` (a chunk every ``chunk_size`` codes) and without
  (decode once at the end); reports time to first audio and to the last sample, and the ratio.

Prints one JSON object.

    python benchmarks/bench_torch.py [--requests 32] [--codes 64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import trio

from omni_trio.backends.torch.backend import TorchBackend
from omni_trio.config import StageConfig
from omni_trio.outputs import StageInput, StageOutput


def backend(cache_dir: str, *, stream_input: bool = False, **options: Any) -> TorchBackend:
    opts = {"weights": "tiny:code2wav", "cache_dir": cache_dir, **options}
    cfg = StageConfig(id="code2wav", backend="torch", stream_input=stream_input, options=opts)
    return TorchBackend(cfg, stage_index=0)


async def one_request(b: TorchBackend, rid: str, codes: list[int]) -> list[StageOutput]:
    send, receive = trio.open_memory_channel[StageInput](1)
    send.send_nowait(StageInput(token_ids=tuple(codes)))
    send.close()
    outs: list[StageOutput] = []

    async def emit(out: StageOutput) -> None:
        outs.append(out)

    await b.run_request(rid, receive, None, emit)
    return outs


async def bench_batching(cache_dir: str, sizes: list[int], n: int, n_codes: int) -> dict:
    results: dict[str, Any] = {}
    for size in sizes:
        b = backend(cache_dir, max_batch_size=size, max_batch_delay_s=0.005)
        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve)
            await one_request(b, "warmup", [1] * n_codes)
            started = time.perf_counter()
            async with trio.open_nursery() as requests:
                for i in range(n):
                    codes = [(i * 31 + k * 7) % 512 for k in range(n_codes)]
                    requests.start_soon(one_request, b, f"r{i}", codes)
            wall = time.perf_counter() - started
            stats = b.batching_statistics()
            nursery.cancel_scope.cancel()
        results[f"max_batch_size={size}"] = {
            "wall_s": round(wall, 4),
            "requests_per_s": round(n / wall, 1),
            "audio_s_per_wall_s": round(n * n_codes * 160 / 16_000 / wall, 1),
            "batches_run": stats.batches_run - 1,  # minus the warm-up
            "largest_batch": stats.largest_batch,
        }
    base = results[f"max_batch_size={sizes[0]}"]["wall_s"]
    for size in sizes:
        entry = results[f"max_batch_size={size}"]
        entry["speedup_vs_size_1"] = round(base / entry["wall_s"], 2)
    return results


async def paced_request(b: TorchBackend, codes: list[int], interval: float) -> dict[str, float]:
    send, receive = trio.open_memory_channel[StageInput](len(codes))
    first: list[float] = []
    started = time.perf_counter()

    async def emit(out: StageOutput) -> None:
        if not first and out.data is not None and len(out.data):
            first.append(time.perf_counter() - started)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.run_request, "paced", receive, None, emit)
        for k, code in enumerate(codes):
            await trio.sleep(interval)  # the talker's pace
            await send.send(StageInput(token_ids=(code,), final=k == len(codes) - 1))
    return {"first_audio_s": round(first[0], 4), "last_audio_s": time.perf_counter() - started}


async def bench_streaming(cache_dir: str, n_codes: int, interval: float, chunk: int) -> dict:
    out: dict[str, Any] = {}
    codes = [(k * 13) % 512 for k in range(n_codes)]
    for name, stream in (("streamed", True), ("one_shot", False)):
        b = backend(cache_dir, stream_input=stream, chunk_size=chunk, max_batch_delay_s=0)
        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve)
            await one_request(b, "warmup", codes[:chunk])
            timing = await paced_request(b, codes, interval)
            nursery.cancel_scope.cancel()
        out[name] = {k: round(v, 4) for k, v in timing.items()}
    out["first_audio_ratio_one_shot_over_streamed"] = round(
        out["one_shot"]["first_audio_s"] / out["streamed"]["first_audio_s"], 2
    )
    return out


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        sizes = [1, 4] if args.quick else [1, 4, 8]
        n = 8 if args.quick else args.requests
        return {
            "benchmark": "torch_backend",
            "workload": {"requests": n, "codes": args.codes, "code_interval_s": args.code_interval},
            "batching": await bench_batching(cache_dir, sizes, n, args.codes),
            "streaming": await bench_streaming(
                cache_dir, args.codes, args.code_interval, args.chunk_size
            ),
        }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--codes", type=int, default=64)
    parser.add_argument("--code-interval", type=float, default=0.005)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(trio.run(main, parser.parse_args()), indent=2))
