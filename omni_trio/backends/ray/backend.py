"""Stage replicas as Ray actors: the backend a stage with ``placement: {ray: ...}`` gets.

:class:`RayBackend` is the replica as the pool sees it, in the user's trio process; the
stage's own backend (``backend:`` scripted, vllm, torch or a user's) runs inside a Ray actor
(:class:`~._ray_actor.ReplicaActor`) under the same :class:`StageBackend` contract, placed
with the stage's ``num_cpus``, ``num_gpus``, ``resources`` and ``runtime_env``. Nothing above
the pool changes: bindings, restarts, membership, health and metrics work as for local
replicas.

- **Start**: connect to Ray (:class:`~._ray_link.RayLink`; a local Ray started for this
  process unless ``address`` names a cluster), check that some node can hold the placement
  (else :class:`StageStartError` saying what was asked and what the nodes have, at once),
  create the actor and start its backend, bounded by the stage's init timeout.
- **Requests**: the input crosses with the call (or its first chunk does, and the rest
  follow one call each for a ``stream_input`` stage or a ``streaming_input`` request, once
  the actor's stream said the request takes them), outputs come back as one Ray object per batch
  (what the backend emitted together), at most ``window`` batches in flight; a batch's
  outputs go on through ``emit.nowait`` while it takes them (:mod:`~omni_trio.stages.emit`).
  Cancelling a request ``ray.cancel``-s the call; the actor aborts it in its backend before
  the call ends, and ``_run`` returns only after that (bounded by ``abort_timeout_s``).
- **Interactions**: when the actor's backend takes them (it says so at start), each request's
  stream opens with STARTED, and an interaction waits for it before it crosses: sent
  earlier, it could reach the actor before the request and be lost there.
- **Death**: a sentinel call per actor returns when its backend dies and fails when the actor
  does (a killed process or node): the replica dies then, failing exactly its requests, and
  the pool's restart policy applies. ``health_timeout_s``: an actor that does not answer a
  health call in time counts as dead (hung).
- **Stop**: the actor stops its backend (bounded by ``shutdown_timeout``) and is killed; the
  last replica of the process disconnects from Ray (a local Ray it started shuts down).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import msgspec
import outcome
import trio

from ...config.stage import StageConfig
from ...errors import (
    InvalidRequestError,
    ReplicaDeadError,
    StageError,
    StageStartError,
    StageStopError,
)
from ...outputs import SamplingParams, StageInput
from ...stages.backend import StageBackend
from ...stages.emit import Emit, never, nowait_of
from ...stages.input_stream import InputStream, collect_input
from ...transport import codec
from .actor import BATCH, STARTED, ReplicaActor, raise_record
from .link import RayLink, RemoteStream

__all__ = ["RayBackend", "placement_problem"]

logger = logging.getLogger(__name__)

#: batches of outputs a request may have on the wire, unread
WINDOW = 16
#: seconds a cancelled request may take to be dropped in the actor
ABORT_TIMEOUT_S = 10.0
#: seconds between health calls, and how long one may take before the actor counts as hung
HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 10.0


def placement_problem(asked: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why no node can hold ``asked`` (resource -> amount), or ``None`` if one can. Pure."""
    wanted = {k: v for k, v in asked.items() if v > 0}
    if not wanted:
        return None
    for node in nodes:
        if all(node.get(k, 0.0) >= v for k, v in wanted.items()):
            return None
    have = "; ".join(
        ", ".join(f"{k}={v:g}" for k, v in sorted(node.items()) if k in wanted) or "none of them"
        for node in nodes
    )
    ask = ", ".join(f"{k}={v:g}" for k, v in sorted(wanted.items()))
    return f"no Ray node has {ask} (the nodes have: {have or 'no nodes'})"


class RayBackend(StageBackend):
    """One replica of a stage, running in a Ray actor. See the module docstring."""

    backend_name = "ray"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        assert config.placement is not None and config.placement.ray is not None
        self._placement = config.placement.ray
        self._link: RayLink | None = None
        self._actor: Any = None
        self._run_remote: Any = None
        self._unresponsive = False  # its health call timed out: it is killed, not stopped
        self._interactive = False  # the backend in the actor takes interactions
        # request id -> set once the actor's host has the request (or it ended here): what
        # an interaction waits for (requests of an interactive backend only)
        self._started: dict[str, trio.Event] = {}

    # -- lifecycle -------------------------------------------------------------------------
    async def _start(self) -> None:
        address = self._placement.address
        self._link = link = await trio.to_thread.run_sync(
            partial(RayLink.acquire, address, stage_id=self.stage_id)
        )
        self.mark_phase("ray_connected")
        ray = link.ray
        p = self._placement
        asked = {"CPU": float(p.num_cpus), "GPU": float(p.num_gpus), **p.resources}
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        problem = placement_problem(asked, nodes)
        if problem is not None:
            raise StageStartError(self.stage_id, f"replica {self.name}: {problem}")
        inner = msgspec.structs.replace(self.config, placement=None)
        options: dict[str, Any] = {
            "num_cpus": p.num_cpus,
            "num_gpus": p.num_gpus,
            "max_restarts": 0,  # the pool restarts replicas itself (restart: on-failure)
            "max_concurrency": 10_000,
            "name": None,
        }
        if p.resources:
            options["resources"] = dict(p.resources)
        if p.runtime_env:
            options["runtime_env"] = dict(p.runtime_env)
        self._actor = (
            ray.remote(ReplicaActor)
            .options(**options)
            .remote(
                msgspec.json.encode(inner), self.stage_index, self.replica, self.shutdown_timeout
            )
        )
        self._interactive = bool(await link.call(self._actor.start.remote()))
        # built once: .options() per request costs more than the call itself
        self._run_remote = self._actor.run.options(
            num_returns="streaming", _generator_backpressure_num_objects=WINDOW
        ).remote
        self.mark_phase("actor_ready")

    async def _serve_forever(self) -> None:
        assert self._link is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._check_health)
            try:
                reason = await self._link.call(self._actor.sentinel.remote())
            except Exception as exc:  # the actor (process, node) died
                raise ReplicaDeadError(
                    f"replica {self.name}: its Ray actor died: {type(exc).__name__}: {exc}",
                    stage_id=self.stage_id,
                    replica=self.replica,
                ) from exc
            raise ReplicaDeadError(
                f"replica {self.name}: its backend in the Ray actor ended: {reason}",
                stage_id=self.stage_id,
                replica=self.replica,
            )

    async def _check_health(self) -> None:
        # a hung actor answers nothing: it counts as dead after HEALTH_TIMEOUT_S
        assert self._link is not None
        while True:
            await trio.sleep(HEALTH_INTERVAL_S)
            with trio.move_on_after(HEALTH_TIMEOUT_S) as scope:
                try:
                    await self._link.call(self._actor.statistics.remote())
                except Exception:
                    return  # a dead actor: the sentinel reports it
            if scope.cancelled_caught:
                self._unresponsive = True
                self._die(
                    ReplicaDeadError(
                        f"replica {self.name}: its Ray actor did not answer a health call "
                        f"within {HEALTH_TIMEOUT_S}s",
                        stage_id=self.stage_id,
                        replica=self.replica,
                    )
                )
                return

    async def _stop(self) -> None:
        link = self._link
        if link is None:
            return
        failure: str | None = None
        try:
            # a hung actor would not answer a stop either: it is only killed
            if self._actor is not None and not self._unresponsive:
                with trio.move_on_after(self.shutdown_timeout):
                    try:
                        failure = await link.call(self._actor.stop.remote())
                    except Exception:
                        pass  # a dead actor has nothing left to stop
            if self._actor is not None:
                link.ray.kill(self._actor, no_restart=True)
                self._actor = None
        finally:
            self._link = None
            await trio.to_thread.run_sync(link.release)
        if failure is not None:
            raise StageStopError([(self.name, RuntimeError(failure))])

    async def actor_pid(self) -> int:
        """The process id of this replica's Ray actor (e.g. to kill it in a test).
        Checkpoints. Raises ReplicaDeadError when the replica is not ready."""
        if self._link is None or self._actor is None or not self.alive:
            await trio.lowlevel.checkpoint()
            raise self._unavailable_error(None)
        pid: int = await self._link.call(self._actor.pid.remote())
        return pid

    # -- requests --------------------------------------------------------------------------
    def _takes_segments(self, request_id: str) -> bool:
        if self.config.stream_input:
            return True
        context = self.request_context(request_id)
        return context is not None and context.streaming_input and not self.config.inputs

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        # registered before the first checkpoint: an interaction finds it as soon as the
        # request runs here
        started = trio.Event()
        if self._interactive:
            self._started[request_id] = started
        try:
            await self._run_on_actor(request_id, inputs, sampling_params, emit, started)
        finally:
            if self._interactive:
                del self._started[request_id]
            started.set()  # an interaction waiting for the actor finds the request gone

    async def _run_on_actor(
        self,
        request_id: str,
        inputs: InputStream,
        sampling_params: SamplingParams,
        emit: Emit,
        started: trio.Event,
    ) -> None:
        link = self._link
        assert link is not None
        more = self._takes_segments(request_id)
        if more:
            try:
                first = await inputs.receive()
            except trio.EndOfChannel:
                first = StageInput()
            more = not first.final
        else:
            first = await collect_input(inputs)
        context = self.request_context(request_id)
        gen = self._run_remote(
            request_id,
            codec.encode_inputs([first]),
            codec.encode_value(sampling_params),
            self.outputs_streamed(request_id),
            None if context is None else codec.encode_context(context),
            more,
            more or self._interactive,  # the actor announces the request: STARTED
            WINDOW,
        )
        stream = RemoteStream(link, gen, WINDOW, _identity)
        try:
            if not more:
                await self._relay(request_id, stream, emit, started)
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._forward_input, request_id, inputs, started)
                done = await outcome.acapture(self._relay, request_id, stream, emit, started)
                nursery.cancel_scope.cancel()
            done.unwrap()
        finally:
            if not stream.done:
                # cancelled or failed here: ray.cancel the call, then wait until the actor's
                # backend dropped the request (the end of our side of the stream does not
                # say so: Ray may end it before the actor's cleanup ran)
                stream.cancel()
                with trio.move_on_after(ABORT_TIMEOUT_S, shield=True) as scope:
                    try:
                        await link.call(self._actor.drop.remote(request_id))
                    except Exception as exc:  # a dead actor holds nothing any more
                        logger.debug("%s: drop of %r: %r", self.name, request_id, exc)
                    await stream.wait_done()
                if scope.cancelled_caught:
                    logger.warning("%s: abort of %r not confirmed in time", self.name, request_id)

    async def _relay(
        self, request_id: str, stream: RemoteStream, emit: Emit, started: trio.Event | None
    ) -> None:
        # A batch's outputs go through emit's fast path while it takes them (no checkpoint
        # each), then, from the first one it refuses, through the awaited emit, in order.
        # Checkpoints at every batch (stream.receive always does); no cancellation can be
        # pending on the fast path: it runs right after receive's closing checkpoint, with
        # no await in between.
        nowait = nowait_of(emit) or never
        while True:
            try:
                kind, payload = await stream.receive()
            except trio.EndOfChannel:
                return
            except Exception as exc:
                raise ReplicaDeadError(
                    f"replica {self.name}: its Ray actor failed request {request_id!r}: "
                    f"{type(exc).__name__}: {exc}",
                    stage_id=self.stage_id,
                    request_id=request_id,
                    replica=self.replica,
                ) from exc
            if kind == STARTED and started is not None:
                started.set()
                continue
            if kind != BATCH:
                raise_record(payload, request_id)
            outs = iter(codec.decode_outputs(payload))
            for out in outs:
                if not nowait(out):
                    await emit(out)
                    break
            for out in outs:
                await emit(out)

    async def _forward_input(
        self, request_id: str, inputs: InputStream, started: trio.Event
    ) -> None:
        # chunk by chunk, each acknowledged before the next: they arrive in order; none
        # before the actor said the request takes them (a chunk that overtook the run call
        # was refused, and the request then waited for it forever)
        assert self._link is not None
        await started.wait()
        async for chunk in inputs:
            sent = await self._link.call(
                self._actor.send_input.remote(request_id, codec.encode_inputs([chunk]))
            )
            if not sent or chunk.final:
                return
        await self._link.call(self._actor.end_input.remote(request_id))

    async def _rpc(
        self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        assert self._link is not None
        reply = codec.decode_value(
            await self._link.call(
                self._actor.rpc.remote(
                    method, codec.encode_value(list(args)), codec.encode_value(kwargs)
                )
            )
        )
        if isinstance(reply, dict) and "__error__" in reply:
            raise_record(reply["__error__"], "")
        return reply

    async def _interact(self, request_id: str, payload: object) -> bool:
        # Sent once the actor's host has the request (STARTED): sent earlier, it could reach
        # the host first and be refused there. The remote call is shielded (bounded): once
        # sent, the payload may be delivered, and a cancellation must not report otherwise.
        link = self._link
        assert link is not None
        if not self._interactive:
            raise InvalidRequestError(
                f"stage {self.stage_id!r} ({self.config.backend} backend, on Ray) takes no "
                "interactions: its backend does not implement _interact"
            )
        started = self._started.get(request_id)
        if started is None:  # not running here (the caller checked: it does)
            return False
        await started.wait()
        if self._started.get(request_id) is not started:
            return False  # it ended here while the actor was starting it
        ref = self._actor.interact.remote(request_id, codec.encode_value(payload))
        with trio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            reply = await link.call(ref)
            if isinstance(reply, dict) and "__error__" in reply:
                raise_record(reply["__error__"], request_id)
            return bool(reply)  # False: the request ended in the actor
        raise StageError(
            f"replica {self.name}: its Ray actor did not answer an interaction with request "
            f"{request_id!r} within {ABORT_TIMEOUT_S}s",
            stage_id=self.stage_id,
            request_id=request_id,
        )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} on Ray ({self.config.backend})>"


def _identity(item: Any) -> Any:
    return item
