"""The engine session: ``open_engine()`` and the ``Engine`` users hold.

The session's structure (requests stop before stages) is in :mod:`omni_trio.engine.session`;
``generate()``'s checks and hooks are in :mod:`omni_trio.engine.request_maker`.

Exception policy. *To the consumer* of a request (its stream's ``receive``/``async for``/
``collect``): that request's own outcome only: its outputs, one terminal per output stage
(``finish_reason="abort"`` when it was aborted or the engine closed), or its error (a
:class:`StageError` subclass, also when a stage failed it while it was being aborted).
``await engine.abort(id)`` raises that error too (with ``exc.partial_outputs``). *To the
caller of* ``open_engine``: from entering, :class:`StageStartError` (every failed stage named,
``from ExceptionGroup`` when several failed) after everything that started was stopped; from
leaving (or ``aclose()``), :class:`StageStopError` naming every replica whose stop failed or
overran, raised after every stage was stopped; the body's own exception leaves the block
unwrapped (a stop failure beside it is logged, not raised). *Only logged*: a replica's death
after start-up (its requests fail with :class:`ReplicaDeadError`, the engine keeps serving),
a stage error during an abort (also raised to that request's consumer), an observer that
raises (it is detached).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, overload

import trio

from ..config.loading import load_config
from ..config.pipeline import PipelineConfig
from ..config.stageinfo import StageInfo, SupportedTask, stage_infos, supported_tasks
from ..errors import BackendUnavailableError, InvalidRequestError
from ..observer import EngineObserver
from ..outputs import EngineStatistics, OmniOutput, Prompt, SamplingParams
from ..request.hooks import PromptHooks
from ..request.planning import stage_ref
from ..stages.fanout import check_rpc_timeout
from ..stages.group import StageGroup
from ..stages.pool import StagePool
from ..telemetry.settings import TracingSettings, tracing_settings
from .health import HealthReport, assess_health
from .live_registry import SessionRegistry
from .live_session import Session, session_block
from .orchestrator import Orchestrator
from .request_maker import RequestMaker, abort_requests
from .rpc import fan_out_rpc
from .session import EngineSession
from .streams import RequestStream

if TYPE_CHECKING:
    from ..telemetry.spans import RequestTracer

__all__ = ["Engine", "open_engine"]

logger = logging.getLogger(__name__)

#: how long closing waits for the engine's own tracer provider to export what is left
_TRACER_SHUTDOWN_S = 10.0


def _tracer_factory(
    config: PipelineConfig, settings: TracingSettings, restarts: Callable[[str], int]
) -> Callable[[], RequestTracer]:
    """What makes the engine's tracer when its session is entered. OpenTelemetry is
    imported here, only when tracing is on. Raises :class:`BackendUnavailableError` when it
    is not installed."""
    try:
        from ..telemetry.spans import open_request_tracer
    except ImportError as exc:
        raise BackendUnavailableError(
            "tracing is on (the tracing key or an OTEL_* variable) but OpenTelemetry is not "
            "installed: pip install 'omni-trio[otel]'"
        ) from exc
    return partial(open_request_tracer, config, settings, restarts)


class Engine:
    """A running pipeline. Get one from :func:`open_engine`; it is valid inside that block."""

    def __init__(self, config: PipelineConfig, *, check_vllm: bool = False) -> None:
        self.config = config
        self._stage_group = StageGroup(config)
        self.orchestrator = Orchestrator(config, self._stage_group.pools)
        self._prompt_hooks = PromptHooks(config)
        self._requests = RequestMaker(config, self.orchestrator, self._prompt_hooks)
        self._live = SessionRegistry(self.generate, config.sessions)
        self._session = EngineSession(
            config,
            self._stage_group,
            self.orchestrator,
            self._prompt_hooks.keeper,
            self._live,
            check_vllm=check_vllm,
        )
        #: the engine's request tracer while the session is open with tracing on
        #: (:mod:`omni_trio.telemetry.spans`); ``None`` otherwise
        self.tracer: RequestTracer | None = None
        self._tracing: Callable[[], RequestTracer] | None = None
        settings = tracing_settings(config.tracing, os.environ)
        if settings is not None:
            self._tracing = _tracer_factory(config, settings, self._stage_restarts)

    def _stage_restarts(self, stage_id: str) -> int:
        # how often the stage's replicas were replaced so far (a span's "restarts seen")
        return sum(r.restarts for r in self.pools[stage_id].statistics().replicas)

    async def _close_tracer(self) -> None:
        # the engine's own tracer provider exports what is left; bounded, never cancelled
        tracer, self.tracer = self.tracer, None
        if tracer is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(_TRACER_SHUTDOWN_S) as scope:
            await trio.to_thread.run_sync(tracer.shutdown, abandon_on_cancel=True)
        if scope.cancelled_caught:
            logger.warning(
                "the tracer's exporter did not finish within %ss; spans may be lost",
                _TRACER_SHUTDOWN_S,
            )

    # -- session -------------------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        """Start every stage in parallel; return once all are ready. Checkpoints. Raises
        :class:`StageStartError` (after stopping what started); cancelled, it stops what
        started and re-raises."""
        if self._tracing is not None and self._session.state == "new":
            # its exporter's thread lives as long as the session
            self.tracer = self._tracing()
            self.add_observer(self.tracer)
        try:
            await self._session.enter()
        except BaseException:
            await self._close_tracer()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            return await self._session.exit(exc_type, exc, tb)
        finally:
            await self._close_tracer()

    async def aclose(self) -> None:
        """End the session: abort every request (each consumer gets its terminal), then stop
        every stage in parallel, in bounded time. Always checkpoints; not cancellable (it
        finishes stopping everything). Idempotent. Raises :class:`StageStopError` (once)
        naming every replica whose stop failed or overran. Leaving the ``async with`` block
        calls it."""
        try:
            await self._session.aclose()
        finally:
            await self._close_tracer()

    # -- requests ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        sampling_params: SamplingParams = None,
        final_stage_id: str | int | None = None,
        output_stages: Sequence[str | int] | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: object = None,
        trace_headers: Mapping[str, str] | None = None,
        tokenization_kwargs: Mapping[str, object] | None = None,
        streaming_input: bool = False,
        output_modalities: Sequence[str] | None = None,
    ) -> RequestStream:
        """Check a request and return its output stream; it is admitted when the stream is
        entered or first iterated.

        Synchronous. Raises :class:`InvalidRequestError` (naming the bad argument: prompt,
        request_id, a stage reference, an unknown stage key in ``sampling_params``) and
        :class:`EngineClosedError` here; entering the stream may raise
        :class:`EngineOverloadedError` or :class:`DuplicateRequestError`. Use ``async with
        engine.generate(...) as stream: async for out in stream``; leaving the block early, or
        being cancelled, aborts the request in every stage before ``__aexit__`` returns.

        ``priority``, ``arrival_time``, ``lora_request``, ``trace_headers`` and
        ``tokenization_kwargs`` travel with the request in its
        :class:`~omni_trio.context.RequestContext`: vllm stages hand them to vLLM, other
        backends may read them (``StageBackend.request_context``).

        ``output_modalities`` (e.g. ``("text",)`` or ``("text", "audio")``) picks the output
        stages by their ``output_type`` instead of ``output_stages`` (combining the two raises
        :class:`InvalidRequestError`): per modality the ``final_output`` stages of that type,
        else the last stage of it; only they and what they depend on run. ``"text"`` does not
        match ``tokens`` stages. An unknown modality, or one no stage produces, raises
        :class:`InvalidRequestError` naming it and what the pipeline produces
        (:mod:`omni_trio.config.stageinfo`).

        The ``prompt_transform`` hooks of the route's entry stages run here, synchronously,
        after the other arguments were checked and before the prompt is; a hook that raises
        (or returns something bad) raises :class:`InvalidRequestError` naming it and its
        stage. The directories a hook returns are deleted when the request ends, its
        admission is refused, or its stream is dropped unentered (:mod:`omni_trio.request.hooks`).

        ``streaming_input=True``: the prompt is the first input segment; send more with
        ``await stream.send_input(segment)`` and end with ``await stream.end_input()``. The
        route must have one entry stage (else :class:`InvalidRequestError`).
        """
        self._session.check_open()
        return self._requests.make(
            prompt,
            request_id,
            sampling_params,
            final_stage_id,
            output_stages,
            priority=priority,
            arrival_time=arrival_time,
            lora_request=lora_request,
            trace_headers=trace_headers,
            tokenization_kwargs=tokenization_kwargs,
            streaming_input=streaming_input,
            output_modalities=output_modalities,
        )

    @overload
    async def abort(self, request_id: str) -> list[OmniOutput]: ...  # type: ignore[overload-overlap]
    @overload
    async def abort(self, request_id: Iterable[str]) -> dict[str, list[OmniOutput]]: ...

    async def abort(
        self, request_id: str | Iterable[str]
    ) -> list[OmniOutput] | dict[str, list[OmniOutput]]:
        """Abort one request (returns its outputs so far) or several (returns
        ``{request_id: outputs}``), once every stage holding them dropped them.

        A request waiting for admission (``admission: wait``) leaves the queue at once
        (``statistics().requests_waiting`` drops) and never runs: ``[]``, and its consumer
        gets one ``finish_reason="abort"`` terminal per output stage, as from any aborted
        request. Always checkpoints. Cancelled before the abort is committed, nothing
        happens. Once committed (every id at once), the abort completes in the background
        whatever happens to the caller: cancelling the caller (``trio.move_on_after``...)
        ends its wait for the stages (it raises ``trio.Cancelled``), not the abort. Unknown
        or ended ids give ``[]``; during and after close it is a no-op (``[]`` / ``{}``).
        Raises the request's :class:`StageError` (with ``exc.partial_outputs``) if a stage
        failed it.
        """
        if self._session.state != "open":
            await trio.lowlevel.checkpoint()
            return [] if isinstance(request_id, str) else {}
        if isinstance(request_id, str):
            return await self.orchestrator.abort(request_id)
        return await abort_requests(self.orchestrator, request_id)

    def abort_nowait(self, request_id: str | Iterable[str]) -> None:
        """Request an abort and return at once (fire-and-forget): a running request's
        stages drop it in the background; a request waiting for admission leaves the queue
        now and never runs (its consumer gets its abort terminals). Synchronous; a no-op for
        unknown or ended ids, and during and after close."""
        if self._session.state != "open":
            return
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.orchestrator.abort_nowait(rid)

    async def interact(self, request_id: str, payload: object) -> bool:
        """Deliver a control payload to a live request's entry-stage backend, in order (see
        :mod:`~omni_trio.request.interactions`). Returns ``True`` once the backend accepted it,
        ``False`` for an unknown or ended request (or one whose entry stage is done with it);
        waits while the request has not reached its entry stage.

        Always checkpoints; cancelled before the backend accepted it, nothing was delivered.
        Raises :class:`InvalidRequestError` for a non-string id, or if the entry stage's
        backend takes no interactions (naming the stage).
        """
        if not isinstance(request_id, str):
            await trio.lowlevel.checkpoint()
            raise InvalidRequestError(
                f"request_id must be a string, not {type(request_id).__name__}"
            )
        return await self.orchestrator.interact(request_id, payload)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[object] | None = (),
        kwargs: Mapping[str, object] | None = None,
        stage_ids: Sequence[str | int] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (DESIGN.md's API)
    ) -> list[object]:
        """Call ``method`` on every replica of the chosen stages (default all; by id or index),
        concurrently. Returns one result per replica, in stage order then replica order.

        Always checkpoints; cancelling the caller cancels every call. ``args=None`` and
        ``kwargs=None`` mean none. Raises :class:`CollectiveRPCTimeoutError` naming every
        replica that did not answer within ``timeout``; :class:`ReplicaDeadError` when the one
        failing replica died (also while the call was pending); :class:`StageRPCError` naming
        every failing replica ``from ExceptionGroup`` of the causes; :class:`EngineClosedError`
        when the engine is closed, or closes while the call is pending;
        :class:`InvalidRequestError` naming the bad argument (a ``timeout`` that is not
        ``None`` or a number of seconds >= 0, an unknown stage), nothing called.
        """

        def check() -> list[str]:
            check_rpc_timeout(timeout)
            if stage_ids is None:
                return list(self.pools)
            return [stage_ref(self.config, ref, "collective_rpc: stage") for ref in stage_ids]

        chosen = await self._session.checked(check)
        return await self._session.until_close(
            lambda: fan_out_rpc([self.pools[sid] for sid in chosen], method, args, kwargs, timeout),
            f"collective_rpc({method!r})",
        )

    # -- live sessions -----------------------------------------------------------------------
    def open_session(
        self,
        session_id: str | None = None,
        *,
        config: Mapping[str, object] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AbstractAsyncContextManager[Session]:
        """Open a live session (:mod:`omni_trio.engine.live_session`): ``async with
        engine.open_session() as session: ...``. ``config`` sets what its turns use
        (``sampling_params``, ``output_modalities``; see :meth:`Session.update`).
        ``trace_headers`` (W3C ``traceparent``) is the trace each turn's request continues,
        as :meth:`generate`'s. Leaving the block closes the session (its responses
        cancelled, every stage dropped them) unless it was detached.

        Entering checkpoints; cancelled, nothing is opened. Raises
        :class:`SessionLimitError` (retryable) at ``sessions.max_sessions`` (closing
        sessions count until their stages dropped their requests),
        :class:`SessionExistsError` for an id that is open (the first is untouched),
        :class:`InvalidRequestError` for a bad id or config, :class:`EngineClosedError`.
        """
        return session_block(self._live.open(session_id, config, trace_headers))

    def resume_session(
        self,
        session_id: str,
        token: str,
        *,
        last_seq: int = 0,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AbstractAsyncContextManager[Session]:
        """Take back a detached session with the token :meth:`Session.detach` returned; its
        ``events()`` replays every event after ``last_seq`` from the journal. Its later
        turns continue the resumer's trace (``trace_headers``, as :meth:`open_session`'s),
        not the opener's. The lease's
        generation is compared and swapped with no checkpoint in between, so of two
        resumers with the same token one wins. Leaving the block closes the session unless
        it was detached again.

        Entering checkpoints. Raises :class:`SessionResumeError`: unknown or closed
        session, not detached, a stale token, ``last_seq`` older than the journal holds.
        """
        return session_block(self._live.resume(session_id, token, last_seq, trace_headers))

    # -- admission -----------------------------------------------------------------------------
    async def pause(self) -> None:
        """Hold new admissions until :meth:`resume`: entering a stream waits (``admission:
        wait``, first-in first-out, counted in ``statistics().requests_waiting``) or raises
        :class:`EngineOverloadedError` (``admission: reject``), even with room. Requests in
        flight go on: it returns once the pause is in effect and does not wait for them
        (:func:`omni_trio.testing.wait_until_idle` does). Idempotent (pauses do not nest).

        Always checkpoints; cancelled, nothing is paused. Raises :class:`EngineClosedError`
        when the engine is not open.
        """
        await self._session.checked(self.orchestrator.admission.pause)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def resume(self) -> None:
        """End :meth:`pause`: waiting admissions are let in, first-in first-out, as far as
        ``max_requests_in_flight`` allows (the rest wait for room as usual). Synchronous;
        idempotent, a no-op when not paused or closed."""
        self.orchestrator.admission.resume()

    # -- membership ----------------------------------------------------------------------------
    async def _membership_stage(self, stage: str | int, what: str) -> str:
        # the checks of add/remove_replica: a schedule point on the refusal paths too
        return await self._session.checked(lambda: stage_ref(self.config, stage, f"{what}: stage"))

    async def add_replica(self, stage: str | int) -> int:
        """Start one more replica of ``stage`` (id or index); return its index once it is
        ready. It is listed (``starting``) in :meth:`check_health`, :meth:`statistics` and
        :attr:`stages` from the call on, and gone again if it does not join.

        The replica's task belongs to the stage's pool (see
        :meth:`StagePool.add_replica <omni_trio.stages.pool.StagePool.add_replica>`); its
        start is bounded by the stage's ``stage_init_timeout``. Closing the engine cancels an
        add in flight (its stop bounded by ``shutdown_timeout``) and the close waits for it.

        The stage's ``resources`` are reserved first: :class:`ResourceUnavailableError` (a
        :class:`StageStartError`) when they do not fit in what is left of the capacities,
        nothing started. Removing the replica gives its share back.

        Always checkpoints; cancelled, the start is cancelled and the stage unchanged.
        Raises :class:`StageStartError` naming the replica if it fails to start, overruns
        ``stage_init_timeout``, or is removed while it starts (the stage unchanged);
        :class:`InvalidRequestError` for an unknown stage; :class:`EngineClosedError` when
        the engine is closed, or closes while the replica starts (it is not added)."""
        sid = await self._membership_stage(stage, "add_replica")
        return await self._session.until_close(
            self.pools[sid].add_replica, f"add_replica({stage!r})"
        )

    async def remove_replica(
        self, stage: str | int, index: int, drain_timeout: float = 30.0
    ) -> None:
        """Stop routing new requests to replica ``index`` of ``stage``, let its requests
        finish for up to ``drain_timeout`` seconds, fail the rest with
        :class:`ReplicaDeadError`, then stop it (see :meth:`StagePool.remove_replica`). A
        replica still starting (its :meth:`add_replica` in flight) is removed by cancelling
        its start; that ``add_replica`` raises :class:`StageStartError`.
        Always checkpoints. Raises :class:`InvalidRequestError` for an unknown stage or
        replica, :class:`StageStopError` if its stop failed, :class:`EngineClosedError`."""
        sid = await self._membership_stage(stage, "remove_replica")
        await self.pools[sid].remove_replica(index, drain_timeout=drain_timeout)

    # -- introspection -------------------------------------------------------------------------
    def add_observer(self, observer: EngineObserver) -> None:
        """Attach an :class:`~omni_trio.observer.EngineObserver` (metrics, tracing, a
        timeline). Synchronous; requests admitted from now on are observed."""
        self.orchestrator.observers.add(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        """Detach an observer :meth:`add_observer` attached; its ``detached`` hook runs
        (a tracer ends the spans it holds open). Synchronous. Raises ValueError if it is
        not attached."""
        self.orchestrator.observers.remove(observer)

    @property
    def pools(self) -> dict[str, StagePool]:
        """The stage pools, by stage id (their replicas, bindings and statistics)."""
        return self._stage_group.pools

    @property
    def init_timeline(self) -> dict[str, dict[str, float]]:
        """Per stage: trio-clock ``start``, ``ready`` and ``seconds`` of its start-up."""
        return self._stage_group.init_timeline

    def init_phases(self) -> dict[str, list[dict[str, float]]]:
        """Per stage, per replica: seconds from ``start`` to each recorded start-up phase."""
        return self._stage_group.init_phases()

    @property
    def closed(self) -> bool:
        """True from the moment the session starts closing."""
        return self._session.closed

    @property
    def stage_ids(self) -> list[str]:
        return self.config.stage_ids

    @property
    def stages(self) -> tuple[StageInfo, ...]:
        """Every stage's frozen :class:`~omni_trio.config.stageinfo.StageInfo` (id, index, backend,
        output_type, inputs, final_output, replicas: its member replicas now), in config
        order. Synchronous; a new snapshot each time. The pools are :attr:`pools`."""
        pools = self._stage_group.pools
        return stage_infos(self.config, {sid: len(p.replicas) for sid, p in pools.items()})

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        """``generate`` when a stage produces text, ``speech`` when the pipeline has an audio
        stage (any stage can be a request's final one); see
        :func:`~omni_trio.config.stageinfo.supported_tasks`."""
        return supported_tasks(self.stages)

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot: request counters, admissions waiting, paused, requests holding
        a ``max_requests_in_graph`` ticket, every stage's in-flight counts, and the resources
        the replicas reserve (capacity and reserved)."""
        orch = self.orchestrator
        admission = orch.admission
        return EngineStatistics(
            requests_in_flight=orch.requests_in_flight,
            requests_finished=orch.n_finished,
            requests_aborted=orch.n_aborted,
            requests_failed=orch.n_failed,
            requests_total=orch.n_total,
            closed=self.closed,
            stages=self._stage_group.statistics(),
            requests_waiting=admission.waiting,
            paused=admission.paused,
            sessions=self._live.held,
            requests_in_graph=admission.in_graph,
            resources=self._stage_group.resources.statistics(),
            sessions_detached=self._live.detached,
            sessions_opened=self._live.opened_total,
        )

    def check_health(self) -> HealthReport:
        """A frozen :class:`~omni_trio.engine.health.HealthReport` of this session: per stage, its
        ready (live) and member replicas and its waiting requests; per replica, its state,
        requests in flight, failures, restarts and last error; ``status`` ``ok``,
        ``degraded``, ``unhealthy`` (naming every stage with no ready replica) or ``closed``.
        Synchronous: never blocks, never checkpoints, raises nothing; valid in every state of
        the session (before it opens every replica is ``starting``)."""
        return assess_health(self.statistics())

    def __repr__(self) -> str:
        stages = repr(self._stage_group)
        return (
            f"<Engine {self.config.name!r} {self._session.state} "
            f"in_flight={self.orchestrator.requests_in_flight} "
            f"stages=[{stages}]>"
        )


def open_engine(
    config: PipelineConfig | Mapping[str, object] | str | os.PathLike[str], **overrides: object
) -> Engine:
    """Open an engine session on a pipeline: ``async with open_engine(cfg) as engine: ...``.

    ``config`` is a PipelineConfig, a mapping or a YAML/TOML/JSON path; ``overrides`` replace
    top-level keys (``stage_init_timeout=60``, ``stage_overrides={"talker": {...}}``).
    Entering starts every stage in parallel (each under its ``stage_init_timeout``, all under
    ``init_timeout``) and raises :class:`StageStartError` naming the stage(s) that failed,
    after stopping the others. Raises :class:`ConfigError` for a bad config: synchronously,
    except for the checks of vllm stages' ``engine_args`` against vLLM's fields, which run in
    a worker thread when the session is entered (importing vllm takes seconds).
    See the module docstring for the whole exception policy.
    """
    return Engine(load_config(config, check_vllm=False, **overrides), check_vllm=True)
