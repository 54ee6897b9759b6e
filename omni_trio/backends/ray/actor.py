"""What runs inside a Ray actor: one replica of a stage, under the ordinary backend contract.

:class:`ReplicaActor` is a Ray *async* actor (its methods run on the actor's asyncio loop, so
``ray.cancel`` reaches a running call as ``asyncio.CancelledError``). The stage's own backend
(scripted, vllm, torch, a user's) runs inside it on a trio loop in a thread of the actor
(``transport.loop_host.open_trio_portal``: anyio's ``BlockingPortal`` into it);
:class:`ReplicaHost` is that trio side. Calls cross from the
actor's loop to the host with ``portal.start_task_soon`` (a future, awaited without blocking
the actor's loop). Everything on the wire is the codec's bytes (``transport.codec``); a
request's failure travels as a value (:func:`error_record`) so that its type survives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import trio

from ...config.stage import StageConfig
from ...errors import OmniTrioError, StageAborted, StageError
from ...heap import frozen_heap
from ...outputs import StageOutput
from ...stages.backend import StageBackend
from ...stages.factory import create_backend
from ...transport import codec
from ...transport.loop_host import open_trio_portal

__all__ = [
    "BATCH",
    "ERROR",
    "STARTED",
    "ReplicaActor",
    "ReplicaHost",
    "error_record",
    "raise_record",
]

#: a request's failure on the wire: (exception type name, message, stage_id)
ErrorRecord = tuple[str, str, str | None]

# what a run's stream carries: (STARTED, None) first when announced (more input to come, or a
# backend that takes interactions: the caller sends neither before it), then
# (BATCH, encoded outputs) items, then maybe (ERROR, record); between the host and the
# actor's loop, one (OUTPUT, StageOutput) per emit
BATCH = 0
ERROR = 1
_OUTPUT = 2
_END = (3, None)
STARTED = 4


def error_record(exc: BaseException) -> ErrorRecord:
    """An exception as a value that crosses the wire. Pure."""
    return (type(exc).__name__, str(exc), getattr(exc, "stage_id", None))


def raise_record(record: ErrorRecord, request_id: str) -> None:
    """Raise the omni-trio error a record describes (a StageError for anything else)."""
    from ... import errors

    name, message, stage_id = record
    cls = getattr(errors, name, None)
    if name == "StageAborted":
        raise StageAborted(message)
    if isinstance(cls, type) and issubclass(cls, StageError):
        raise cls(message, stage_id=stage_id, request_id=request_id)
    if isinstance(cls, type) and issubclass(cls, OmniTrioError) and name == "InvalidRequestError":
        raise cls(message)
    raise StageError(f"{name}: {message}", stage_id=stage_id, request_id=request_id)


class ReplicaHost:
    """The trio side of a replica actor: its backend, its requests' output queues."""

    def __init__(self, backend: StageBackend) -> None:
        self.backend = backend
        self._inputs: dict[str, trio.MemorySendChannel[Any]] = {}
        self._credit: dict[str, trio.Semaphore] = {}
        self._dead = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        # the backend's whole life; a death after readiness ends it (the sentinel reports it)
        try:
            await self.backend.serve(task_status=task_status)
        finally:
            self._dead.set()

    async def wait_dead(self) -> str:
        await self._dead.wait()
        death = self.backend.death
        return "stopped" if death is None else f"{type(death).__name__}: {death}"

    async def run(
        self,
        request_id: str,
        first: bytes,
        params: bytes,
        streamed: bool,
        context: bytes | None,
        more_input: bool,
        announce: bool,
        window: int,
        post: Callable[[tuple[int, Any]], None],
    ) -> None:
        """Run one request on the backend; ``post`` each output, then an error record if it
        failed. An emit waits for credit: at most ``window`` outputs posted and not yet
        acknowledged (:meth:`ack`). With ``announce``, ``(STARTED, None)`` is posted first,
        once :meth:`send_input` and :meth:`interact` find the request: the caller sends
        neither before it (Ray runs an async actor's calls in no set order, and the host's
        tasks start in no set order either, so a chunk or an interaction sent earlier could
        find no request, be refused, and be lost)."""
        send, receive = trio.open_memory_channel[Any](max(window, 1))
        for chunk in codec.decode_inputs(first):
            send.send_nowait(chunk)
        if more_input:
            self._inputs[request_id] = send
        else:
            send.close()
        credit = self._credit[request_id] = trio.Semaphore(max(window, 1))

        async def emit(out: StageOutput) -> None:
            await credit.acquire()
            post((_OUTPUT, out))

        ctx = None if context is None else codec.decode_context(context)
        sp = codec.decode_value(params)
        try:
            if announce:
                # run_request registers the request before its first checkpoint: an
                # interaction that crosses after this finds it running
                post((STARTED, None))
            await self.backend.run_request(
                request_id, receive, sp, emit, streamed=streamed, context=ctx
            )
        except Exception as exc:
            post((ERROR, error_record(exc)))
        finally:
            self._credit.pop(request_id, None)
            sender = self._inputs.pop(request_id, None)
            if sender is not None:
                sender.close()

    def ack(self, request_id: str, n: int) -> None:
        credit = self._credit.get(request_id)
        if credit is not None:
            for _ in range(n):
                credit.release()

    async def send_input(self, request_id: str, chunks: bytes) -> bool:
        send = self._inputs.get(request_id)
        if send is None:
            return False
        for chunk in codec.decode_inputs(chunks):
            try:
                await send.send(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            if chunk.final:
                send.close()
                self._inputs.pop(request_id, None)
                break
        return True

    async def end_input(self, request_id: str) -> None:
        send = self._inputs.pop(request_id, None)
        if send is not None:
            await send.aclose()

    async def abort(self, request_id: str) -> None:
        await self.backend.abort(request_id)

    async def rpc(self, method: str, args: bytes, kwargs: bytes) -> bytes:
        a = codec.decode_value(args)
        k = codec.decode_value(kwargs)
        assert isinstance(a, (list, tuple)) and isinstance(k, dict)
        return codec.encode_value(await self.backend.collective_rpc(method, list(a), k))

    async def interact(self, request_id: str, payload: bytes) -> bool:
        return await self.backend.interact(request_id, codec.decode_value(payload))


class ReplicaActor:
    """A Ray async actor hosting one replica (see the module docstring). Made remote with
    ``ray.remote(ReplicaActor)`` by the ``ray`` backend."""

    def __init__(self, config: bytes, stage_index: int, replica: int, shutdown_timeout: float):
        stage = msgspec.json.decode(config, type=StageConfig)
        backend = create_backend(stage, stage_index=stage_index, replica=replica)
        backend.shutdown_timeout = shutdown_timeout
        self._host = ReplicaHost(backend)
        self._portal_cm = open_trio_portal(name=f"omni-trio-replica-{stage.id}-{replica}")
        self._portal = self._portal_cm.__enter__()
        self._serving: concurrent.futures.Future[None] | None = None
        # the host side of each request's run: drop() waits for it
        self._runs: dict[str, concurrent.futures.Future[None]] = {}
        # the startup heap, frozen while the replica serves (start() to stop())
        self._heap = contextlib.ExitStack()

    async def _on_host(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._portal.start_task_soon(fn, *args))

    async def start(self) -> bool:
        """Start the backend; return when it is ready (raise what its start raised), with
        whether it takes interactions."""
        future, _ = await asyncio.to_thread(self._portal.start_task, self._host.serve)
        self._serving = future
        # this process hosts this replica alone: its startup heap (Ray's, and vLLM's or
        # torch's for such a stage) stays out of full collections while it serves
        self._heap.enter_context(frozen_heap())
        return self._host.backend.takes_interactions

    async def sentinel(self) -> str:
        """Return when the backend died or stopped (its reason); fails with the actor."""
        result: str = await self._on_host(self._host.wait_dead)
        return result

    async def run(
        self,
        request_id: str,
        first: bytes,
        params: bytes,
        streamed: bool,
        context: bytes | None,
        more_input: bool,
        announce: bool,
        window: int,
    ) -> AsyncIterator[tuple[int, Any]]:
        """One request's outputs, a batch per item (call with ``num_returns="streaming"``).
        Cancelled (``ray.cancel``), it aborts the request in the backend before it ends."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        def post(item: tuple[int, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        running = self._portal.start_task_soon(
            self._host.run,
            request_id,
            first,
            params,
            streamed,
            context,
            more_input,
            announce,
            window,
            post,
        )
        running.add_done_callback(lambda _: post(_END))
        self._runs[request_id] = running
        running.add_done_callback(lambda _: self._runs.pop(request_id, None))
        try:
            item: tuple[int, Any] | None = await queue.get()
            while item is not _END:
                assert item is not None
                if item[0] != _OUTPUT:
                    yield item
                    item = await queue.get()
                    continue
                # every output posted by now crosses as one batch (one Ray object)
                outs = [item[1]]
                item = None
                while item is None and not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt[0] == _OUTPUT:
                        outs.append(nxt[1])
                    else:
                        item = nxt
                yield (BATCH, codec.encode_outputs(outs))
                self._portal.start_task_soon(_sync, self._host.ack, request_id, len(outs))
                if item is None:
                    item = await queue.get()
            running.result()  # a bug on the host side surfaces here
        except (asyncio.CancelledError, GeneratorExit):
            # dropped in the backend before this call ends (the caller waits for that)
            await self._on_host(self._host.abort, request_id)
            await asyncio.wrap_future(running)
            raise

    async def drop(self, request_id: str) -> None:
        """Abort a request in the backend and return once its run ended here (a no-op for
        one that already ended): what the caller waits for after ``ray.cancel``, which may
        end the caller's side of the stream before the actor's cleanup ran."""
        running = self._runs.get(request_id)
        if running is None:
            return
        await self._on_host(self._host.abort, request_id)
        try:
            await asyncio.wrap_future(running)
        except BaseException:  # its outcome went to its own stream
            pass

    async def send_input(self, request_id: str, chunks: bytes) -> bool:
        result: bool = await self._on_host(self._host.send_input, request_id, chunks)
        return result

    async def end_input(self, request_id: str) -> None:
        await self._on_host(self._host.end_input, request_id)

    async def rpc(self, method: str, args: bytes, kwargs: bytes) -> bytes:
        try:
            result: bytes = await self._on_host(self._host.rpc, method, args, kwargs)
        except Exception as exc:
            return codec.encode_value({"__error__": error_record(exc)})
        return result

    async def interact(self, request_id: str, payload: bytes) -> Any:
        try:
            return await self._on_host(self._host.interact, request_id, payload)
        except Exception as exc:
            return {"__error__": error_record(exc)}

    async def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()

    async def statistics(self) -> bytes:
        stats = self._host.backend.statistics()
        return codec.encode_value(
            {
                "alive": stats.alive,
                "requests_in_flight": stats.requests_in_flight,
                "state": stats.state,
            }
        )

    async def stop(self) -> str | None:
        """Stop the backend (bounded by its shutdown_timeout); its stop failure, if any.
        The startup heap is unfrozen either way."""
        try:
            if self._serving is not None:
                self._serving.cancel()
                try:
                    await asyncio.wrap_future(self._serving)
                except (concurrent.futures.CancelledError, asyncio.CancelledError):
                    pass
                except Exception as exc:
                    return f"{type(exc).__name__}: {exc}"
            failure = self._host.backend.stop_failure
            return None if failure is None else f"{type(failure).__name__}: {failure}"
        finally:
            self._heap.close()

    def close(self) -> None:
        """End the trio thread that hosts the replica (its portal); it waits for what still
        runs there, nothing once :meth:`stop` returned. Blocking. Ray ends an actor by
        ending its process, so only a host outside Ray (a test) calls this; a process that
        exits with the portal open cancels what runs there first (``stop_before_exit``)."""
        self._portal_cm.__exit__(None, None, None)


async def _sync(fn: Callable[..., None], *args: Any) -> None:
    fn(*args)
