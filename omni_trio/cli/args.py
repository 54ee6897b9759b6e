"""The ``omni-trio`` command line's grammar: its parser, the CONFIG argument, usage errors.

:func:`build_parser` declares every command and flag (``--help`` and ``docs`` come from it);
:class:`UsageError` is a command-line problem found after parsing (exit code 2, like the
parser's own); :func:`load_config_arg` turns a CONFIG argument (a pipeline file or a shipped
pipeline's name) into a loaded config. What each command does is in
:mod:`omni_trio.cli.commands` and :mod:`omni_trio.cli.serve`; :mod:`omni_trio.cli.main` runs them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .. import __version__
from .runner import resolve_config_arg

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig

__all__ = ["UsageError", "build_parser", "load_config_arg"]


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
    run.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a checkpoint directory for every stage that loads the pipeline's model "
        "(e.g. qwen3-omni's thinker, talker and code2wav) instead of its default",
    )

    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="serve a pipeline over an OpenAI-compatible HTTP API",
        description="Serve a pipeline: /v1/chat/completions, /v1/completions, "
        "/v1/audio/speech, /v1/models, /health, /metrics, and WS /v1/realtime (live "
        "sessions). SIGINT/SIGTERM stop accepting, "
        "let in-flight requests finish for --grace-period seconds, abort the rest, exit 0.",
    )
    serve.add_argument("config", metavar="CONFIG", help="pipeline file or shipped pipeline name")
    serve.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a checkpoint directory for every stage that loads the pipeline's model "
        "(e.g. qwen3-omni's thinker, talker and code2wav) instead of its default",
    )
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
        help="run the benchmarks of an omni-trio checkout (JSON results)",
        description="Run every benchmarks/bench_*.py script (or --only NAME) of the omni-trio "
        "checkout the current directory is in (else the one this package runs from), "
        "forwarding any further arguments to each. The benchmarks are not part of the "
        "installed package: they need a checkout.",
    )
    bench.add_argument("--only", action="append", help="run only bench_<NAME>.py (repeatable)")
    bench.add_argument(
        "--dir", default=None, help="the benchmarks directory (default: the checkout's)"
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the scripts")
    return parser


def load_config_arg(arg: str) -> PipelineConfig:
    """The config a CONFIG argument names, loaded and checked. Blocking (reads the file,
    imports what it names). Raises ConfigError naming the file, or what was looked for."""
    from ..config.loading import load_config

    return load_config(resolve_config_arg(arg))
