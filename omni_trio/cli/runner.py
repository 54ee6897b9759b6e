"""Running prompts through an engine for the command line: stream text, save audio and images,
time stages.

Used by ``omni-trio demo`` and ``omni-trio run``; nothing here knows argparse. Also how a
CONFIG argument names a file or a shipped pipeline (:func:`resolve_config_arg`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import trio

from ..audio import concat_audio, sample_rate_of, write_wav
from ..config.pipeline import PipelineConfig
from ..config.stageinfo import audio_stage, image_stage, text_stage
from ..errors import ConfigError
from ..images import is_preview, output_images, write_png
from ..observer import EngineObserver
from ..pipelines import PIPELINES, pipeline_path
from ..pipelines.diffusers_dir import MODEL_INDEX, diffusion_pipeline, is_diffusers_dir

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..outputs import EngineStatistics, OmniOutput

__all__ = [
    "RunSummary",
    "StageTimer",
    "config_source",
    "format_init_table",
    "format_stage_times",
    "format_statistics",
    "resolve_config_arg",
    "run_prompts",
]


def resolve_config_arg(arg: str) -> str:
    """A CONFIG argument -> a config file path: an existing file, or a shipped pipeline's
    name (:data:`omni_trio.pipelines.PIPELINES`). Raises ConfigError naming what was looked
    for."""
    if Path(arg).is_file():
        return arg
    if "/" not in arg and arg in PIPELINES:
        return str(pipeline_path(arg))
    if Path(arg).is_dir():
        raise ConfigError(
            f"a directory, but no diffusers pipeline (it has no {MODEL_INDEX}); CONFIG is a "
            "config file, a shipped pipeline name or a diffusers pipeline directory",
            source=arg,
        )
    raise ConfigError(
        f"no such config file, and not a shipped pipeline name (shipped: {', '.join(PIPELINES)})",
        source=arg,
    )


def config_source(arg: str) -> str | dict[str, object]:
    """A CONFIG argument -> what :func:`omni_trio.config.load_config` takes: the one-stage
    diffusion pipeline of a diffusers pipeline directory
    (:func:`~omni_trio.pipelines.diffusers_dir.diffusion_pipeline`, its path made
    absolute), else :func:`resolve_config_arg`'s file path. Reads the file system. Raises
    ConfigError naming what was looked for."""
    if is_diffusers_dir(arg):
        return diffusion_pipeline(str(Path(arg).expanduser().resolve()))
    return resolve_config_arg(arg)


@dataclass
class _StageTimes:
    started: float
    first: float | None = None
    ended: float | None = None


@dataclass
class StageTimer(EngineObserver):
    """Records per request and stage: start, first output and end (perf_counter seconds)."""

    runs: dict[str, dict[str, _StageTimes]] = field(default_factory=dict)

    def stage_started(self, request_id: str, stage_id: str, t: float) -> None:
        self.runs.setdefault(request_id, {})[stage_id] = _StageTimes(t)

    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None:
        rec = self.runs.get(request_id, {}).get(stage_id)
        if rec is not None and rec.first is None:
            rec.first = t

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        rec = self.runs.get(request_id, {}).get(stage_id)
        if rec is not None:
            rec.ended = t

    def line(self, request_id: str) -> str:
        parts = []
        for sid, rec in sorted(self.runs.get(request_id, {}).items(), key=lambda kv: kv[1].started):
            total = (rec.ended or rec.started) - rec.started
            first = f"{rec.first - rec.started:.3f}s" if rec.first is not None else "-"
            parts.append(f"{sid} {total:.3f}s (first output {first})")
        return " | ".join(parts)


async def run_prompts(
    engine: Engine,
    prompts: Sequence[str],
    output_dir: Path,
    max_tokens: int | None,
    timer: StageTimer,
    out: TextIO | None = None,
    *,
    image_params: Mapping[str, object] | None = None,
    previews: bool = False,
) -> list[Path]:
    """Run each prompt in turn: stream the text stage's text to ``out`` as it arrives, write
    each audio stage's output as ``output_dir/prompt-<n>[-<stage>].wav`` and each image as
    ``output_dir/prompt-<n>[-<stage>][-<i>].png`` (``-<i>`` when a prompt has several
    images; ``-<stage>`` for a stage other than the pipeline's audio or image stage), print
    per-stage timing. ``max_tokens`` goes to the text stage, ``image_params`` (diffusers'
    names: ``num_inference_steps``, ``seed``...) to the image stage; ``previews`` also
    writes an image stage's previews (``-step<k>`` before the index). A prompt goes to the
    model as a user turn through its chat template when the text stage's tokenizer has one
    (a Qwen-Omni talker speaks the template's assistant turn), else as it is. Returns the
    paths written. Checkpoints; raises the request's error (StageError ...), StageError
    when an image stage's output is not images."""
    from ..server.chat_model import ChatModel

    out = out or sys.stdout
    cfg = engine.config
    text_sid, audio_sid, image_sid = text_stage(cfg), audio_stage(cfg), image_stage(cfg)
    answers_text = cfg.stage(text_sid).output_type == "text"
    chat = ChatModel(engine, text_sid)
    wanted = [*cfg.final_output_stages]
    for sid in (text_sid if answers_text else None, audio_sid, image_sid):
        if sid is not None and sid not in wanted:
            wanted.append(sid)
    params: dict[str, Mapping[str, object]] = {}
    if max_tokens and answers_text:
        params[text_sid] = {"max_tokens": max_tokens}
    if image_params and image_sid is not None:
        params[image_sid] = image_params
    written: list[Path] = []
    for n, prompt in enumerate(prompts, 1):
        print(f"\n[{n}] prompt: {prompt}", file=out)
        if answers_text:
            print(f"[{n}] {text_sid}: ", end="", file=out, flush=True)
        audio: dict[str, list[Any]] = {}
        rates: dict[str, int] = {}
        other_text: dict[str, list[str]] = {}
        images: list[tuple[Path, Any]] = []
        t0 = time.perf_counter()
        rendered = await chat.prompt([("user", prompt)], prompt)
        async with engine.generate(
            rendered, sampling_params=params or None, output_stages=wanted
        ) as s:
            rid = s.request_id
            async for o in s:
                if o.kind == "audio":
                    audio.setdefault(o.stage_id, []).append(o.data)
                    if o.metrics and "sample_rate" in o.metrics:
                        rates[o.stage_id] = sample_rate_of(o.metrics)
                elif o.kind == "image":
                    if previews or not is_preview(o.metrics):
                        stem = f"prompt-{n}" + ("" if o.stage_id == image_sid else f"-{o.stage_id}")
                        images.extend(_image_files(output_dir, stem, o))
                elif answers_text and o.stage_id == text_sid:
                    print(o.text, end="", file=out, flush=True)
                elif o.text:
                    other_text.setdefault(o.stage_id, []).append(o.text)
        if answers_text:
            print(file=out)
        for sid, parts in other_text.items():
            print(f"[{n}] {sid}: {''.join(parts)}", file=out)
        for sid, chunks in audio.items():
            samples = concat_audio(chunks)
            suffix = "" if sid == audio_sid else f"-{sid}"
            path = output_dir / f"prompt-{n}{suffix}.wav"
            rate = rates.get(sid) or sample_rate_of(None, cfg.stage(sid).options)
            # file I/O off the event loop: other requests may be streaming meanwhile
            await trio.to_thread.run_sync(_save_wav, path, samples, rate)
            written.append(path)
            print(
                f"[{n}] {sid}: wrote {path} ({len(samples)} samples, "
                f"{len(samples) / rate:.2f}s at {rate} Hz)",
                file=out,
            )
        for path, image in images:
            # PNG encoding is CPU work: off the event loop too
            await trio.to_thread.run_sync(write_png, path, image)
            written.append(path)
            height, width = image.shape[:2]
            print(f"[{n}] wrote {path} ({width}x{height})", file=out)
        print(f"[{n}] {time.perf_counter() - t0:.3f}s: {timer.line(rid)}", file=out, flush=True)
    return written


def _image_files(directory: Path, stem: str, output: OmniOutput) -> list[tuple[Path, Any]]:
    """Where each image of an image stage's ``output`` goes: ``<stem>[-step<k>][-<i>].png``
    (``-step<k>`` for a preview, ``-<i>`` from 1 when it carries several). Pure. Raises
    StageError when the output is not images."""
    found = output_images(output)
    if is_preview(output.metrics):
        step = output.metrics.get("step") if output.metrics else None
        stem = f"{stem}-step{step}"
    if len(found) == 1:
        return [(directory / f"{stem}.png", found[0])]
    return [(directory / f"{stem}-{i}.png", image) for i, image in enumerate(found, 1)]


@dataclass(frozen=True)
class RunSummary:
    """What a ``demo`` or ``run`` did, for its closing line."""

    config: PipelineConfig
    prompts: int
    written: tuple[Path, ...]
    output_dir: Path
    startup_s: float

    def line(self, command: str, total_s: float) -> str:
        """One line: what ran, where the files went, the total time. Pure."""
        chain = " -> ".join(st.id for st in self.config.stages)
        counts = {
            kind: sum(p.suffix == f".{kind}" for p in self.written) for kind in ("wav", "png")
        }
        kinds = [f"{n} {kind.upper()} file(s)" for kind, n in counts.items() if n]
        files = f"{', '.join(kinds)} in {self.output_dir}/" if kinds else "no audio or images"
        return (
            f"omni-trio {command}: {self.prompts} prompt(s) through {self.config.name!r} "
            f"({chain}); {files}; {total_s:.1f}s in all (start-up {self.startup_s:.1f}s)"
        )


def _save_wav(path: Path, samples: list[float], rate: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_wav(path, samples, rate)


def format_init_table(engine: Engine) -> str:
    """The start-up timeline: per stage and replica, seconds from start to each phase."""
    lines = ["start-up timeline (seconds since each replica's start):"]
    for sid, rows in engine.init_phases().items():
        total = engine.init_timeline.get(sid, {}).get("seconds")
        head = f"  {sid:<12} ready after {total:.3f}s" if total is not None else f"  {sid:<12}"
        lines.append(head)
        for r, phases in enumerate(rows):
            steps = " -> ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items(), key=_by_time))
            lines.append(f"    replica {r}: {steps or '(no phases recorded)'}")
    return "\n".join(lines)


def _by_time(item: tuple[str, float]) -> float:
    return item[1]


def format_stage_times(timer: StageTimer) -> str:
    """Per stage over all requests: count, mean time in stage, mean time to first output."""
    agg: dict[str, list[tuple[float, float | None]]] = {}
    for stages in timer.runs.values():
        for sid, rec in stages.items():
            total = (rec.ended or rec.started) - rec.started
            first = rec.first - rec.started if rec.first is not None else None
            agg.setdefault(sid, []).append((total, first))
    lines = ["per-stage timing (mean over requests):"]
    for sid, rows in agg.items():
        mean = sum(t for t, _ in rows) / len(rows)
        firsts = [f for _, f in rows if f is not None]
        ttfo = f"{sum(firsts) / len(firsts):.3f}s" if firsts else "-"
        lines.append(f"  {sid:<12} {len(rows)} request(s), {mean:.3f}s in stage, first {ttfo}")
    return "\n".join(lines)


def format_statistics(stats: EngineStatistics) -> str:
    """The engine's final statistics as a few lines."""
    lines = [
        f"engine: {stats.requests_total} requests: {stats.requests_finished} finished, "
        f"{stats.requests_aborted} aborted, {stats.requests_failed} failed, "
        f"{stats.requests_in_flight} in flight"
    ]
    for st in stats.stages:
        lines.append(
            f"  {st.stage_id:<12} {st.backend:<9} live replicas {st.live_replicas}/"
            f"{len(st.replicas)}, in flight {st.requests_in_flight}"
        )
    return "\n".join(lines)
