"""The ``omni-trio`` command: ``demo``, ``run``, ``serve``, ``validate``, ``schema``, ``bench``.

Exit codes: 0 ok, 1 runtime failure, 2 usage or config error. Errors are one line on stderr
(``omni-trio: error: ...``); ``--debug`` shows the traceback instead. CONFIG is a pipeline
file (YAML/TOML/JSON) or the name of a shipped pipeline (``tiny-omni``).

This module runs a command: :func:`main` parses the arguments, sets up logging (the output
of vLLM, torch and transformers goes to a log file for the commands that start engines),
dispatches, and turns what the command raised into one line and an exit code. The parser is
in :mod:`omni_trio.cli.args`, the commands in :mod:`omni_trio.cli.commands` and
:mod:`omni_trio.cli.serve`.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import trio

from ..errors import ConfigError, InvalidRequestError

# every public name once defined here stays importable from here; `X as X` re-exports one
# outside __all__ (mypy --strict does not re-export a plain import)
from .args import UsageError as UsageError
from .args import build_parser as build_parser
from .args import parse_command_line
from .commands import DEMO_PROMPTS as DEMO_PROMPTS
from .commands import RANDOM_WEIGHTS_NOTE as RANDOM_WEIGHTS_NOTE
from .commands import RuntimeFailure as RuntimeFailure
from .commands import cmd_bench, cmd_demo, cmd_run, cmd_schema, cmd_validate
from .console import chatter_to_log, default_log_path, exit_process, stop_resource_tracker
from .serve import cmd_serve

__all__ = ["main"]

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
        args = parse_command_line(parser, argv)
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
    then a quick exit that leaves no child process (:func:`~omni_trio.cli.console.exit_process`)."""
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
