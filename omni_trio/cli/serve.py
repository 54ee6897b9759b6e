"""``omni-trio serve``: a pipeline behind the HTTP server until SIGINT or SIGTERM.

The server binds its port before any stage starts (a taken port fails at once), says where
it listens, and serves once every stage is ready. The first SIGINT/SIGTERM while serving
stops accepting and gives in-flight requests ``--grace-period`` seconds before aborting the
rest; a second signal, or one during start-up, stops at once. Stopping on a signal exits 0,
with a replica that did not stop cleanly reported as a warning. Access log lines (one per
request) go to stderr unless ``--no-access-log``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ..errors import StageStopError
from ..failures import leaves
from .args import UsageError
from .model_dir import load_config_with_model
from .runner import format_init_table, format_statistics

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig
    from ..engine.engine import Engine

__all__ = ["cmd_serve"]


async def _serve(args: argparse.Namespace, config: PipelineConfig) -> None:
    from ..server.serve import serve_engine
    from .progress import open_engine_with_progress

    shutdown = trio.Event()
    serving = False
    engine: Engine | None = None

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

    def ready(started: Engine, port: int) -> None:
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
    config = load_config_with_model(args.config, args.model)
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
