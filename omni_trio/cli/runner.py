"""Running prompts through an engine for the command line: stream text, save audio, time stages.

Used by ``omni-trio demo`` and ``omni-trio run``; nothing here knows argparse. Also how a
CONFIG argument names a file or a shipped pipeline (:func:`resolve_config_arg`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import trio

from ..audio import concat_audio, sample_rate_of, write_wav
from ..config.pipeline import PipelineConfig
from ..config.stageinfo import audio_stage, text_stage
from ..errors import ConfigError
from ..observer import EngineObserver
from ..pipelines import PIPELINES, pipeline_path

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..outputs import EngineStatistics

__all__ = [
    "RunSummary",
    "StageTimer",
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
    raise ConfigError(
        f"no such config file, and not a shipped pipeline name (shipped: {', '.join(PIPELINES)})",
        source=arg,
    )


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
) -> list[Path]:
    """Run each prompt in turn: stream the text stage's text to ``out`` as it arrives, write
    each audio stage's output as ``output_dir/prompt-<n>[-<stage>].wav``, print per-stage
    timing. A prompt goes to the model as a user turn through its chat template when the text
    stage's tokenizer has one (a Qwen-Omni talker speaks the template's assistant turn), else
    as it is. Returns the WAV paths. Checkpoints; raises the request's error (StageError
    ...)."""
    from ..server.chat_model import ChatModel

    out = out or sys.stdout
    cfg = engine.config
    text_sid, audio_sid = text_stage(cfg), audio_stage(cfg)
    chat = ChatModel(engine, text_sid)
    wanted = [*cfg.final_output_stages]
    for sid in (text_sid, audio_sid):
        if sid is not None and sid not in wanted:
            wanted.append(sid)
    params = {text_sid: {"max_tokens": max_tokens}} if max_tokens else None
    written: list[Path] = []
    for n, prompt in enumerate(prompts, 1):
        print(f"\n[{n}] prompt: {prompt}", file=out)
        print(f"[{n}] {text_sid}: ", end="", file=out, flush=True)
        audio: dict[str, list[Any]] = {}
        rates: dict[str, int] = {}
        other_text: dict[str, list[str]] = {}
        t0 = time.perf_counter()
        rendered = await chat.prompt([("user", prompt)], prompt)
        async with engine.generate(rendered, sampling_params=params, output_stages=wanted) as s:
            rid = s.request_id
            async for o in s:
                if o.kind == "audio":
                    audio.setdefault(o.stage_id, []).append(o.data)
                    if o.metrics and "sample_rate" in o.metrics:
                        rates[o.stage_id] = sample_rate_of(o.metrics)
                elif o.stage_id == text_sid:
                    print(o.text, end="", file=out, flush=True)
                elif o.text:
                    other_text.setdefault(o.stage_id, []).append(o.text)
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
        print(f"[{n}] {time.perf_counter() - t0:.3f}s: {timer.line(rid)}", file=out, flush=True)
    return written


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
        files = (
            f"{len(self.written)} WAV file(s) in {self.output_dir}/"
            if self.written
            else "no audio written"
        )
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
