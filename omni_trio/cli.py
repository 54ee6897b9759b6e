"""The ``omni-trio`` command: ``demo``, ``run``, ``serve``, ``validate``, ``schema``, ``bench``.

Exit codes: 0 ok, 1 runtime failure, 2 usage or config error. Errors are one line on stderr
(``omni-trio: error: ...``); ``--debug`` shows the traceback instead. CONFIG is a pipeline
file (YAML/TOML/JSON) or the name of a shipped pipeline (``tiny-omni``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import trio

from . import __version__
from .console import chatter_to_log, default_log_path, exit_process, stop_resource_tracker
from .errors import ConfigError, InvalidRequestError, StageStopError
from .failures import leaves
from .runner import (
    RunSummary,
    StageTimer,
    default_pipeline,
    format_init_table,
    format_stage_times,
    format_statistics,
    resolve_config_arg,
    run_prompts,
)

__all__ = ["main"]

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


class UsageError(Exception):
    """A command-line problem: exit code 2."""


def _common(*, sub: bool) -> argparse.ArgumentParser:
    # subcommands must not reset a flag given before the command (argparse applies a
    # subparser's defaults over the parent's values), hence SUPPRESS there
    default = argparse.SUPPRESS if sub else False
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks and debug logs"
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        default=default,
        help="show vLLM, torch and transformers output here (default: in a log file)",
    )
    p.add_argument(
        "--log-stats",
        action="store_true",
        default=default,
        help="print the start-up phase timeline and the final engine statistics",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``omni-trio`` (pure)."""
    common = _common(sub=True)
    parser = argparse.ArgumentParser(
        prog="omni-trio",
        description="Run multi-stage (omni-modality) inference pipelines on trio.",
        parents=[_common(sub=False)],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="run the embedded tiny-omni pipeline on a few prompts",
        description="Run the embedded tiny-omni pipeline (random-weight models built locally) "
        "on a few prompts: stream the thinker's text, write each answer's audio as a WAV.",
    )
    demo.add_argument("--output-dir", default="demo-output", help="where WAVs go (./demo-output)")
    demo.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three")
    demo.add_argument("--max-tokens", type=int, default=None, help="max tokens of the text stage")

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a pipeline on prompts: text to stdout, audio to WAVs",
        description="Run any pipeline on one or more prompts. Text streams to stdout; audio "
        "outputs are written as WAV files in --output-dir.",
    )
    run.add_argument("config", metavar="CONFIG", help="pipeline file or shipped pipeline name")
    run.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    run.add_argument("--output-dir", default="omni-output", help="where WAVs go (./omni-output)")
    run.add_argument("--max-tokens", type=int, default=None, help="max tokens of the text stage")

    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="serve a pipeline over an OpenAI-compatible HTTP API",
        description="Serve a pipeline: /v1/chat/completions, /v1/completions, "
        "/v1/audio/speech, /v1/models, /health, /metrics. SIGINT/SIGTERM stop accepting, "
        "let in-flight requests finish for --grace-period seconds, abort the rest, exit 0.",
    )
    serve.add_argument("config", metavar="CONFIG", help="pipeline file or shipped pipeline name")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--grace-period", type=float, default=10.0, help="seconds (10)")
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="larger request bodies get 413 (16 MiB)",
    )
    serve.add_argument(
        "--no-access-log",
        action="store_true",
        help="do not log one line per request (method, path, status, request id, duration)",
    )

    validate = sub.add_parser(
        "validate",
        parents=[common],
        help="check a pipeline config",
        description="Load and validate a pipeline config; print OK or the error with its "
        "file and JSON path.",
    )
    validate.add_argument("config", metavar="CONFIG")

    sub.add_parser(
        "schema",
        parents=[common],
        help="print the pipeline config's JSON Schema",
        description="Print the JSON Schema of pipeline config files (for editors that check "
        "YAML/JSON as it is typed).",
    )

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="run the benchmarks in benchmarks/ (JSON results)",
        description="Run every benchmarks/bench_*.py script (or --only NAME), forwarding "
        "any further arguments to each.",
    )
    bench.add_argument("--only", action="append", help="run only bench_<NAME>.py (repeatable)")
    bench.add_argument("--dir", default=None, help="the benchmarks directory")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the scripts")
    return parser


# -- commands ------------------------------------------------------------------------------------


def _max_tokens(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {value}")
    return value


def _load(arg: str) -> Any:
    from .config import load_config

    return load_config(resolve_config_arg(arg))


async def _run_pipeline(
    args: argparse.Namespace, config: Any, prompts: Sequence[str]
) -> RunSummary:
    from .engine import open_engine
    from .progress import open_engine_with_progress

    timer = StageTimer()
    t0 = time.perf_counter()  # start-up: from here until every stage is ready
    async with open_engine_with_progress(open_engine(config), sys.stderr) as engine:
        started = time.perf_counter() - t0
        engine.add_observer(timer)
        if args.log_stats:
            print(format_init_table(engine), flush=True)
        written = await run_prompts(engine, prompts, Path(args.output_dir), args.max_tokens, timer)
        print(format_stage_times(timer), flush=True)
        if args.log_stats:
            print(format_statistics(engine.statistics()), flush=True)
    return RunSummary(config, len(prompts), tuple(written), Path(args.output_dir), started)


def cmd_demo(args: argparse.Namespace) -> int:
    _max_tokens(args.max_tokens)
    t0 = time.perf_counter()
    config = _load(str(default_pipeline()))
    print(RANDOM_WEIGHTS_NOTE, flush=True)
    summary = trio.run(_run_pipeline, args, config, args.prompt or list(DEMO_PROMPTS))
    print(RANDOM_WEIGHTS_NOTE, flush=True)
    print(summary.line("demo", time.perf_counter() - t0), flush=True)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    _max_tokens(args.max_tokens)
    config = _load(args.config)
    if any(not p for p in args.prompt):
        raise UsageError("--prompt must not be empty")
    summary = trio.run(_run_pipeline, args, config, args.prompt)
    print(summary.line("run", time.perf_counter() - t0), flush=True)
    return 0


async def _serve(args: argparse.Namespace, config: Any) -> None:
    from .progress import open_engine_with_progress
    from .server import serve_engine

    shutdown = trio.Event()
    serving = False
    engine: Any = None

    async def watch(signals: Any, scope: trio.CancelScope) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if serving and not shutdown.is_set():
                print(
                    f"omni-trio: {name}: stopping; in-flight requests get "
                    f"{args.grace_period}s to finish (again to stop now)",
                    file=sys.stderr,
                    flush=True,
                )
                shutdown.set()
            else:  # a second signal, or one during start-up: stop now
                print(f"omni-trio: {name}: stopping now", file=sys.stderr, flush=True)
                shutdown.set()
                scope.cancel()

    def ready(started: Any, port: int) -> None:
        nonlocal serving, engine
        serving, engine = True, started
        if args.log_stats:
            print(format_init_table(started), flush=True)
        print(
            f"omni-trio: serving {config.name!r} on http://{args.host}:{port} "
            f"(model id {config.name!r}; Ctrl+C to stop)",
            flush=True,
        )

    async def run(nursery: trio.Nursery) -> None:
        port = await nursery.start(
            partial(
                serve_engine,
                config,
                host=args.host,
                port=args.port,
                shutdown_trigger=shutdown.wait,
                grace_period=args.grace_period,
                max_body_bytes=args.max_body_bytes,
                on_ready=ready,
                enter_engine=partial(open_engine_with_progress, stream=sys.stderr),
            )
        )
        # bound before any stage starts: a taken port has failed already
        print(
            f"omni-trio: listening at http://{args.host}:{port}; starting "
            f"{len(config.stages)} stage(s) (/health answers 503 until they are ready)",
            flush=True,
        )

    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, signals, nursery.cancel_scope)
                async with trio.open_nursery() as server:
                    await run(server)
                nursery.cancel_scope.cancel()
    except* StageStopError as group:
        if not shutdown.is_set():
            raise
        # stopping on a signal is still a clean exit; a replica that did not stop cleanly
        # (its stop failed or overran shutdown_timeout) is reported, not an error
        for exc in leaves(group):
            print(f"omni-trio: warning: {exc}", file=sys.stderr, flush=True)
    if args.log_stats and engine is not None:
        print(format_statistics(engine.statistics()), flush=True)
    print("omni-trio: server stopped", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.grace_period < 0:
        raise UsageError(f"--grace-period must be >= 0, got {args.grace_period}")
    if args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    access = logging.getLogger("omni_trio.server.access")
    # one INFO line per request, on the terminal (the log file gets it too)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not args.no_access_log:
        access.setLevel(logging.INFO)
        access.addHandler(handler)
    try:
        trio.run(_serve, args, config)
    finally:
        access.removeHandler(handler)
        access.setLevel(logging.NOTSET)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Everything knowable without starting an engine (see omni_trio.config); a failure is
    a ConfigError: one line naming the file and JSON path, exit 2 (see main)."""
    config = _load(args.config)
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
    from .config import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


def _bench_dir(explicit: str | None) -> Path:
    candidates = [Path(explicit)] if explicit else []
    candidates += [Path.cwd() / "benchmarks", Path(__file__).resolve().parent.parent / "benchmarks"]
    for d in candidates:
        if d.is_dir():
            return d
    raise UsageError("no benchmarks directory found (run from the repository or pass --dir)")


def cmd_bench(args: argparse.Namespace) -> int:
    directory = _bench_dir(args.dir)
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


class RuntimeFailure(Exception):
    """A command failed at run time: exit code 1."""


COMMANDS = {
    "demo": cmd_demo,
    "run": cmd_run,
    "serve": cmd_serve,
    "validate": cmd_validate,
    "schema": cmd_schema,
    "bench": cmd_bench,
}


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def exit_code_for(exc: BaseException) -> int:
    """2 for usage/config errors, 1 for everything else (pure)."""
    return 2 if isinstance(exc, (UsageError, ConfigError, InvalidRequestError)) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``omni-trio`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    quiet = args.command in ENGINE_COMMANDS and not args.verbose
    level_before = os.environ.get("VLLM_LOGGING_LEVEL")
    if not quiet:
        # vLLM logs every engine's full config at INFO: keep the terminal readable
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if args.debug else "WARNING")
    try:
        with _chatter(args.command, quiet=quiet, debug=args.debug):
            return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("omni-trio: interrupted", file=sys.stderr)
        return 1
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        leaf = _leaf(exc)
        if isinstance(leaf, KeyboardInterrupt) and not args.debug:  # from inside trio.run
            print("omni-trio: interrupted", file=sys.stderr)
            return 1
        if args.debug:
            traceback.print_exception(exc)
        else:
            kind = "" if isinstance(leaf, (UsageError, RuntimeFailure)) else type(leaf).__name__
            msg = " ".join(str(leaf).split()) or repr(leaf)
            print(f"omni-trio: error: {kind + ': ' if kind else ''}{msg}", file=sys.stderr)
        return exit_code_for(leaf)
    finally:
        # main() may run in a longer-lived process (a test, an embedding program): its
        # vLLM log level must not leak into later commands or the processes they spawn
        if level_before is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = level_before


def run() -> NoReturn:
    """The ``omni-trio`` program (console script, ``python -m omni_trio``): :func:`main`,
    then a quick exit that leaves no child process (:func:`~omni_trio.console.exit_process`)."""
    exit_process(main())


#: the commands that start engines: their third-party output goes to a log file
ENGINE_COMMANDS = frozenset({"demo", "run", "serve"})


@contextmanager
def _chatter(command: str, *, quiet: bool, debug: bool) -> Iterator[None]:
    if not quiet:
        yield
        return
    path = default_log_path(command)
    with chatter_to_log(path, debug=debug):
        print(
            f"omni-trio: vLLM, torch and transformers output goes to {path} "
            "(--verbose shows it here)",
            file=sys.stderr,
            flush=True,
        )
        try:
            yield
        finally:
            # every engine has stopped: the tracker's last words (if any) go to the log
            stop_resource_tracker()


if __name__ == "__main__":
    run()
