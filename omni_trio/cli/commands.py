"""The one-shot ``omni-trio`` commands: ``demo``, ``run``, ``validate``, ``schema``, ``bench``.

``demo`` and ``run`` start an engine, stream each prompt's text to stdout and write audio
outputs as WAV files, images as PNG files (:mod:`omni_trio.cli.runner`); ``validate`` and
``schema`` start nothing; ``bench`` runs the benchmark scripts of an omni-trio checkout as
subprocesses (they are not part of the installed package: :func:`find_benchmarks`). Each
``cmd_*`` takes the parsed arguments and returns the exit code, or raises:
:class:`~omni_trio.cli.args.UsageError` (exit 2), :class:`RuntimeFailure` (exit 1), or what
the engine raised (see :func:`omni_trio.cli.main.main`). ``serve`` is in
:mod:`omni_trio.cli.serve`.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import trio

from ..config.stageinfo import image_stage
from ..images import parse_size
from ..pipelines import default_pipeline_path
from .args import UsageError, load_config_arg
from .model_dir import load_config_with_model
from .runner import (
    RunSummary,
    StageTimer,
    format_init_table,
    format_stage_times,
    format_statistics,
    run_prompts,
)

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig

__all__ = [
    "CHECKOUT_NEEDED",
    "DEMO_PROMPTS",
    "RANDOM_WEIGHTS_NOTE",
    "RuntimeFailure",
    "cmd_bench",
    "cmd_demo",
    "cmd_run",
    "cmd_schema",
    "cmd_validate",
    "find_benchmarks",
    "image_params",
]

T = TypeVar("T")

RANDOM_WEIGHTS_NOTE = (
    "note: the tiny-omni models have random weights: the text and audio below are noise. "
    "The demo shows the pipeline (thinker -> talker -> vocoder streaming into each other), "
    "not a model."
)
DEMO_PROMPTS = (
    "Tell me about the weather today.",
    "Describe a cat in one sentence.",
    "What is structured concurrency?",
)


class RuntimeFailure(Exception):
    """A command failed at run time: exit code 1."""


def _max_tokens(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {value}")
    return value


async def _run_pipeline(
    args: argparse.Namespace, config: PipelineConfig, prompts: Sequence[str]
) -> RunSummary:
    from ..engine.engine import open_engine
    from ..heap import frozen_heap
    from ..telemetry.timeline import record_timeline
    from .progress import open_engine_with_progress

    timer = StageTimer()
    t0 = time.perf_counter()  # start-up: from here until every stage is ready
    async with open_engine_with_progress(open_engine(config), sys.stderr) as engine:
        started = time.perf_counter() - t0
        engine.add_observer(timer)
        recorder = record_timeline(engine) if args.timeline else None
        if args.log_stats:
            print(format_init_table(engine), flush=True)
        with frozen_heap():  # this process is ours: its startup heap out of full collections
            written = await run_prompts(
                engine,
                prompts,
                Path(args.output_dir),
                args.max_tokens,
                timer,
                image_params=image_params(args) if args.command == "run" else None,
                previews=getattr(args, "previews", False),
            )
        print(format_stage_times(timer), flush=True)
        if recorder is not None:
            events = await trio.to_thread.run_sync(recorder.write, args.timeline)
            print(
                f"timeline: {events} trace events in {args.timeline} "
                "(open it in Perfetto or chrome://tracing)",
                flush=True,
            )
        if args.log_stats:
            print(format_statistics(engine.statistics()), flush=True)
    return RunSummary(config, len(prompts), tuple(written), Path(args.output_dir), started)


async def _until_sigint(work: Callable[[], Awaitable[T]]) -> T:
    """``await work()``, cancelled by the first SIGINT, which then raises
    ``KeyboardInterrupt`` once ``work`` has unwound (its engine closed: ``main`` prints
    "interrupted"). Checkpoints; a cancellation from outside propagates as ``Cancelled``;
    what ``work`` raises reaches the caller as it raised it.

    Ctrl-C arrives as a signal the run watches for, not as a ``KeyboardInterrupt`` trio
    injects wherever the main thread happens to be: injected inside trio's own scheduling it
    surfaced as ``TrioInternalError`` (about one run in 20-60 of tests/cli/test_main.py's Ctrl-C
    test)."""
    interrupted = False
    result: list[T] = []  # work's return value, once it returned (None is a value too)
    try:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    nonlocal interrupted
                    async for _ in signals:
                        interrupted = True
                        nursery.cancel_scope.cancel()
                        return

                async def main() -> None:
                    result.append(await work())
                    nursery.cancel_scope.cancel()  # done: stop watching

                nursery.start_soon(watch)
                nursery.start_soon(main)
    except BaseExceptionGroup as group:
        # the nursery wraps what the work raised (the watcher raises nothing of its own): the
        # caller gets it as the work raised it (a StageError, not a group holding one)
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
        raise error from error.__cause__  # `from None` would erase the error's own cause
    if interrupted or not result:
        raise KeyboardInterrupt
    return result[0]


def _timeline(path: str | None) -> None:
    # before any engine starts: a file that cannot be written is a usage error
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise UsageError(f"--timeline: the directory of {path!r} does not exist")


def cmd_demo(args: argparse.Namespace) -> int:
    _max_tokens(args.max_tokens)
    _timeline(args.timeline)
    t0 = time.perf_counter()
    config = load_config_arg(str(default_pipeline_path()))
    print(RANDOM_WEIGHTS_NOTE, flush=True)
    prompts = args.prompt or list(DEMO_PROMPTS)
    summary = trio.run(_until_sigint, partial(_run_pipeline, args, config, prompts))
    print(RANDOM_WEIGHTS_NOTE, flush=True)
    print(summary.line("demo", time.perf_counter() - t0), flush=True)
    return 0


def image_params(args: argparse.Namespace) -> dict[str, object]:
    """The image stage's sampling params ``run``'s image flags ask for (diffusers' names;
    none given: empty). Pure. Raises UsageError naming a bad flag."""
    params: dict[str, object] = {}
    if args.size is not None:
        try:
            params["width"], params["height"] = parse_size(args.size)
        except ValueError as exc:
            raise UsageError(f"--size: {exc}") from None
    for flag, key, low in (
        ("steps", "num_inference_steps", 1),
        ("num_images", "num_images_per_prompt", 1),
        ("seed", "seed", 0),
    ):
        value = getattr(args, flag)
        if value is not None:
            if value < low:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= {low}, got {value}")
            params[key] = value
    if args.guidance_scale is not None:
        if not args.guidance_scale >= 0:
            raise UsageError(f"--guidance-scale must be >= 0, got {args.guidance_scale}")
        params["guidance_scale"] = args.guidance_scale
    if args.negative_prompt is not None:
        params["negative_prompt"] = args.negative_prompt
    return params


def cmd_run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    _max_tokens(args.max_tokens)
    _timeline(args.timeline)
    images = image_params(args)
    prompts = [*args.prompts, *args.prompt]
    if not prompts:
        raise UsageError("give a prompt: omni-trio run CONFIG PROMPT (or --prompt PROMPT)")
    if any(not p for p in prompts):
        raise UsageError("a prompt must not be empty")
    config = load_config_with_model(args.config, args.model)
    if args.max_tokens is not None and all(st.output_type != "text" for st in config.stages):
        raise UsageError(f"--max-tokens: pipeline {config.name!r} has no text stage")
    if (images or args.previews) and image_stage(config) is None:
        flags = "--previews" if not images else "the image flags"
        raise UsageError(f"{flags}: pipeline {config.name!r} has no image stage")
    summary = trio.run(_until_sigint, partial(_run_pipeline, args, config, prompts))
    print(summary.line("run", time.perf_counter() - t0), flush=True)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Everything knowable without starting an engine (see omni_trio.config.loading); a failure is
    a ConfigError: one line naming the file and JSON path, exit 2 (see main)."""
    config = load_config_arg(args.config)
    shown = 12  # a 20,000-stage pipeline still gets one readable line
    chain = ", ".join(
        f"{st.id}({st.backend}{' <- ' + '+'.join(st.inputs) if st.inputs else ''})"
        for st in config.stages[:shown]
    )
    more = f", ... ({len(config.stages) - shown} more)" if len(config.stages) > shown else ""
    print(
        f"OK: {config.source}: pipeline {config.name!r}, {len(config.stages)} stages: {chain}{more}"
    )
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from ..config.pipeline import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


#: what ``omni-trio bench`` says where no checkout is found (one line)
CHECKOUT_NEEDED = (
    "omni-trio bench needs a checkout of the omni-trio repository: the benchmarks "
    "(benchmarks/bench_*.py) are not part of the installed package; run it inside a "
    "checkout, or pass --dir CHECKOUT/benchmarks"
)


def find_benchmarks(explicit: str | None, cwd: Path, package_root: Path) -> Path:
    """The directory whose ``bench_*.py`` scripts ``omni-trio bench`` runs: ``explicit``
    (``--dir``) as given; else the ``benchmarks/`` of the omni-trio checkout that holds
    ``cwd``; else that of the checkout the package itself was imported from
    (``package_root``, the directory above the ``omni_trio`` package: a checkout for an
    editable install, ``site-packages`` for an installed one). Blocking (reads files).
    Raises :class:`UsageError`: ``--dir`` is not a directory, or no checkout was found
    (:data:`CHECKOUT_NEEDED`)."""
    if explicit is not None:
        directory = Path(explicit)
        if not directory.is_dir():
            raise UsageError(f"--dir {explicit}: no such directory")
        return directory
    for root in (cwd, *cwd.parents, package_root):
        if _is_checkout(root):
            return root / "benchmarks"
    raise UsageError(CHECKOUT_NEEDED)


def _is_checkout(root: Path) -> bool:
    """Whether ``root`` is an omni-trio checkout: a ``benchmarks/`` directory beside a
    ``pyproject.toml`` that names the project ``omni-trio`` (another project's benchmarks
    are not run). Blocking."""
    if not (root / "benchmarks").is_dir():
        return False
    try:
        with open(root / "pyproject.toml", "rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return isinstance(project, dict) and project.get("name") == "omni-trio"


def cmd_bench(args: argparse.Namespace) -> int:
    # the directory above the omni_trio package (this module is omni_trio/cli/commands.py)
    package_root = Path(__file__).resolve().parents[2]
    directory = find_benchmarks(args.dir, Path.cwd(), package_root)
    scripts = sorted(directory.glob("bench_*.py"))
    if args.only:
        wanted = {f"bench_{n.removeprefix('bench_').removesuffix('.py')}.py" for n in args.only}
        missing = wanted - {s.name for s in scripts}
        if missing:
            raise UsageError(
                f"no such benchmark(s): {', '.join(sorted(missing))}; "
                f"have: {', '.join(s.name for s in scripts)}"
            )
        scripts = [s for s in scripts if s.name in wanted]
    if not scripts:
        raise UsageError(f"no bench_*.py scripts in {directory.name}/")
    forwarded = [a for a in args.args if a != "--"]
    failed = []
    for script in scripts:
        print(f"omni-trio: running {script.name}", file=sys.stderr, flush=True)
        rc = subprocess.call([sys.executable, str(script), *forwarded])
        if rc != 0:
            failed.append(f"{script.name} (exit {rc})")
    if failed:
        raise RuntimeFailure(f"benchmark(s) failed: {', '.join(failed)}")
    return 0
