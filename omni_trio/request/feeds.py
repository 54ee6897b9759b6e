"""Stage-to-stage feeds: upstream outputs of one request -> one downstream stage's input.

A :class:`StageFeed` belongs to one downstream stage of one request. The orchestrator hands
it each upstream stage's outputs (:meth:`StageFeed.take`) and tells it when an upstream
finished (:meth:`StageFeed.finish`); the feed runs the downstream stage's input processor.
A streaming feed (``stream_input``) sends each processed chunk into the downstream stage's
bounded input channel as it comes. Otherwise the feed collects the outputs and processes them
once every upstream finished (:meth:`StageFeed.final_chunk`): either it sends that chunk into
the channel of a stage already running, or (a *deferred* feed, with no channel) the
orchestrator starts the downstream stage with it only then. It never runs inside a backend's
call stack, so a processor that raises fails the request as a
:class:`~omni_trio.errors.StageError` of the *downstream* stage and counts against no replica
of the upstream one; a processor that rejects the request's input with
:class:`~omni_trio.errors.InvalidRequestError` fails it with that type, its message naming
the stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from ..errors import InvalidRequestError, StageError
from ..observer import ObserverSet, Transfer, payload_nbytes
from ..outputs import StageInput, StageOutput
from ..stages.processors import InputProcessor, StageContext

if TYPE_CHECKING:
    from ..context import RequestContext

__all__ = ["StageFeed", "StageInputs", "WholeInput"]


class WholeInput(trio.abc.ReceiveChannel[StageInput]):
    """A stage's whole input: one chunk (or none), then the end of the channel.

    What an entry stage, or a stage started once its input is complete, receives: it behaves
    like a closed memory channel holding that chunk, without a memory channel's shared state
    and parking lots (a few hundred bytes and microseconds less per stage a request runs).
    """

    __slots__ = ("_chunk", "_closed")

    def __init__(self, chunk: StageInput | None) -> None:
        self._chunk = chunk
        self._closed = False

    async def receive(self) -> StageInput:
        """The chunk, then ``trio.EndOfChannel``. Checkpoints as a memory channel's receive
        does (a cancellation point first; a schedule point when it returns the chunk).
        Raises ``trio.ClosedResourceError`` once closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise trio.ClosedResourceError("this stage input was closed")
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            raise trio.EndOfChannel
        await trio.lowlevel.cancel_shielded_checkpoint()
        return chunk

    def receive_nowait(self) -> StageInput:
        """The chunk, then ``trio.EndOfChannel``, as a memory channel's ``receive_nowait``
        (it never raises ``trio.WouldBlock``: the input is whole). Synchronous. Raises
        ``trio.ClosedResourceError`` once closed."""
        if self._closed:
            raise trio.ClosedResourceError("this stage input was closed")
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            raise trio.EndOfChannel
        return chunk

    def close(self) -> None:
        """Drop the chunk; later receives raise ``trio.ClosedResourceError``. Synchronous."""
        self._closed = True
        self._chunk = None

    async def aclose(self) -> None:
        """:meth:`close`, then a checkpoint."""
        self.close()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> WholeInput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: a stage's input as a request's run gives it: a channel (streamed input, or any stage while
#: observers watch) or its whole input
StageInputs = trio.MemoryReceiveChannel[StageInput] | WholeInput


class StageFeed:
    """Collects upstream outputs for one downstream stage of one request and sends its input.

    ``stream`` (the stage's ``stream_input``) sends one processed chunk per upstream delta;
    otherwise the outputs are collected and processed once every upstream finished.
    """

    __slots__ = (
        "_closed",
        "_collected",
        "_context",
        "_request_context",
        "_observers",
        "_options",
        "_order",
        "_pending",
        "_processor",
        "_send",
        "_stream",
        "onward",
        "request_id",
        "stage_id",
    )

    def __init__(
        self,
        stage_id: str,
        upstream: Sequence[str],
        *,
        stream: bool,
        processor: InputProcessor,
        options: Mapping[str, object],
        send: trio.MemorySendChannel[StageInput] | None,
        request_id: str,
        observers: ObserverSet,
        context: RequestContext | None = None,
    ) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self._request_context = context
        # the processor's view of the context, built on the first call (most processors
        # ignore it: no object per feed unless one is processed)
        self._context: StageContext | None = None
        self._observers = observers
        order = self._order = tuple(upstream)  # the same tuple if given one: no copy
        # a handful: no set per feed; one upstream (the usual case) is shared, not copied
        self._pending = order if len(order) == 1 else tuple(dict.fromkeys(order))
        self._stream = stream
        self._processor = processor
        self._options = options
        self._send = send
        #: the feeds of this feed's own stage (to the stages downstream of it)
        self.onward: Sequence[StageFeed] = ()
        self._collected: dict[str, list[StageOutput]] | None = None  # filled as outputs come
        self._closed = False

    def _process(
        self, upstream: Mapping[str, Sequence[StageOutput]], final: bool
    ) -> StageInput | None:
        context = self._context
        if context is None and self._request_context is not None:
            context = StageContext.of(self._request_context, self.stage_id)
            if not final:  # more calls come; the final one is the last
                self._context = context
        try:
            chunk = self._processor(upstream, final=final, options=self._options, context=context)
        except InvalidRequestError as exc:
            # the request's input is what is wrong (a 400, not a 500): its type stays
            raise InvalidRequestError(
                f"the input processor of stage {self.stage_id!r} rejected request "
                f"{self.request_id!r}: {exc}"
            ) from exc
        except Exception as exc:
            raise StageError(
                f"the input processor of stage {self.stage_id!r} failed for request "
                f"{self.request_id!r}: {type(exc).__name__}: {exc}",
                stage_id=self.stage_id,
                request_id=self.request_id,
            ) from exc
        if chunk is not None and not isinstance(chunk, StageInput):
            raise StageError(
                f"the input processor of stage {self.stage_id!r} returned "
                f"{type(chunk).__name__}, not a StageInput or None",
                stage_id=self.stage_id,
                request_id=self.request_id,
            )
        return chunk

    @property
    def deferred(self) -> bool:
        """Whether the downstream stage starts only once its input is complete: the feed has
        no channel, the orchestrator starts the stage with :meth:`final_chunk`."""
        return self._send is None

    @property
    def streams(self) -> bool:
        """Whether the downstream stage takes its input as it comes (``stream_input``)."""
        return self._stream

    def take(self, source: str, out: StageOutput) -> StageInput | None:
        """Take one output of upstream stage ``source``; the chunk to send now, if any.

        Synchronous. Raises StageError (naming this feed's stage) if the processor fails, or
        the InvalidRequestError it raised, naming the stage."""
        if self._closed:
            return None
        if self._stream:
            return self._process({source: (out,)}, final=False)
        if self._collected is None:
            self._collected = {}
        collected = self._collected.get(source)
        if collected is None:
            self._collected[source] = collected = []
        collected.append(out)
        return None

    def collect(self, source: str, outs: Sequence[StageOutput]) -> None:
        """Take every output of upstream stage ``source`` at once (a feed that does not
        stream: the chunk comes from :meth:`final_chunk`). Synchronous."""
        assert not self._stream, "a streaming feed takes each output as it comes"
        if self._closed:
            return
        if self._collected is None:
            self._collected = {}
        collected = self._collected.get(source)
        if collected is None:
            self._collected[source] = list(outs)
        else:
            collected.extend(outs)

    def finish(self, source: str) -> bool:
        """Upstream ``source`` finished. True when every upstream has: then send
        :meth:`final_chunk` with :meth:`send_final`. Synchronous."""
        pending = self._pending
        if len(pending) == 1:  # one upstream (the usual case): no generator
            if pending[0] == source:
                self._pending = ()
        else:
            self._pending = tuple(s for s in pending if s != source)
        return not self._pending

    def final_chunk(self) -> StageInput | None:
        """The last chunk, once every upstream finished. Raises like ``take``."""
        if self._closed:
            return None
        if self._stream:
            return self._process({}, final=True)
        collected, self._collected = self._collected or {}, None
        return self._process({u: collected.get(u, []) for u in self._order}, final=True)

    async def send(self, source: str, chunk: StageInput) -> None:
        """Send one chunk downstream. Checkpoints only when it has to wait: while the
        downstream input channel is full (backpressure); the routing loop that calls it
        checkpoints per output. A downstream stage that stopped reading closes the feed."""
        if self._closed:
            return
        observers = self._observers
        nbytes, ready = 0, 0.0
        if observers:
            nbytes = payload_nbytes(chunk.token_ids, chunk.prompt, chunk.data)
            observers.emit("transfer", self.request_id, source, self.stage_id, nbytes)
            ready = observers.clock()
        assert self._send is not None, "a deferred feed sends nothing: its stage starts later"
        try:
            try:
                self._send.send_nowait(chunk)
            except trio.WouldBlock:
                await self._send.send(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The downstream stage no longer reads its input: it finished on what it had,
            # or it ended otherwise (then the request's scope is cancelled, or it failed and
            # the request is failing). Either way nothing more goes there.
            self._closed = True
            return
        if observers:
            seconds = observers.clock() - ready
            sent = Transfer(source, self.stage_id, nbytes, len(chunk.token_ids), seconds)
            observers.emit("transfer_sent", self.request_id, sent)

    def handed_whole(self, chunk: StageInput | None) -> None:
        """A deferred stage starts on ``chunk``, its whole input: tell the observers, as
        :meth:`send` does of each chunk it sends. Synchronous."""
        observers = self._observers
        if not observers or chunk is None:
            return
        source = ",".join(self._order)
        nbytes = payload_nbytes(chunk.token_ids, chunk.prompt, chunk.data)
        observers.emit("transfer", self.request_id, source, self.stage_id, nbytes)
        sent = Transfer(source, self.stage_id, nbytes, len(chunk.token_ids), 0.0)
        observers.emit("transfer_sent", self.request_id, sent)

    async def send_final(self, chunk: StageInput | None) -> None:
        """Send the last chunk (if any) and close the downstream input. Checkpoints only when
        it has to wait (see :meth:`send`)."""
        if chunk is not None:
            await self.send(",".join(self._order), chunk)
        self._closed = True
        if self._send is not None:
            self._send.close()

    def close(self) -> None:
        """Close the downstream input without a final chunk (the request is ending)."""
        self._closed = True
        if self._send is not None:
            self._send.close()

    def __repr__(self) -> str:
        return (
            f"<StageFeed -> {self.stage_id!r} request={self.request_id!r} "
            f"waiting_for={sorted(self._pending)}{' closed' if self._closed else ''}>"
        )
