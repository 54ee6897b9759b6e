"""Qwen3-Omni end to end: omni-trio's ``qwen3-omni`` pipeline against transformers' generate().

Both systems run on the same checkpoint (``tiny:qwen3-omni``, float32: random weights, the
real architecture), in one process, interleaved:

- ``omni``: the shipped pipeline (thinker on vLLM in its EngineCore process, talker and
  code2wav in this process with ``torch_threads: 1``), every stage's outputs streamed to the
  caller; ``omni_sequential`` runs the requests one after the other, ``omni_concurrent``
  keeps ``--concurrency`` of them in flight.
- ``hf``: ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` in a worker
  thread with torch on 1 thread. generate() serves one request at a time, so it is measured
  sequentially only, and it returns the audio at the end: its time to first audio is its
  whole time.

Workload: the chat template on a system and a user message (``PROMPTS``, each with a thinker
reply of at least 2 tokens on the tiny checkpoint), greedy on both sides (``--thinker-tokens``
thinker tokens at most, ``--talker-frames`` codec frames of 80 ms; the tiny talker never says
its codec EOS, so every request makes that much speech). Request k uses prompt
k % len(prompts). A warm-up runs every prompt once on each side; then each of ``--passes``
passes runs the three cells (``--requests`` requests each), their order rotated per pass so
slow drift on the shared machine hits all alike.

Reading the output (one JSON object on stdout; progress on stderr):

- ``cells``: per cell, ``requests_per_s`` (requests / wall of each pass: median, min, max),
  ``first_audio_s`` and ``latency_s`` (p50, p90 over every request of every pass),
  ``rtf`` (latency / seconds of audio of each request: below 1 is faster than real time),
  ``audio_s_per_wall_s`` (seconds of audio made per wall second, median over passes),
  ``cpu_s_per_request`` (omni: this process plus the thinker's EngineCore and worker; hf:
  the generate() thread) and, for hf cells, ``engine_cpu_s`` (what the idle thinker
  engine burnt meanwhile).
- ``ratios`` (above 1: omni-trio better): ``sequential_rps`` and ``concurrent_rps``
  (omni/hf requests/s, paired per pass), ``first_audio_p50`` and ``latency_p50``
  (hf/omni sequential), ``cpu_per_request`` (hf/omni).
- ``same_codes``: whether every request on both sides produced the warm-up's generate()
  thinker ids and talker codes for its prompt; ``check`` has the details (mismatches, audio
  length and the largest sample difference against generate()'s waveform). Not a failure.

    python benchmarks/bench_qwen_omni.py [--passes 3] [--requests 8] [--concurrency 4]
        [--prompts 4] [--thinker-tokens 24] [--talker-frames 40] [--stage-overrides JSON]
        [--quick]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import trio

# benchmarks/ is on sys.path (this file runs as a script)
from bench_vllm_pipeline import progress, vllm_version
from harness.vllm_procs import cpu_seconds
from harness.vllm_summary import rounded, spread

import omni_trio
from omni_trio.audio import sample_rate_of
from omni_trio.pipelines import pipeline_path

MODEL = "tiny:qwen3-omni"
SYSTEM_PROMPT = "You are a helpful assistant."
#: user messages whose greedy thinker reply on tiny:qwen3-omni has 3, 8, 24 and 9 tokens
#: ("Why is the sky blue?" has 1, too short for the talker: generate() refuses it)
PROMPTS = (
    "Tell me a story about a cat.",
    "What is the capital of France?",
    "Say hello in three languages.",
    "Give me a recipe for bread.",
)
SPEAKER = "ethan"
CELLS = ("hf_sequential", "omni_sequential", "omni_concurrent")
#: a sample that differs from generate()'s by more than this counts as different (float
#: rounding stays far below)
AUDIO_TOLERANCE = 1e-4
#: stage options that put the pipeline's torch stages on one thread, as the hf side is
ONE_THREAD = {s: {"options": {"torch_threads": 1}} for s in ("talker", "code2wav")}


@dataclass
class Reply:
    """What one request produced and how long it took."""

    prompt: int
    latency_s: float
    first_audio_s: float | None
    thinker_ids: list[int]
    codes: list[int]  # frame after frame, 16 codes each (code group 0 first)
    audio: np.ndarray
    sample_rate: int

    @property
    def audio_s(self) -> float:
        return len(self.audio) / self.sample_rate


@dataclass
class CellRun:
    """One cell of one pass: its wall time, CPU and replies."""

    cell: str
    wall_s: float
    cpu_s: dict[str, float]
    replies: list[Reply] = field(default_factory=list)


# -- pure helpers -------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def p50_p90(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90)}


def cell_order(pass_index: int) -> list[str]:
    """The cells of a pass, rotated by the pass index (each cell takes every position)."""
    k = pass_index % len(CELLS)
    return [*CELLS[k:], *CELLS[:k]]


def frames_of(codes: Any) -> list[int]:
    """generate()'s talker codes ``[1, 16, T]`` as the talker stage streams them: frame after
    frame, code group 0 first."""
    return [int(c) for c in codes[0].T.reshape(-1).tolist()]


def compare(reference: Reply, reply: Reply) -> dict[str, Any]:
    """How ``reply`` differs from the generate() ``reference`` of the same prompt: thinker
    ids, codes, audio length, the largest sample difference and, past ``AUDIO_TOLERANCE``,
    the first differing sample in seconds (None when the lengths differ or nothing does)."""
    same_length = len(reply.audio) == len(reference.audio)
    diff = np.abs(reply.audio - reference.audio) if same_length else np.zeros(0)
    off = np.flatnonzero(diff > AUDIO_TOLERANCE)
    return {
        "same_thinker_ids": reply.thinker_ids == reference.thinker_ids,
        "same_codes": reply.codes == reference.codes,
        "same_audio_length": same_length,
        "max_abs_audio_diff": float(diff.max()) if len(diff) else None,
        "first_audio_diff_s": float(off[0]) / reply.sample_rate if len(off) else None,
    }


def check_runs(references: Sequence[Reply], runs: Sequence[CellRun]) -> dict[str, Any]:
    """Every reply of ``runs`` against the reference of its prompt: whether all matched, the
    largest audio difference, the earliest differing audio, the first 10 mismatches."""
    mismatches = []
    found = [
        (k, i, compare(references[reply.prompt], reply))
        for k, run in enumerate(runs)
        for i, reply in enumerate(run.replies)
    ]
    same = {"same_thinker_ids": True, "same_codes": True, "same_audio_length": True}
    for k, i, one in found:
        wrong = [key for key in same if not one[key]]
        for key in wrong:
            same[key] = False
        if wrong:
            mismatches.append({"run": k, "cell": runs[k].cell, "request": i, "differs": wrong})

    def present(key: str) -> list[float]:
        return [one[key] for _, _, one in found if one[key] is not None]

    diffs, starts = present("max_abs_audio_diff"), present("first_audio_diff_s")
    return {
        **same,
        "requests_checked": len(found),
        "max_abs_audio_diff": max(diffs) if diffs else None,
        "audio_tolerance": AUDIO_TOLERANCE,
        "earliest_audio_diff_s": min(starts) if starts else None,
        "mismatches": mismatches[:10],
        "mismatch_count": len(mismatches),
    }


def summarize_cell(runs: Sequence[CellRun]) -> dict[str, Any]:
    """A cell's figures over its passes (see the module docstring)."""
    replies = [r for run in runs for r in run.replies]
    per_pass_rps = [len(run.replies) / run.wall_s for run in runs]
    cpu: dict[str, Any] = {}
    for key in runs[0].cpu_s:
        cpu[key] = statistics.median(run.cpu_s[key] / len(run.replies) for run in runs)
    out: dict[str, Any] = {
        "requests": len(replies),
        "requests_per_s": spread(per_pass_rps),
        "first_audio_s": p50_p90([r.first_audio_s for r in replies if r.first_audio_s is not None]),
        "latency_s": p50_p90([r.latency_s for r in replies]),
        "audio_s_per_request": statistics.median(r.audio_s for r in replies),
        "rtf": p50_p90([r.latency_s / r.audio_s for r in replies if r.audio_s]),
        "audio_s_per_wall_s": statistics.median(
            sum(r.audio_s for r in run.replies) / run.wall_s for run in runs
        ),
        "cpu_s_per_request": cpu.pop("request"),
    }
    if cpu:
        out["cpu_s_per_request_by_part"] = cpu
    return out


def paired_ratio(
    runs: Sequence[CellRun], top: str, bottom: str, key: Callable[[CellRun], float]
) -> dict[str, float] | None:
    """``key(top) / key(bottom)`` of every pass, as median, min and max."""
    by_cell: dict[str, list[CellRun]] = {}
    for run in runs:
        by_cell.setdefault(run.cell, []).append(run)
    pairs = zip(by_cell.get(top, []), by_cell.get(bottom, []), strict=True)
    return spread([key(a) / key(b) for a, b in pairs])


def ratios(cells: dict[str, dict[str, Any]], runs: Sequence[CellRun]) -> dict[str, Any]:
    """omni-trio against generate(), each above 1 when omni-trio is better."""

    def rps(run: CellRun) -> float:
        return len(run.replies) / run.wall_s

    hf, seq = cells["hf_sequential"], cells["omni_sequential"]
    return {
        "sequential_rps": paired_ratio(runs, "omni_sequential", "hf_sequential", rps),
        "concurrent_rps": paired_ratio(runs, "omni_concurrent", "hf_sequential", rps),
        "first_audio_p50": hf["first_audio_s"]["p50"] / seq["first_audio_s"]["p50"],
        "latency_p50": hf["latency_s"]["p50"] / seq["latency_s"]["p50"],
        "cpu_per_request": hf["cpu_s_per_request"] / seq["cpu_s_per_request"],
    }


# -- the two systems ----------------------------------------------------------------------
class Transformers:
    """transformers' Qwen3-Omni on the checkpoint at ``path``; records the talker codes each
    generate() hands its code2wav. Blocking: call it from a worker thread."""

    def __init__(self, path: str, thinker_tokens: int, talker_frames: int) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

        from omni_trio.models.qwen_omni.code2wav import Code2WavModule

        torch.set_num_threads(1)  # process-wide: the pipeline's torch stages ask for 1 too
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        self.sample_rate = Code2WavModule.sample_rate
        self.kwargs = {
            "return_audio": True,
            "speaker": SPEAKER,
            "thinker_do_sample": False,
            "talker_do_sample": False,
            "thinker_max_new_tokens": thinker_tokens,
            "talker_max_new_tokens": talker_frames,
            "thinker_eos_token_id": self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        }
        self._codes: Any = None
        decode = self.model.code2wav.chunked_decode

        def recording(codes: Any, *args: Any, **kwargs: Any) -> Any:
            self._codes = codes
            return decode(codes, *args, **kwargs)

        self.model.code2wav.chunked_decode = recording

    def prompt_ids(self, user: str) -> list[int]:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user},
        ]
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(encoded["input_ids"])

    def generate(self, prompt: int, ids: list[int]) -> tuple[Reply, float]:
        """One request, and the CPU seconds of this thread it took."""
        cpu0, t0 = time.thread_time(), time.perf_counter()
        sequences, wav = self.model.generate(input_ids=self.torch.tensor([ids]), **self.kwargs)
        latency = time.perf_counter() - t0
        reply = Reply(
            prompt=prompt,
            latency_s=latency,
            first_audio_s=latency,
            thinker_ids=sequences[0, len(ids) :].tolist(),
            codes=frames_of(self._codes),
            audio=wav.reshape(-1).numpy(),
            sample_rate=self.sample_rate,
        )
        return reply, time.thread_time() - cpu0


async def omni_request(
    engine: omni_trio.Engine, prompt: int, ids: list[int], sampling: dict[str, Any]
) -> Reply:
    """One request through the pipeline, every stage's outputs streamed."""
    t0 = time.perf_counter()
    first: float | None = None
    thinker: list[int] = []
    codes: list[int] = []
    chunks: list[np.ndarray] = []
    rate = 0
    async with engine.generate(
        {"prompt_token_ids": ids},
        sampling_params=sampling,
        output_stages=["thinker", "talker", "code2wav"],
    ) as stream:
        async for out in stream:
            if out.stage_id == "thinker":
                thinker.extend(out.token_ids)
            elif out.stage_id == "talker":
                codes.extend(out.token_ids)
            elif out.data is not None and len(out.data):  # type: ignore[arg-type]
                if first is None:
                    first = time.perf_counter() - t0
                rate = sample_rate_of(out.metrics)
                chunks.append(np.asarray(out.data, dtype=np.float32))
    return Reply(
        prompt=prompt,
        latency_s=time.perf_counter() - t0,
        first_audio_s=first,
        thinker_ids=thinker,
        codes=codes,
        audio=np.concatenate(chunks) if chunks else np.zeros(0, np.float32),
        sample_rate=rate or 1,
    )


# -- the run ------------------------------------------------------------------------------
class Bench:
    def __init__(self, a: argparse.Namespace, hf: Transformers, prompts: list[list[int]]) -> None:
        self.a = a
        self.hf = hf
        self.prompts = prompts
        self.sampling = {
            "thinker": {"max_tokens": a.thinker_tokens, "temperature": 0.0},
            "talker": {"temperature": 0.0, "max_tokens": a.talker_frames},
        }
        self.engine_pids: list[int] = []

    def engine_cpu(self) -> float:
        return cpu_seconds(self.engine_pids)

    async def hf_one(self, k: int) -> tuple[Reply, float]:
        prompt = k % len(self.prompts)
        return await trio.to_thread.run_sync(self.hf.generate, prompt, self.prompts[prompt])

    async def omni_one(self, engine: omni_trio.Engine, k: int) -> Reply:
        prompt = k % len(self.prompts)
        return await omni_request(engine, prompt, self.prompts[prompt], self.sampling)

    async def run_cell(self, engine: omni_trio.Engine, cell: str) -> CellRun:
        n = self.a.requests
        replies: list[Reply] = []
        hf_cpu = 0.0
        engine0, process0, t0 = self.engine_cpu(), time.process_time(), time.perf_counter()
        if cell == "hf_sequential":
            for k in range(n):
                reply, cpu = await self.hf_one(k)
                replies.append(reply)
                hf_cpu += cpu
        elif cell == "omni_sequential":
            for k in range(n):
                replies.append(await self.omni_one(engine, k))
        else:
            await self.concurrently(engine, n, replies)
        wall = time.perf_counter() - t0
        engine_s, process_s = self.engine_cpu() - engine0, time.process_time() - process0
        if cell == "hf_sequential":
            cpu = {"request": hf_cpu, "engine_idle": engine_s}
        else:
            cpu = {"request": engine_s + process_s, "frontend": process_s, "thinker": engine_s}
        return CellRun(cell, wall, cpu, replies)

    async def concurrently(self, engine: omni_trio.Engine, n: int, replies: list[Reply]) -> None:
        """``n`` requests with ``--concurrency`` in flight: each worker takes the next index."""
        indices = iter(range(n))
        done: dict[int, Reply] = {}

        async def worker() -> None:
            for k in indices:
                done[k] = await self.omni_one(engine, k)

        async with trio.open_nursery() as nursery:
            for _ in range(self.a.concurrency):
                nursery.start_soon(worker)
        replies.extend(done[k] for k in range(n))

    async def warm_up(self, engine: omni_trio.Engine) -> list[Reply]:
        """Every prompt once on each side; generate()'s replies are the references."""
        references = []
        for k in range(len(self.prompts)):
            reference, _ = await self.hf_one(k)
            if len(reference.thinker_ids) < 2:
                raise SystemExit(
                    f"prompt {k} ({PROMPTS[k]!r}): generate()'s thinker reply has "
                    f"{len(reference.thinker_ids)} token(s); the talker needs at least 2"
                )
            references.append(reference)
            await self.omni_one(engine, k)
        return references


async def run(a: argparse.Namespace) -> dict[str, Any]:
    from omni_trio.models.tiny import model_fingerprint, resolve_model

    path = await trio.to_thread.run_sync(resolve_model, MODEL)
    progress(f"loading transformers' model from {MODEL}")
    hf = await trio.to_thread.run_sync(Transformers, path, a.thinker_tokens, a.talker_frames)
    prompts = [hf.prompt_ids(p) for p in PROMPTS[: a.prompts]]
    bench = Bench(a, hf, prompts)
    cfg = omni_trio.load_config(str(pipeline_path("qwen3-omni")), stage_overrides=ONE_THREAD)
    if a.stage_overrides:
        cfg = omni_trio.load_config(cfg, stage_overrides=a.stage_overrides)
    progress("opening the omni-trio engine")
    t0 = time.perf_counter()
    async with omni_trio.open_engine(cfg) as engine:
        open_s = time.perf_counter() - t0
        bench.engine_pids = [p.pid for p in psutil.Process().children(recursive=True)]
        progress(f"engine open in {open_s:.1f} s; warming up")
        references = await bench.warm_up(engine)
        runs: list[CellRun] = []
        for p in range(a.passes):
            for cell in cell_order(p):
                run_ = await bench.run_cell(engine, cell)
                runs.append(run_)
                progress(
                    f"pass {p + 1}/{a.passes} {cell}: {len(run_.replies) / run_.wall_s:.2f} req/s"
                )
    cells = {c: summarize_cell([r for r in runs if r.cell == c]) for c in CELLS}
    check = check_runs(references, runs)
    return {
        "benchmark": "qwen_omni",
        "workload": {
            "model": MODEL,
            "model_fingerprint": model_fingerprint(path),
            "dtype": "float32",
            "prompts": [
                {"user": text, "prompt_tokens": len(ids), "reply_tokens": len(ref.thinker_ids)}
                for text, ids, ref in zip(PROMPTS, prompts, references, strict=False)
            ],
            "sampling": "greedy on both sides",
            "thinker_max_tokens": a.thinker_tokens,
            "talker_max_frames": a.talker_frames,
            "speaker": SPEAKER,
            "requests_per_cell": a.requests,
            "concurrency": a.concurrency,
            "passes": a.passes,
            "torch_threads": 1,
            "stage_overrides": a.stage_overrides,
            "hf": "generate(return_audio=True) in a worker thread, one request at a time "
            "(sequential only); its audio arrives at the end: first audio = whole time",
            "omni": "the qwen3-omni pipeline; thinker on vLLM (EngineCore process, vLLM's "
            "default CPU binding), talker and code2wav in this process; all stages streamed",
            "engine_open_s": open_s,
            "versions": {
                "vllm": vllm_version(),
                "torch": importlib.metadata.version("torch"),
                "transformers": importlib.metadata.version("transformers"),
            },
        },
        "same_codes": check["same_thinker_ids"] and check["same_codes"],
        "cells": cells,
        "ratios": ratios(cells, runs),
        "check": check,
        "passes": [{"cell": r.cell, "wall_s": r.wall_s, "cpu_s": r.cpu_s} for r in runs],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8, help="requests per cell and pass")
    ap.add_argument("--concurrency", type=int, default=4, help="omni_concurrent's in flight")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, 5))
    ap.add_argument("--thinker-tokens", type=int, default=24)
    ap.add_argument("--talker-frames", type=int, default=40)
    ap.add_argument(
        "--stage-overrides",
        default=None,
        help='JSON deep-merged into the pipeline\'s stages, e.g. \'{"talker": {"options": '
        '{"max_concurrency": 2}}}\'',
    )
    ap.add_argument("--quick", action="store_true", help="1 pass, 2 prompts, 2 requests of each")
    a = ap.parse_args(argv)
    if a.quick:
        a.passes, a.requests, a.concurrency, a.prompts = 1, 2, 2, 2
    return a


def print_report(
    run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]], a: argparse.Namespace
) -> None:
    """``run(a)`` under trio (it may start vLLM engines), its report printed as rounded JSON."""
    # vLLM logs to stdout by default, where the JSON goes; its EngineCore inherits this
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    report = trio.run(run, a)
    print(json.dumps(rounded(report), indent=2))


def main() -> None:
    print_report(run, parse_args())


if __name__ == "__main__":
    main()
