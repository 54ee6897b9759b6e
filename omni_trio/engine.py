"""The engine session: ``open_engine()`` and the ``Engine`` users hold.

``open_engine`` opens one nursery that owns everything: the stage pools (and through them
every replica, worker thread and engine process) and one task per request. Leaving the
``async with`` block stops admission, aborts every request in flight (each consumer gets a
terminal output), stops the stages in parallel, and only then returns.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from types import TracebackType
from typing import Any

import trio

from .config import PipelineConfig, load_config
from .errors import (
    CollectiveRPCTimeoutError,
    EngineClosedError,
    InvalidRequestError,
    StageRPCError,
    StageStartError,
)
from .observer import EngineObserver
from .orchestrator import Orchestrator
from .outputs import EngineStatistics, OmniOutput, StageInput
from .planning import plan_request, resolve_sampling_params, stage_ref
from .stages.pool import StagePool
from .streams import RequestStream

__all__ = ["Engine", "open_engine"]

logger = logging.getLogger(__name__)


def prompt_to_input(prompt: Any) -> StageInput:
    """The entry stages' input for a prompt: text, token ids, or a prompt dict. Pure."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is an empty string")
        return StageInput(prompt=prompt)
    if isinstance(prompt, Mapping):
        if not prompt:
            raise InvalidRequestError("prompt dict is empty")
        return StageInput(data=dict(prompt))
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise InvalidRequestError("prompt token id list is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise InvalidRequestError("prompt token ids must be non-negative integers")
        return StageInput(token_ids=tuple(prompt))
    raise InvalidRequestError(
        f"prompt must be a str, a list of token ids or a prompt dict, not {type(prompt).__name__}"
    )


class Engine:
    """A running pipeline. Get one from :func:`open_engine`; it is valid inside that block."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.pools: dict[str, StagePool] = {
            st.id: StagePool(st, stage_index=i) for i, st in enumerate(config.stages)
        }
        self.orchestrator = Orchestrator(config, self.pools)
        self._nursery_cm: Any = None
        self._nursery: trio.Nursery | None = None
        self.init_timeline: dict[str, dict[str, float]] = {}
        self._closed = False

    # -- session -------------------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        try:
            await self._start_stages()
        except BaseException as exc:  # incl. Cancelled: stop what started, then re-raise
            self._closed = True
            # nursery exit always waits for its children, cancelled or not: no shield needed
            self._nursery.cancel_scope.cancel()
            await self._nursery_cm.__aexit__(None, None, None)
            self._nursery_cm = None
            raise exc
        self.orchestrator.attach(self._nursery)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        await self.aclose()
        return False

    async def aclose(self) -> None:
        """End the session: abort every request, stop every stage, in bounded time.

        Runs shielded (it finishes even when the caller is cancelled); idempotent.
        """
        if self._nursery_cm is None:
            return
        cm, self._nursery_cm = self._nursery_cm, None
        self._closed = True
        with trio.CancelScope(shield=True):
            await self.orchestrator.close()
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        # exiting the nursery waits for every stage to stop, even if we are cancelled
        await cm.__aexit__(None, None, None)

    async def _start_stages(self) -> None:
        assert self._nursery is not None
        nursery = self._nursery
        failures: list[StageStartError] = []
        started: set[str] = set()

        async def start(pool: StagePool) -> None:
            timeout = pool.config.stage_init_timeout or self.config.stage_init_timeout
            t0 = trio.current_time()
            with trio.move_on_after(timeout) as scope:
                try:
                    await nursery.start(pool.serve)
                except StageStartError as exc:
                    failures.append(exc)
                except Exception as exc:
                    failures.append(StageStartError(pool.stage_id, f"{type(exc).__name__}: {exc}"))
                else:
                    started.add(pool.stage_id)
                    self.init_timeline[pool.stage_id] = {
                        "start": t0,
                        "ready": trio.current_time(),
                        "seconds": trio.current_time() - t0,
                    }
            if scope.cancelled_caught:
                failures.append(
                    StageStartError(
                        pool.stage_id, f"did not start within stage_init_timeout={timeout}s"
                    )
                )
            if failures:
                starters.cancel_scope.cancel()

        overall = self.config.init_timeout
        with trio.move_on_after(overall) if overall else nullcontext() as overall_scope:
            async with trio.open_nursery() as starters:
                for pool in self.pools.values():
                    starters.start_soon(start, pool)
        if failures:
            raise failures[0]
        if overall_scope is not None and overall_scope.cancelled_caught:
            slow = [sid for sid in self.pools if sid not in started]
            raise StageStartError(
                ", ".join(slow), f"the pipeline did not start within init_timeout={overall}s"
            )

    # -- requests ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self.orchestrator.closed:
            raise EngineClosedError("the engine is closed; it accepts no new work")

    def generate(
        self,
        prompt: Any,
        request_id: str | None = None,
        sampling_params: Any = None,
        final_stage_id: str | int | None = None,
        output_stages: Sequence[str | int] | None = None,
    ) -> RequestStream:
        """Start a request (lazily) and return its output stream.

        Synchronous. Arguments are validated here (raises :class:`InvalidRequestError`,
        :class:`EngineClosedError`); the request is admitted when the stream is entered or
        first iterated (which may raise :class:`EngineOverloadedError` or
        :class:`DuplicateRequestError`). Use ``async with engine.generate(...) as stream:
        async for out in stream``; leaving the block early, or being cancelled, aborts the
        request in every stage before ``__aexit__`` returns.
        """
        self._check_open()
        first = prompt_to_input(prompt)
        plan = plan_request(self.config, final_stage_id, output_stages)
        params = resolve_sampling_params(self.config, sampling_params)
        rid = request_id if request_id is not None else self.orchestrator.new_request_id()
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request_id must be a non-empty string")
        return RequestStream(self.orchestrator, rid, first, plan, params)

    async def abort(self, request_id: str | Iterable[str]) -> Any:
        """Abort one request (returns its outputs so far, a list of OmniOutput) or several
        (returns ``{request_id: outputs}``), once every stage holding them dropped them.

        Checkpoints. Unknown or finished ids are a no-op (``[]``). Raises EngineClosedError.
        """
        self._check_open()
        if isinstance(request_id, str):
            return await self.orchestrator.abort(request_id)
        ids = list(request_id)
        results: dict[str, list[OmniOutput]] = {}

        async def one(rid: str) -> None:
            results[rid] = await self.orchestrator.abort(rid)

        async with trio.open_nursery() as nursery:
            for rid in ids:
                nursery.start_soon(one, rid)
        return {rid: results[rid] for rid in ids}

    def abort_nowait(self, request_id: str | Iterable[str]) -> None:
        """Request an abort and return at once (fire-and-forget). Synchronous; no-op for
        unknown ids. Raises EngineClosedError."""
        self._check_open()
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.orchestrator.abort_nowait(rid)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        stage_ids: Sequence[str | int] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (DESIGN.md's API)
    ) -> list[Any]:
        """Call ``method`` on every replica of the chosen stages (default all), concurrently.

        Returns one result per stage replica, in stage order then replica order.
        Checkpoints. Raises :class:`CollectiveRPCTimeoutError` (a ``TimeoutError``) naming the
        replicas that did not answer within ``timeout``; :class:`StageRPCError` if one raised.
        """
        self._check_open()
        chosen = (
            list(self.pools)
            if stage_ids is None
            else [stage_ref(self.config, ref, "collective_rpc: stage") for ref in stage_ids]
        )
        targets = [(sid, r) for sid in chosen for r in self.pools[sid].replicas]
        results: list[Any] = [None] * len(targets)
        answered = [False] * len(targets)
        errors: list[tuple[str, BaseException]] = []

        async def call(i: int) -> None:
            sid, backend = targets[i]
            try:
                results[i] = await backend.collective_rpc(method, args, dict(kwargs or {}))
            except Exception as exc:
                errors.append((backend.name, exc))
            answered[i] = True

        with trio.move_on_after(math.inf if timeout is None else timeout):
            async with trio.open_nursery() as nursery:
                for i in range(len(targets)):
                    nursery.start_soon(call, i)
        if not all(answered):
            pending = [targets[i][1].name for i in range(len(targets)) if not answered[i]]
            raise CollectiveRPCTimeoutError(method, float(timeout or 0.0), pending)
        if errors:
            name, exc = errors[0]
            raise StageRPCError(
                f"collective_rpc({method!r}) failed on {name}: {type(exc).__name__}: {exc}"
            ) from exc
        return results

    # -- introspection -------------------------------------------------------------------------
    def add_observer(self, observer: EngineObserver) -> None:
        """Attach an :class:`~omni_trio.observer.EngineObserver` (metrics, tracing)."""
        self.orchestrator.observers.add(observer)

    def init_phases(self) -> dict[str, list[dict[str, float]]]:
        """Per stage, per replica: seconds from ``start`` to each recorded start-up phase."""
        out: dict[str, list[dict[str, float]]] = {}
        for sid, pool in self.pools.items():
            rows = []
            for r in pool.replicas:
                t0 = r.timeline.get("start")
                rows.append({k: v - t0 for k, v in r.timeline.items()} if t0 is not None else {})
            out[sid] = rows
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stage_ids(self) -> list[str]:
        return self.config.stage_ids

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot: request counters and every stage's in-flight counts."""
        orch = self.orchestrator
        return EngineStatistics(
            requests_in_flight=orch.requests_in_flight,
            requests_finished=orch.n_finished,
            requests_aborted=orch.n_aborted,
            requests_failed=orch.n_failed,
            requests_total=orch.n_total,
            closed=self._closed,
            stages=tuple(p.statistics() for p in self.pools.values()),
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        stages = " ".join(
            f"{p.stage_id}:{p.live_replicas}/{len(p.replicas)}" for p in self.pools.values()
        )
        return (
            f"<Engine {self.config.name!r} {state} "
            f"in_flight={self.orchestrator.requests_in_flight} "
            f"stages=[{stages}]>"
        )


def open_engine(
    config: PipelineConfig | Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
) -> Engine:
    """Open an engine session on a pipeline: ``async with open_engine(cfg) as engine: ...``.

    ``config`` is a PipelineConfig, a mapping or a YAML/TOML/JSON path; ``overrides`` replace
    top-level keys (``stage_init_timeout=60``, ``stage_overrides={"talker": {...}}``).
    Entering starts every stage in parallel (each under its ``stage_init_timeout``, all under
    ``init_timeout``) and raises :class:`StageStartError` naming the stage that failed, after
    stopping the others. Raises :class:`ConfigError` for a bad config (synchronously).
    """
    return Engine(load_config(config, **overrides))
