"""The ``omni-trio`` command line's grammar: its parser, the CONFIG argument, usage errors.

:func:`build_parser` declares every command and flag (``--help`` and ``docs`` come from it);
:class:`UsageError` is a command-line problem found after parsing (exit code 2, like the
parser's own); :func:`load_config_arg` turns a CONFIG argument (a pipeline file, a shipped
pipeline's name or a diffusers pipeline directory) into a loaded config. What each command
does is in :mod:`omni_trio.cli.commands` and :mod:`omni_trio.cli.serve`;
:mod:`omni_trio.cli.main` runs them.
"""

from __future__ import annotations

import argparse
from argparse import Namespace
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import __version__
from .runner import config_source

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig

__all__ = ["CONFIG_HELP", "UsageError", "build_parser", "load_config_arg", "parse_command_line"]


#: what a CONFIG argument may be
CONFIG_HELP = (
    "a pipeline file, a shipped pipeline's name, or a diffusers pipeline directory "
    "(model_index.json: a one-stage diffusion pipeline)"
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


def _timeline_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        default=None,
        help="write the requests' stage runs and the start-up phases as a Chrome trace-event "
        "file (open it in Perfetto or chrome://tracing)",
    )


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
    _timeline_flag(demo)

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a pipeline on prompts: text to stdout, audio to WAVs, images to PNGs",
        description="Run any pipeline on one or more prompts (PROMPT arguments, then each "
        "--prompt). Text streams to stdout; audio outputs are written as WAV files and "
        "images as PNG files (one per image) in --output-dir.",
    )
    run.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    run.add_argument("prompts", metavar="PROMPT", nargs="*", help="a prompt (any number)")
    run.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    run.add_argument(
        "--output-dir", default="omni-output", help="where WAVs and PNGs go (./omni-output)"
    )
    run.add_argument("--max-tokens", type=int, default=None, help="max tokens of the text stage")
    _timeline_flag(run)
    images = run.add_argument_group("image stages (output_type: image)")
    images.add_argument("--size", metavar="WxH", default=None, help="width x height in pixels")
    images.add_argument("--steps", type=int, default=None, help="denoise steps")
    images.add_argument("--guidance-scale", type=float, default=None, help="CFG scale")
    images.add_argument("--negative-prompt", default=None, help="what the image should not show")
    images.add_argument(
        "--seed", type=int, default=None, help="the noise seed (same seed, same image)"
    )
    images.add_argument("--num-images", type=int, default=None, help="images per prompt (1)")
    images.add_argument(
        "--previews",
        action="store_true",
        help="also write the stage's intermediate previews (prompt-N-stepK.png)",
    )
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
        "/v1/audio/speech, /v1/images/generations, /v1/models, /health, /metrics, and WS "
        "/v1/realtime (live sessions). SIGINT/SIGTERM stop accepting, let in-flight requests "
        "finish for --grace-period seconds, abort the rest, exit 0.",
    )
    serve.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
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


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Namespace:
    """``parser.parse_args(argv)``, except that ``run``'s PROMPT arguments may also come after
    its flags (``omni-trio run tiny-image --seed 3 "a cat"``: argparse alone takes positionals
    only before the first flag). Pure but for what argparse does on an error: it prints the
    usage and raises SystemExit(2)."""
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "run" and not any(e.startswith("-") for e in extra):
        args.prompts = [*args.prompts, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def load_config_arg(arg: str) -> PipelineConfig:
    """The config a CONFIG argument names (a file, a shipped pipeline, a diffusers pipeline
    directory: :func:`~omni_trio.cli.runner.config_source`), loaded and checked. Blocking
    (reads the file, imports what it names). Raises ConfigError naming the file, or what
    was looked for."""
    from ..config.loading import load_config

    return load_config(config_source(arg))
