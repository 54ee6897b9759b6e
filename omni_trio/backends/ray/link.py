"""The process's link to Ray: the connection, and one asyncio loop where Ray calls are awaited.

Ray's client API is asyncio-native (an ``ObjectRef`` and a streaming ``ObjectRefGenerator``
are awaitable there) or blocking. Rather than a thread per pending call, every Ray call of
this process is awaited on one asyncio loop (a ``transport.loop_host.LoopHost``) in the link's
own thread (:class:`RayLink`); the trio side waits for the result on an event set through
``TrioToken.run_sync_soon`` (:func:`wait_future`), so a thousand requests in flight cost a
thousand asyncio tasks, not a thousand threads. Output streams come back batched and bounded
(:class:`RemoteStream`).

The link's thread connects, hosts the loop and disconnects: it must be the thread that starts
a local Ray, and live as long as that Ray should. Ray starts its GCS and raylet with
``PR_SET_PDEATHSIG``, which Linux fires when the *thread* that forked them exits, so a Ray
started from a short-lived thread (trio's worker threads exit after 10 s idle) is killed under
the engine while it runs. The thread is not a daemon: it ends when the last user releases the
link, or, for a link still held when the interpreter exits, by an orderly disconnect before
the interpreter waits for its threads (``loop_host.stop_before_exit``): the calls still
pending are cancelled and a local Ray is shut down.

The connection is shared and counted: the first replica that needs Ray connects (``address``:
an existing cluster; ``None``: a local Ray started for this process, with this machine's CPUs)
and the last one to stop disconnects, shutting a local Ray down (its processes exit). One
address per process: a second, different one is refused.

A cluster's ``host:port`` is probed first: ``ray.init`` against an address where nothing
listens keeps retrying (Ray 2.60: 20 tries of ~41 s each; still trying after 5 minutes when
measured), and so does one against a server that is not Ray's; a worker thread blocked in it
cannot be cancelled, so the stage's init timeout could not end the wait. The probe opens a TCP
connection and sends the HTTP/2 connection preface: Ray's GCS and a Ray Client server are gRPC
servers and answer with a SETTINGS frame; anything else (an HTTP/1.1 answer, a closed
connection, silence) fails the start at once, naming what answered. With ``RAY_USE_TLS`` set
only the TCP connection is probed (the TLS handshake is ``ray.init``'s).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import trio

from ...errors import BackendUnavailableError, ConfigError, StageStartError
from ...transport.loop_host import LoopHost, stop_before_exit

__all__ = ["RayLink", "RemoteStream", "wait_future"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the link's thread, which hosts its loop (and started a local Ray)
THREAD_NAME = "omni-trio-ray-link"
# ray.shutdown of a local Ray takes ~1-2 s; a link that has not disconnected by then is stuck
SHUTDOWN_TIMEOUT_S = 60.0
#: seconds a cluster's address may take to accept a TCP connection (a host that drops it),
#: and then to answer the HTTP/2 preface
PROBE_TIMEOUT_S = 10.0
#: the HTTP/2 client connection preface, then an empty SETTINGS frame: a gRPC server's first
#: frame in return is its own SETTINGS frame (RFC 9113, section 3.4)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0))
_H2_FRAME_HEAD = 9  # bytes: length (3), type (1), flags (1), stream id (4)
_H2_SETTINGS = 4  # the SETTINGS frame type


def cluster_endpoint(address: str | None) -> tuple[str, int] | None:
    """The ``(host, port)`` that must accept a connection for ``address`` to be a cluster
    (``"head:6379"``, ``"ray://head:10001"``, ``"[::1]:6379"``), or ``None`` when there is
    nothing to probe (a local Ray, ``"auto"``, no numeric port: ``ray.init`` judges). Pure."""
    if address is None:
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


class RayLink:
    """The Ray connection of this process and its asyncio loop. See the module docstring."""

    _lock = threading.Lock()
    _current: RayLink | None = None

    def __init__(self, address: str | None) -> None:
        try:
            import ray
        except ImportError as exc:
            raise BackendUnavailableError(
                f"a stage placed on Ray needs ray ({exc.name or exc}); install omni-trio[ray]"
            ) from exc
        self.ray: Any = ray
        self.address = address
        self.users = 0
        self.started_ray = False
        #: the loop where Ray calls are awaited
        self.host = LoopHost("asyncio", name=THREAD_NAME)
        self._connected: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._disconnected: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._own, name=THREAD_NAME)
        self._withdraw_exit_stop: Callable[[], None] = lambda: None

    # -- ownership (blocking: call from a worker thread) -------------------------------------
    @classmethod
    def acquire(cls, address: str | None, *, stage_id: str) -> RayLink:
        """Connect (or share the connection) for stage ``stage_id``: ``ray.init`` the first
        time (~2 s for a local Ray). Blocking. Raises StageStartError (from the cause) when no
        cluster answers at ``address`` (within PROBE_TIMEOUT_S) or ``ray.init`` fails, with
        no thread or Ray process of ours left; ConfigError for a second, different address;
        BackendUnavailableError without ray."""
        with cls._lock:
            link = cls._current
            if link is None:
                endpoint = cluster_endpoint(address)
                if endpoint is not None:
                    _probe(address, endpoint, stage_id)
                link = RayLink(address)
                try:
                    link._connect()
                except Exception as exc:
                    where = f"the Ray cluster at {address}" if address else "a local Ray"
                    raise StageStartError(
                        stage_id,
                        f"cannot connect to {where} (placement.ray.address): "
                        f"ray.init raised {type(exc).__name__}: {exc}",
                    ) from exc
                cls._current = link
            elif link.address != address:
                raise ConfigError(
                    f"this process is connected to Ray at {link.address or 'a local Ray'}; "
                    f"stage {stage_id!r} asks for {address or 'a local Ray'} (one Ray per process)"
                )
            link.users += 1
            return link

    def _connect(self) -> None:
        self._thread.start()
        try:
            self._connected.result()  # what ray.init raised, raised here
        except BaseException:
            self._thread.join()  # it ends right after a failed ray.init: none is left
            raise
        self._withdraw_exit_stop = stop_before_exit(self._stop_at_exit, name=repr(self))

    def _own(self) -> None:
        # The link's thread: it connects, hosts the loop and disconnects, so that a local Ray
        # lives exactly as long as it (the module docstring)
        ray = self.ray
        try:
            if not ray.is_initialized():
                kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
                if self.address is None:
                    # "local": a new Ray even when `ray start` left a cluster on this
                    # machine (ray.init() alone would join that one)
                    kwargs["address"] = "local"
                    kwargs["num_cpus"] = os.cpu_count() or 1
                else:
                    kwargs["address"] = self.address
                ray.init(**kwargs)
                self.started_ray = True
        except BaseException as exc:
            self._connected.set_exception(self._undo_failed_init(exc))
            return
        self._connected.set_result(None)
        try:
            # until release() stops it; calls still waiting then (on a killed, hung actor)
            # are cancelled as the loop closes, and their callers' futures with them
            self.host.run(self.host.wait_for_stop)
            if self.started_ray:
                ray.shutdown()
        except BaseException as exc:
            self._disconnected.set_exception(exc)
        else:
            self._disconnected.set_result(None)

    def _undo_failed_init(self, exc: BaseException) -> BaseException:
        # a local Ray whose init failed half-way may have started processes: ray.shutdown
        # stops them (a no-op when nothing started); the loop never ran
        try:
            self.ray.shutdown()
        except BaseException as stop_exc:
            return BaseExceptionGroup("ray.init failed, then ray.shutdown", [exc, stop_exc])
        return exc

    def release(self) -> None:
        """One user fewer; the last one disconnects (a local Ray it started is shut down and
        its processes exit). Blocking; raises what ``ray.shutdown`` raised."""
        with RayLink._lock:
            self.users -= 1
            if self.users > 0:
                return
            RayLink._current = None
        self._withdraw_exit_stop()
        self._disconnect()

    def _disconnect(self) -> None:
        self.host.stop()
        self._disconnected.result(timeout=SHUTDOWN_TIMEOUT_S)
        self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)

    def _stop_at_exit(self) -> None:
        # the interpreter exits with the link still held (an engine never closed): its
        # users are gone with the program, so disconnect now, before the interpreter waits
        # for the link's thread
        with RayLink._lock:
            if RayLink._current is self:
                RayLink._current = None
        self._disconnect()

    # -- calls -----------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the link's loop. Thread-safe, never blocks. Raises
        ``RuntimeError`` once the link has disconnected."""
        return self.host.submit(coro)

    async def call(self, ref: Any) -> Any:
        """Await one ObjectRef from trio. Checkpoints; cancelled, it stops waiting (the remote
        call is not cancelled: use ``ray.cancel`` for that)."""
        return await wait_future(self.submit(_awaited(ref)))

    def cancel(self, ref: Any) -> None:
        """``ray.cancel`` a call or stream, on the link's loop (nothing once the link has
        disconnected). Thread-safe, never blocks."""
        self.host.call_soon_threadsafe(self._cancel, ref)

    def _cancel(self, ref: Any) -> None:
        try:
            self.ray.cancel(ref)
        except Exception as exc:  # an ended call cannot be cancelled: nothing to do
            logger.debug("ray.cancel: %r", exc)

    def __repr__(self) -> str:
        where = self.address or "local"
        return f"<RayLink {where} users={self.users}{' started' if self.started_ray else ''}>"


def _probe(address: str | None, endpoint: tuple[str, int], stage_id: str) -> None:
    # Blocking, bounded by PROBE_TIMEOUT_S twice (connect, answer). See the module docstring.
    no_cluster = f"no Ray cluster answers at {address} (placement.ray.address)"
    where = f"{endpoint[0]}:{endpoint[1]}"
    try:
        sock = socket.create_connection(endpoint, timeout=PROBE_TIMEOUT_S)
    except OSError as exc:
        raise StageStartError(
            stage_id,
            f"{no_cluster}: a TCP connection to {where} failed within {PROBE_TIMEOUT_S:g}s: "
            f"{type(exc).__name__}: {exc}",
        ) from exc
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return
        try:
            sock.sendall(_H2_PREFACE)
            head = _receive_up_to(sock, _H2_FRAME_HEAD)
        except TimeoutError as exc:
            raise StageStartError(
                stage_id,
                f"{no_cluster}: {where} accepted a TCP connection but did not answer an HTTP/2 "
                f"preface within {PROBE_TIMEOUT_S:g}s, as Ray's gRPC servers do",
            ) from exc
        except OSError as exc:  # reset or broken pipe: it hung up
            raise _not_grpc(stage_id, no_cluster, where, f"closed the connection ({exc})") from exc
    if len(head) < _H2_FRAME_HEAD or head[3] != _H2_SETTINGS:
        answer = f"answered {head!r}" if head else "closed the connection"
        raise _not_grpc(stage_id, no_cluster, where, answer)


def _not_grpc(stage_id: str, no_cluster: str, where: str, answer: str) -> StageStartError:
    return StageStartError(
        stage_id,
        f"{no_cluster}: {where} accepted a TCP connection but does not speak HTTP/2 (gRPC) as "
        f"Ray's servers do: to the HTTP/2 preface it {answer}",
    )


def _receive_up_to(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes from ``sock``: fewer only if the peer closed. Blocking (the socket's
    timeout bounds each read)."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return got


async def _awaited(ref: Any) -> Any:
    return await ref


async def wait_future(fut: concurrent.futures.Future[T]) -> T:
    """Wait in trio for a future completed in another thread. Checkpoints; cancelled, the
    future is cancelled (its asyncio task too) and the cancellation propagates."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    fut.add_done_callback(wake)
    try:
        await done.wait()
    except trio.Cancelled:
        fut.cancel()
        raise
    return fut.result()


class RemoteStream:
    """One remote streaming call's items, consumed on the link's loop and handed to trio, at
    most ``window`` taken from Ray and not yet received here (backpressure reaches the actor
    through Ray's own generator backpressure).

    ``receive()`` (trio) returns the next item and raises ``trio.EndOfChannel`` at the end,
    or what the stream raised. ``cancel()`` asks Ray to cancel the call; the stream then ends.
    """

    def __init__(self, link: RayLink, gen: Any, window: int, decode: Callable[[Any], T]) -> None:
        self._link = link
        self._gen = gen
        self._window = max(window, 1)
        self._decode = decode
        self._items: deque[Any] = deque()
        self._ended: BaseException | None = None
        self._done = False
        self._token = trio.lowlevel.current_trio_token()
        self._ready = trio.Event()  # set when items or the end are here
        self._room = asyncio.Event()  # (link loop) the trio side took items
        self._task = link.submit(self._pump())

    async def _pump(self) -> None:
        try:
            async for ref in self._gen:
                item = await ref
                while len(self._items) >= self._window:
                    self._room.clear()
                    await self._room.wait()
                self._items.append(item)
                self._wake()
        except BaseException as exc:  # the stream's failure or cancellation, kept for trio
            self._ended = exc
        self._done = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._token.run_sync_soon(self._ready.set)
        except trio.RunFinishedError:
            pass

    async def receive(self) -> Any:
        """The next item (decoded). Checkpoints."""
        while not self._items:
            if self._done:
                await trio.lowlevel.checkpoint()
                if self._ended is not None and not isinstance(self._ended, StopAsyncIteration):
                    raise self._ended
                raise trio.EndOfChannel
            self._ready = trio.Event()
            if self._items or self._done:
                continue
            await self._ready.wait()
        item = self._items.popleft()
        self._link.host.call_soon_threadsafe(self._room.set)
        await trio.lowlevel.checkpoint()
        return self._decode(item)

    def cancel(self) -> None:
        """``ray.cancel`` the call. Thread-safe, never blocks."""
        self._link.cancel(self._gen)

    @property
    def done(self) -> bool:
        return self._done

    async def wait_done(self) -> None:
        """Wait until the stream ended (items left are dropped). Checkpoints."""
        while not self._done:
            self._ready = trio.Event()
            if self._done:
                break
            await self._ready.wait()
        await trio.lowlevel.checkpoint()
