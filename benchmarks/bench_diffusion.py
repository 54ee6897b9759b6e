"""Diffusion stages: omni-trio's ``diffusion`` backend against diffusers' own pipeline call.

Both systems run the same checkpoint (``tiny:diffusion``: a Stable-Diffusion-shaped UNet,
VAE and CLIP text encoder with random weights, DDIM, float32) in one process, torch on
``--torch-threads`` threads (process-wide: the same for both), every call in a worker thread.
Request k has prompt k % len(PROMPTS) and seed k, ``--steps`` steps at ``--size`` square,
guidance ``--guidance`` (classifier-free, against the empty negative prompt).

1. Throughput (``cells``): for each concurrency c of ``--concurrency``, ``--images`` images
   by each system, the systems in an order rotated per pass, ``--passes`` passes:

   - ``diffusers``: ``DiffusionPipeline.from_pretrained(dir)`` called with c prompts per call
     (a list of prompts and a generator per prompt, what a user of diffusers batches), the
     calls one after the other; at c = 1 one prompt per call;
   - ``omni_request`` / ``omni_step``: an engine on the shipped ``tiny-image`` pipeline (one
     diffusion stage, ``execution: request`` / ``step``, ``max_batch_size``
     ``--max-batch-size``) with c requests in flight (a worker takes the next request as its
     last one ends).

   Per system: images per second (median, min, max over passes), process CPU seconds per
   image and per wall second (below 1 with one torch thread: the process waited for a core,
   the machine was shared), and for the engines the mean batch (requests per denoise step).
   ``ratios``: each engine's images/s over diffusers' in the same cell and pass (above 1:
   omni-trio faster), step over request, each system over its own c = 1 rate (what
   concurrency buys), and each engine's CPU per image over diffusers' (above 1: omni-trio
   costlier; steadier than wall time on a shared machine). ``check``: every image against
   diffusers' own call for that prompt and seed alone (the warm-up's), the largest
   difference in uint8 pixel values per system.

2. Abort latency (``abort``): a victim request of ``--abort-steps`` steps and a neighbour of
   the same shape start together; after a delay drawn uniformly from 10-70% of the pair's
   unaborted run time (the fastest of 3 runs first; seeded), ``engine.abort(victim)``, wherever the
   victim is in its step. ``to_ended_ms``: from the abort call to the victim's stream ending
   (its ``finish_reason="abort"`` output), ``to_return_ms``: to ``abort()`` returning;
   p50/p99. A victim that ended before its abort is counted in ``ended_before_abort``, not
   timed. ``victim_steps``: the steps the victim ran, the one running at the abort included
   (it finishes in its thread, its latents dropped after; from the stage's step counters,
   ``collective_rpc("describe")`` before and after the trial); ``shared``: trials where the
   victim never stepped without the neighbour; ``neighbour_max_diff``: the neighbour's
   image against diffusers' call alone. The sides alternate trial by trial: the two modes,
   and ``diffusers_interrupt``: a lone pipeline call whose ``_interrupt`` flag is set after
   the delay (diffusers' own way to stop a call: the loop skips its remaining steps, the VAE
   decodes what it has and the call returns; it stops the whole batch, so no neighbour),
   from setting the flag to the call's return. ``ratios_to_ended_p50``: diffusers' p50 over
   each mode's (above 1: omni-trio's aborted request ends sooner).

Timings are wall (``perf_counter``) and process CPU; nothing is asserted on them. Every wait
on an engine or a diffusers call is bounded by ``--bound-s``. Run it alone on the machine.

    python benchmarks/bench_diffusion.py [--passes 5] [--images 16] [--concurrency 1,4,8]
        [--steps 20] [--size 64] [--guidance 7.5] [--torch-threads 1] [--max-batch-size 8]
        [--abort-runs 20] [--abort-steps 50] [--seed 0] [--bound-s 300] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

# benchmarks/ is on sys.path (this file runs as a script)
from bench_qwen_omni import print_report
from bench_sessions import p50_p99_ms, rotated
from bench_vllm_pipeline import csv, progress
from harness.vllm_summary import spread

import omni_trio
from omni_trio.pipelines import pipeline_path

MODEL = "tiny:diffusion"
PROMPTS = (
    "a red house by the sea",
    "a cat asleep on a piano",
    "mountains at dawn, oil painting",
    "a bowl of lemons",
)
SYSTEMS = ("diffusers", "omni_request", "omni_step")
ENGINES = {"omni_request": "request", "omni_step": "step"}
ABORT_SIDES = ("omni_request", "omni_step", "diffusers_interrupt")
#: the neighbour of every abort trial (the victim is request 0)
NEIGHBOUR = 1


# -- pure helpers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """Request k of the workload: its prompt and seed."""

    index: int
    prompt: str
    seed: int


def job(k: int) -> Job:
    return Job(k, PROMPTS[k % len(PROMPTS)], k)


def chunks(items: Sequence[Any], size: int) -> Iterator[list[Any]]:
    """``items`` in consecutive lists of ``size`` (the last may be shorter)."""
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    """The largest difference between two uint8 images of the same shape."""
    if a.shape != b.shape:
        raise ValueError(f"images of different shapes {a.shape} and {b.shape}")
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@dataclass
class CellRun:
    """One system on one cell (a concurrency) in one pass."""

    system: str
    concurrency: int
    wall_s: float
    cpu_s: float
    images: dict[int, np.ndarray] = field(default_factory=dict)  # by request index
    ticks: int = 0  # the stage's denoise steps (one forward each)
    rows: int = 0  # request-steps in them

    @property
    def images_per_s(self) -> float:
        return len(self.images) / self.wall_s


def summarize_cell(runs: Sequence[CellRun]) -> dict[str, Any]:
    """One system's figures on one cell over its passes."""
    out: dict[str, Any] = {
        "images": sum(len(r.images) for r in runs),
        "images_per_s": spread([r.images_per_s for r in runs]),
        "cpu_s_per_image": statistics.median(cpu_per_image(r) for r in runs),
        # below 1 (one torch thread): the process waited for a core
        "cpu_per_wall": statistics.median(r.cpu_s / r.wall_s for r in runs),
    }
    if any(r.ticks for r in runs):
        out["mean_batch"] = sum(r.rows for r in runs) / sum(r.ticks for r in runs)
    return out


def paired(
    runs: Sequence[CellRun],
    top: str,
    bottom: str,
    c: int,
    c_bottom: int | None = None,
    key: Callable[[CellRun], float] | None = None,
) -> dict[str, float] | None:
    """``key`` (default images/s) of ``top`` over ``bottom``'s (at concurrency ``c_bottom``,
    default ``c``), pass by pass (the k-th run of each), as median, min and max."""
    key = key or (lambda run: run.images_per_s)
    tops = [r for r in runs if r.system == top and r.concurrency == c]
    bottoms = [r for r in runs if r.system == bottom and r.concurrency == (c_bottom or c)]
    return spread([key(t) / key(b) for t, b in zip(tops, bottoms, strict=True)])


def cpu_per_image(run: CellRun) -> float:
    return run.cpu_s / len(run.images)


def cells_report(runs: Sequence[CellRun], concurrency: Sequence[int]) -> dict[str, Any]:
    """Per concurrency: each system's figures and the ratios (see the module docstring)."""
    report: dict[str, Any] = {}
    for c in concurrency:
        systems = {
            s: summarize_cell([r for r in runs if r.system == s and r.concurrency == c])
            for s in SYSTEMS
        }
        ratios: dict[str, Any] = {
            "omni_request_vs_diffusers": paired(runs, "omni_request", "diffusers", c),
            "omni_step_vs_diffusers": paired(runs, "omni_step", "diffusers", c),
            "step_vs_request": paired(runs, "omni_step", "omni_request", c),
            "omni_request_cpu_vs_diffusers": paired(
                runs, "omni_request", "diffusers", c, key=cpu_per_image
            ),
            "omni_step_cpu_vs_diffusers": paired(
                runs, "omni_step", "diffusers", c, key=cpu_per_image
            ),
        }
        base = concurrency[0]
        if c != base:
            for s in SYSTEMS:
                ratios[f"{s}_vs_its_c{base}"] = paired(runs, s, s, c, base)
        report[f"c={c}"] = {"concurrency": c, "systems": systems, "ratios": ratios}
    return report


def check_images(references: Mapping[int, np.ndarray], runs: Sequence[CellRun]) -> dict[str, Any]:
    """Each system's largest pixel difference from diffusers' call alone."""
    worst: dict[str, int] = {}
    checked = 0
    for run in runs:
        for k, image in run.images.items():
            worst[run.system] = max(worst.get(run.system, 0), max_diff(image, references[k]))
            checked += 1
    return {"images_checked": checked, "max_abs_diff_uint8": worst}


@dataclass
class Cut:
    """One abort trial."""

    side: str
    delay_s: float
    to_ended_s: float
    to_return_s: float | None = None  # the engines' abort() call
    victim_steps: int = 0
    shared: bool | None = None  # the victim never stepped without the neighbour
    neighbour_max_diff: int | None = None
    missed: bool = False  # the victim ended before its abort: no latency


def cut_summary(all_cuts: Sequence[Cut]) -> dict[str, Any]:
    """A side's trials (those whose victim ended before its abort only counted)."""
    cuts = [c for c in all_cuts if not c.missed]
    out: dict[str, Any] = {
        "runs": len(cuts),
        "ended_before_abort": len(all_cuts) - len(cuts),
        "delay_s": spread([c.delay_s for c in cuts]),
        "to_ended_ms": p50_p99_ms([c.to_ended_s for c in cuts]),
        "victim_steps": spread([c.victim_steps for c in cuts]),
    }
    # what only the engines' trials have (None on diffusers' side)
    for key, name, summary in (
        ("to_return_ms", "to_return_s", p50_p99_ms),
        ("shared", "shared", sum),
        ("neighbour_max_diff", "neighbour_max_diff", max),
    ):
        values = [v for c in cuts if (v := getattr(c, name)) is not None]
        if values:
            out[key] = summary(values)
    return out


def abort_report(cuts: Sequence[Cut]) -> dict[str, Any]:
    """Each side's summary, and diffusers' p50 over each mode's (above 1: omni-trio's
    abort ends the request sooner)."""
    sides = {s: cut_summary([c for c in cuts if c.side == s]) for s in ABORT_SIDES}
    theirs = sides["diffusers_interrupt"]["to_ended_ms"]["p50"]
    ratios = {}
    for side in ENGINES:
        ours = sides[side]["to_ended_ms"]["p50"]
        ratios[f"diffusers_interrupt_over_{side}"] = theirs / ours if ours else None
    return {**sides, "ratios_to_ended_p50": ratios}


# -- the two systems ------------------------------------------------------------------------
class Diffusers:
    """diffusers' own pipeline call on the checkpoint at ``path``. Blocking: call it from a
    worker thread."""

    def __init__(self, path: str, a: argparse.Namespace) -> None:
        import torch
        from diffusers import DiffusionPipeline

        self.torch = torch
        self.pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.size, self.guidance = a.size, a.guidance

    def call(self, jobs: Sequence[Job], steps: int, **kwargs: Any) -> np.ndarray:
        """One call on every job's prompt (a generator seeded per prompt, as diffusers draws
        each prompt's latents from its own): uint8 images ``(len(jobs), H, W, 3)``, rounded
        as diffusers rounds to PIL."""
        out = self.pipe(
            [j.prompt for j in jobs],
            num_inference_steps=steps,
            guidance_scale=self.guidance,
            height=self.size,
            width=self.size,
            generator=[self.torch.Generator().manual_seed(j.seed) for j in jobs],
            output_type="np",
            **kwargs,
        ).images
        images: np.ndarray = (out * 255).round().astype(np.uint8)
        return images

    def counted_call(self, one: Job, steps: int) -> tuple[np.ndarray, int]:
        """:meth:`call` on one job, and the denoise steps it ran (an interrupt skips the rest)."""
        ran = [0]

        def count(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            ran[0] += 1
            return kwargs

        return self.call([one], steps, callback_on_step_end=count), ran[0]


def params(a: argparse.Namespace, one: Job, steps: int) -> dict[str, Any]:
    """The engine's sampling params for ``one`` (diffusers' call names)."""
    return {
        "num_inference_steps": steps,
        "guidance_scale": a.guidance,
        "seed": one.seed,
        "height": a.size,
        "width": a.size,
    }


async def describe(engine: omni_trio.Engine) -> dict[str, Any]:
    (reply,) = await engine.collective_rpc("describe", stage_ids=["image"])
    assert isinstance(reply, dict)
    return reply


async def omni_image(
    engine: omni_trio.Engine, a: argparse.Namespace, one: Job, steps: int
) -> np.ndarray:
    """One request read to its end: its image (uint8, 1 x H x W x 3)."""
    async with engine.generate(one.prompt, sampling_params=params(a, one, steps)) as stream:
        outs = [out async for out in stream]
    final = outs[-1]
    if not final.finished or final.finish_reason != "stop":
        raise RuntimeError(f"request {one.index} ended {final.finish_reason!r}, not 'stop'")
    image: np.ndarray = final.data  # type: ignore[assignment]
    return image


# -- throughput -----------------------------------------------------------------------------
class Bench:
    def __init__(
        self, a: argparse.Namespace, hf: Diffusers, engines: Mapping[str, omni_trio.Engine]
    ) -> None:
        self.a = a
        self.hf = hf
        self.engines = engines

    async def hf_call(self, jobs: Sequence[Job], steps: int) -> np.ndarray:
        with trio.fail_after(self.a.bound_s):
            images: np.ndarray = await trio.to_thread.run_sync(
                self.hf.call, jobs, steps, abandon_on_cancel=True
            )
        return images

    async def run_cell(self, system: str, c: int) -> CellRun:
        jobs = [job(k) for k in range(self.a.images)]
        images: dict[int, np.ndarray] = {}
        engine = self.engines.get(system)
        before = await describe(engine) if engine is not None else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        if engine is None:
            for batch in chunks(jobs, c):
                made = await self.hf_call(batch, self.a.steps)
                images.update((j.index, made[i : i + 1]) for i, j in enumerate(batch))
        else:
            await self.in_flight(engine, jobs, c, images)
        run = CellRun(system, c, time.perf_counter() - t0, time.process_time() - cpu0, images)
        if engine is not None and before is not None:
            after = await describe(engine)
            run.ticks = after["steps"] - before["steps"]
            run.rows = after["request_steps"] - before["request_steps"]
        return run

    async def in_flight(
        self, engine: omni_trio.Engine, jobs: Sequence[Job], c: int, images: dict[int, np.ndarray]
    ) -> None:
        """Every job through ``engine`` with ``c`` in flight: each worker takes the next."""
        todo = iter(jobs)

        async def worker() -> None:
            for one in todo:
                images[one.index] = await omni_image(engine, self.a, one, self.a.steps)

        with trio.fail_after(self.a.bound_s):
            async with trio.open_nursery() as nursery:
                for _ in range(c):
                    nursery.start_soon(worker)

    # -- abort latency ----------------------------------------------------------------------
    async def omni_pair(self, engine: omni_trio.Engine, tag: str, delay: float | None) -> Cut:
        """The victim and its neighbour, the victim aborted after ``delay`` seconds (None:
        not aborted, the pair's run time is ``to_ended_s``)."""
        steps = self.a.abort_steps
        victim, neighbour = job(0), job(NEIGHBOUR)
        ends: dict[str, float] = {}
        finals: dict[str, Any] = {}

        async def read(key: str, one: Job) -> None:
            async with engine.generate(
                one.prompt, request_id=f"{tag}-{key}", sampling_params=params(self.a, one, steps)
            ) as stream:
                async for out in stream:
                    if out.finished:
                        finals[key] = out
            ends[key] = time.perf_counter()

        before = await describe(engine)
        with trio.fail_after(self.a.bound_s):
            async with trio.open_nursery() as nursery:
                t0 = time.perf_counter()
                nursery.start_soon(read, "neighbour", neighbour)
                nursery.start_soon(read, "victim", victim)
                if delay is not None:
                    await trio.sleep(delay)
                    t_abort = time.perf_counter()
                    await engine.abort(f"{tag}-victim")
                    t_return = time.perf_counter()
        after = await describe(engine)
        ticks, rows = (
            after["steps"] - before["steps"],
            after["request_steps"] - before["request_steps"],
        )
        if finals["neighbour"].finish_reason != "stop":
            raise RuntimeError(f"{tag}: the neighbour ended {finals['neighbour'].finish_reason!r}")
        reference = self.abort_references[NEIGHBOUR]
        cut = Cut(
            side="",
            delay_s=0.0,
            to_ended_s=max(ends.values()) - t0,
            victim_steps=rows - steps,
            shared=ticks == steps,
            neighbour_max_diff=max_diff(finals["neighbour"].data, reference),
        )
        if delay is None:
            return cut
        cut.delay_s = delay
        if finals["victim"].finish_reason == "stop":  # the machine ran faster than measured
            cut.missed = True
            return cut
        if finals["victim"].finish_reason != "abort":
            raise RuntimeError(f"{tag}: the victim ended {finals['victim'].finish_reason!r}")
        cut.delay_s, cut.to_ended_s, cut.to_return_s = (
            delay,
            ends["victim"] - t_abort,
            t_return - t_abort,
        )
        return cut

    async def hf_interrupted(self, delay: float | None) -> Cut:
        """The victim alone in diffusers' call, its ``_interrupt`` set after ``delay`` (None:
        not interrupted, the call's time is ``to_ended_s``)."""
        victim, steps = job(0), self.a.abort_steps
        result: list[tuple[np.ndarray, int]] = []

        async def call() -> None:
            result.append(
                await trio.to_thread.run_sync(
                    self.hf.counted_call, victim, steps, abandon_on_cancel=True
                )
            )

        with trio.fail_after(self.a.bound_s):
            async with trio.open_nursery() as nursery:
                t0 = time.perf_counter()
                nursery.start_soon(call)
                if delay is not None:
                    await trio.sleep(delay)
                    t0 = time.perf_counter()
                    self.hf.pipe._interrupt = True  # what a step-end callback would set
        ended = time.perf_counter()
        _, ran = result[0]
        missed = delay is not None and ran >= steps  # it ended before its interrupt
        return Cut("diffusers_interrupt", delay or 0.0, ended - t0, victim_steps=ran, missed=missed)

    async def abort_trials(self) -> dict[str, Any]:
        steps = self.a.abort_steps
        self.abort_references = {k: await self.hf_call([job(k)], steps) for k in (0, NEIGHBOUR)}
        # each side's unaborted run time, the fastest of 3 (a shared machine slows some): the
        # delays are drawn from 10-70% of it
        span: dict[str, float] = {}
        for k in range(3):
            for side in ABORT_SIDES:
                engine = self.engines.get(side)
                if engine is None:
                    full = await self.hf_interrupted(None)
                else:
                    full = await self.omni_pair(engine, f"{side}-full-{k}", None)
                span[side] = min(span.get(side, math.inf), full.to_ended_s)
        rng = random.Random(self.a.seed)
        cuts: list[Cut] = []
        for k in range(self.a.abort_runs):
            for side in rotated(ABORT_SIDES, k):
                delay = span[side] * rng.uniform(0.1, 0.7)
                if side in ENGINES:
                    cut = await self.omni_pair(self.engines[side], f"{side}-{k}", delay)
                    cut.side = side
                else:
                    cut = await self.hf_interrupted(delay)
                cuts.append(cut)
        return {"unaborted_s": span, **abort_report(cuts)}


# -- the run --------------------------------------------------------------------------------
def engine_config(a: argparse.Namespace, execution: str) -> omni_trio.PipelineConfig:
    """The shipped ``tiny-image`` pipeline in ``execution`` mode."""
    options = {
        "execution": execution,
        "max_batch_size": a.max_batch_size,
        "torch_threads": a.torch_threads,
    }
    return omni_trio.load_config(
        str(pipeline_path("tiny-image")), stage_overrides={"image": {"options": options}}
    )


def worker_threads() -> int:
    import torch

    return int(torch.get_num_threads())


async def leftovers(engine: omni_trio.Engine) -> dict[str, int]:
    """What an engine still holds: requests in flight, the stage's running and waiting."""
    d = await describe(engine)
    return {
        "requests_in_flight": engine.statistics().requests_in_flight,
        "running": d["running"],
        "waiting": d["waiting"],
    }


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from omni_trio.models.tiny import model_fingerprint, resolve_model

    torch.set_num_threads(a.torch_threads)  # process-wide; the stages ask for the same
    path = await trio.to_thread.run_sync(resolve_model, MODEL)
    progress(f"loading diffusers' pipeline from {MODEL}")
    hf = await trio.to_thread.run_sync(Diffusers, path, a)
    async with (
        omni_trio.open_engine(engine_config(a, "request")) as by_request,
        omni_trio.open_engine(engine_config(a, "step")) as by_step,
    ):
        bench = Bench(a, hf, {"omni_request": by_request, "omni_step": by_step})
        progress("warming up: diffusers' call alone on every request (the references)")
        references = {}
        for k in range(a.images):
            references[k] = await bench.hf_call([job(k)], a.steps)
        for system in SYSTEMS:
            await bench.run_cell(system, max(a.concurrency))
        runs: list[CellRun] = []
        for p in range(a.passes):
            for c in a.concurrency:
                for system in rotated(SYSTEMS, p):
                    one = await bench.run_cell(system, c)
                    runs.append(one)
                    progress(
                        f"pass {p + 1}/{a.passes} c={c} {system}: {one.images_per_s:.2f} img/s"
                    )
        progress(f"abort latency: {a.abort_runs} trials a side")
        aborts = await bench.abort_trials()
        left = {side: await leftovers(engine) for side, engine in bench.engines.items()}
        model = (await describe(by_step)).get("parameters")
    return {
        "benchmark": "diffusion",
        "workload": {
            "model": MODEL,
            "model_fingerprint": model_fingerprint(path),
            "parameters": model,
            "dtype": "float32",
            "prompts": list(PROMPTS),
            "seeds": "request k: seed k, prompt k % len(prompts)",
            "size": f"{a.size}x{a.size}",
            "steps": a.steps,
            "guidance_scale": a.guidance,
            "images_per_cell": a.images,
            "concurrency": a.concurrency,
            "passes": a.passes,
            "torch_threads": a.torch_threads,
            "torch_threads_in_a_worker_thread": await trio.to_thread.run_sync(worker_threads),
            "max_batch_size": a.max_batch_size,
            "diffusers": "DiffusionPipeline.from_pretrained(dir) called with c prompts a call "
            "(a generator per prompt), one call after the other, in a worker thread",
            "omni": "the tiny-image pipeline (one diffusion stage), c requests in flight",
            "abort_runs": a.abort_runs,
            "abort_steps": a.abort_steps,
            "versions": {
                "torch": importlib.metadata.version("torch"),
                "diffusers": importlib.metadata.version("diffusers"),
                "trio": trio.__version__,
            },
        },
        "cells": cells_report(runs, a.concurrency),
        "check": check_images(references, runs),
        "abort": aborts,
        "left_after_run": left,
        "passes": [
            {"system": r.system, "concurrency": r.concurrency, "wall_s": r.wall_s} for r in runs
        ],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--images", type=int, default=16, help="images per system, cell and pass")
    ap.add_argument("--concurrency", type=csv(int), default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", type=int, default=64, help="height and width (multiple of 8)")
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--abort-runs", type=int, default=20, help="abort trials a side")
    ap.add_argument("--abort-steps", type=int, default=50, help="the abort trials' steps")
    ap.add_argument("--seed", type=int, default=0, help="the abort delays' random seed")
    ap.add_argument("--bound-s", type=float, default=300.0, help="bound on each wait")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke runs)")
    a = ap.parse_args(argv)
    if a.quick:
        a.passes, a.images, a.concurrency, a.abort_runs, a.abort_steps = 1, 4, [1, 4], 3, 20
    if a.size % 8:
        ap.error(f"--size must be a multiple of 8, not {a.size}")
    return a


if __name__ == "__main__":
    print_report(run, parse_args())
