"""The ``torch`` backend: a torch module (a vocoder, a decoder) with dynamic batching.

The module runs in worker threads (``trio.to_thread.run_sync``), at most ``max_concurrency``
batches at once (a ``trio.CapacityLimiter``). Requests queue work items; a batcher task takes
them in FIFO order as one batch when ``max_batch_size`` are pending or the oldest has waited
``max_batch_delay_s`` on the trio clock
(:func:`~omni_trio.backends.torch.batching.decide_batch`), pads them to one ``LongTensor``,
runs the module once and routes each row back to its request.

Module protocol (what a ``factory`` must return)::

    forward(codes: LongTensor[B, T]) -> Tensor[B, T * hop_length, ...]
    sample_rate: int            (audio stages; reported in every output's metrics)
    hop_length: int | None      output frames per input code along dim 1; None: the output
                                row is one whole value (an image) and batches hold only
                                inputs of equal length
    vocab_size: int | None      codes outside [0, vocab_size) are rejected per request
    context_codes: int          left context (codes) a chunk needs to decode exactly as a
                                one-shot run does (default 0)
    frame_size: int             codes per frame (default 1): the module takes codes
                                [B, frame_size * T], hop_length counts outputs per frame,
                                and chunks and context hold whole frames
    output_delay: int           outputs (along dim 1) the module puts before the first
                                frame's own (a decoder that needs the next frame to finish
                                one returns its output shifted right); dropped from the start
                                of each request (default 0)

``forward`` must be causal along T (frame t depends on codes <= t): batches are right-padded
with code 0 and the padding frames cut off, so a request's result equals running it alone.
A request whose input ends inside a frame fails (:class:`StageError`).

Options (under the stage's ``options:``): ``factory`` (``"package.module:callable"``, or the
callable itself in a config built in Python; default the tiny vocoder's
:func:`~omni_trio.models.vocoder.build_vocoder`), ``max_batch_size`` (8),
``max_batch_delay_s`` (0.005), ``max_concurrency`` (1), ``chunk_size`` (16 codes per streamed
output chunk), ``torch_threads`` (``torch.set_num_threads``, process-wide; default:
leave); declared by :class:`~omni_trio.config.options.TorchOptions` and checked at load with
the factory's path (imported) and a ``weights`` file (must exist). Every other key
(``weights``, ``seed``, ...) goes to the factory as its options dict. ``sampling_params`` are
ignored.

With ``stream_input: true`` the stage decodes every ``chunk_size`` codes as they arrive and
emits each audio chunk at once (the remainder at the end), so audio starts before the talker
finishes. Outputs: ``StageOutput(data=numpy array, metrics={batch_size, batch_index,
compute_s, sample_rate, codes, chunk_index})``; the last one has ``finished=True``.

Cancellation: a request cancelled (or aborted) while its item waits for a batch is removed
from the queue and never runs; one cancelled while its batch runs gets nothing further (its
row is dropped, the rest of the batch is delivered). Stopping the replica cannot interrupt a
worker thread: ``serve`` returns only after the running batches have left the module (their
results are still delivered), and requests still queued end aborted. A module error in a
batch is retried per item, so it fails only the request that causes it (:class:`StageError`).

``collective_rpc`` methods: ``sample_rate``, ``hop_length``, ``vocab_size``, ``num_parameters``,
``describe`` (all of these as a dict) and ``batching_statistics``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ...config.options import TorchOptions, parse_torch_options, split_torch_options
from ...config.stage import StageConfig
from ...errors import BackendUnavailableError, ConfigError, StageError
from ...outputs import SamplingParams, StageInput, StageOutput
from ...stages.backend import StageBackend
from ...stages.emit import Emit
from ...stages.input_stream import InputStream
from .batching import BatchingStatistics, Pending, chunk_spans, context_window, decide_batch
from .worker import ModuleInfo, forward_batch, load_module

__all__ = ["TorchBackend", "TorchOptions", "codes_of", "parse_torch_options"]

_INSTALL_HINT = "pip install 'omni-trio[torch]'"


def codes_of(chunk: StageInput, vocab_size: int | None) -> list[int]:
    """The integer codes an input chunk carries (``token_ids``; or ``data`` as a sequence or
    array of ints, or a dict with ``codes``/``token_ids``/``prompt_token_ids``). Pure.

    Raises ValueError naming the problem: a text prompt, a non-integer code, a code outside
    ``[0, vocab_size)``.
    """
    raw: Any = chunk.token_ids
    if not raw and chunk.data is not None:
        raw = chunk.data
        if isinstance(raw, Mapping):
            key = next((k for k in ("codes", "token_ids", "prompt_token_ids") if k in raw), None)
            if key is None:
                raise ValueError(
                    f"input data dict has none of the keys codes/token_ids/prompt_token_ids "
                    f"(keys: {sorted(map(str, raw))})"
                )
            raw = raw[key]
        if hasattr(raw, "tolist"):
            raw = raw.tolist()  # numpy arrays and tensors
        if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
            raise ValueError(
                f"input data must be a sequence of integer codes, got {type(raw).__name__}"
            )
    if not raw and chunk.prompt:
        raise ValueError("a torch stage takes integer codes, not a text prompt")
    codes: list[int] = []
    for pos, code in enumerate(raw):
        if isinstance(code, bool) or not isinstance(code, int):
            if not (hasattr(code, "__index__") and not isinstance(code, float)):
                raise ValueError(f"code at position {pos} is {code!r}, not an integer")
            code = code.__index__()  # numpy integer scalars
        if code < 0 or (vocab_size is not None and code >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"code {code} at position {pos} is outside the vocabulary {bound}")
        codes.append(code)
    return codes


@dataclass(eq=False)
class _Item:
    """One span of one request waiting for (or in) a batch."""

    request_id: str
    window: tuple[int, ...]
    trim: int
    lead: int
    enqueued_at: float
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    error: BaseException | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    abandoned: bool = False


def _output(
    info: ModuleInfo, item: _Item | None, n_codes: int, chunk_index: int, last: bool
) -> StageOutput:
    metrics = dict(item.metrics) if item is not None else {"batch_size": 0, "compute_s": 0.0}
    metrics.update(codes=n_codes, chunk_index=chunk_index)
    if info.sample_rate is not None:
        metrics["sample_rate"] = info.sample_rate
    data = item.result if item is not None else info.empty()
    return StageOutput(
        data=data, finished=last, finish_reason="stop" if last else None, metrics=metrics
    )


class TorchBackend(StageBackend):
    """One replica of a torch stage. See the module docstring for the protocol and options."""

    backend_name = "torch"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
            raise BackendUnavailableError(
                f"stage {config.id!r}: the torch backend needs torch; {_INSTALL_HINT}"
            )
        self.options, self.factory_options = parse_torch_options(
            config.options, stage_index=stage_index
        )
        given = split_torch_options(config.options)[2]
        self.factory: str | Callable[[dict[str, Any]], Any] = given or self.options.factory
        self._info: ModuleInfo | None = None
        self._limiter = trio.CapacityLimiter(self.options.max_concurrency)
        self._pending: list[_Item] = []
        self._arrived = trio.Event()
        self._running_batches = 0
        self._batches_run = 0
        self._items_run = 0
        self._largest_batch = 0
        self._dropped_pending = 0
        self._dropped_running = 0
        self._compute_s = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    async def _start(self) -> None:
        info = await trio.to_thread.run_sync(
            load_module, self.factory, self.factory_options, self.options.torch_threads
        )
        if self.options.chunk_size % info.frame_size:
            raise ConfigError(
                f"stage {self.name}: options.chunk_size={self.options.chunk_size} is not a "
                f"whole number of frames (the module's frame_size is {info.frame_size} codes)"
            )
        self._info = info
        self.mark_phase("model_loaded")

    async def _serve_forever(self) -> None:
        async with trio.open_nursery() as nursery:
            await self._batcher(nursery)

    async def _stop(self) -> None:
        # Every batch task lived in _serve_forever's nursery, which waited for its worker
        # thread; nothing of ours can outlive serve. Drop the module so its memory goes.
        self._info = None
        await trio.lowlevel.checkpoint()

    # -- batching ------------------------------------------------------------------------
    async def _batcher(self, nursery: trio.Nursery) -> None:
        assert self._info is not None
        same_length = self._info.hop_length is None
        while True:
            token = object()
            # Hold a worker slot before deciding: while every slot is busy, items pile up
            # and the next batch is fuller.
            await self._limiter.acquire_on_behalf_of(token)
            try:
                while True:
                    decision = decide_batch(
                        [Pending(it.enqueued_at, len(it.window)) for it in self._pending],
                        trio.current_time(),
                        max_batch_size=self.options.max_batch_size,
                        max_batch_delay_s=self.options.max_batch_delay_s,
                        same_length=same_length,
                    )
                    if decision.take:
                        break
                    self._arrived = trio.Event()
                    deadline = decision.wake_at if decision.wake_at is not None else float("inf")
                    with trio.move_on_at(deadline):
                        await self._arrived.wait()
            except BaseException:
                self._limiter.release_on_behalf_of(token)
                raise
            chosen = set(decision.take)
            batch = [self._pending[i] for i in decision.take]
            self._pending = [it for i, it in enumerate(self._pending) if i not in chosen]
            self._running_batches += 1
            nursery.start_soon(self._run_batch, batch, token)

    async def _run_batch(self, batch: list[_Item], token: object) -> None:
        assert self._info is not None
        info = self._info
        self._batches_run += 1
        index = self._batches_run
        try:
            started = time.perf_counter()
            # Not abandoned on cancel: serve waits for the thread, so none outlives it.
            results = await trio.to_thread.run_sync(
                forward_batch, info, [(it.window, it.trim, it.lead) for it in batch]
            )
            compute_s = time.perf_counter() - started
        finally:
            self._running_batches -= 1
            self._limiter.release_on_behalf_of(token)
        self._items_run += len(batch)
        self._largest_batch = max(self._largest_batch, len(batch))
        self._compute_s += compute_s
        for item, result in zip(batch, results, strict=True):
            if item.abandoned:
                self._dropped_running += 1
                continue
            if isinstance(result, BaseException):
                item.error = result
            else:
                item.result = result
            item.metrics = {"batch_size": len(batch), "batch_index": index, "compute_s": compute_s}
            item.done.set()

    async def _decode(
        self, request_id: str, window: tuple[int, ...], trim: int, lead: int
    ) -> _Item:
        item = _Item(request_id, window, trim, lead, trio.current_time())
        self._pending.append(item)
        self._arrived.set()
        finished = False
        try:
            await item.done.wait()
            finished = True
        finally:
            if not finished:
                item.abandoned = True
                if item in self._pending:
                    self._pending.remove(item)  # never runs
                    self._dropped_pending += 1
        if item.error is not None:
            raise StageError(
                f"stage {self.name}: the module failed request {request_id!r}: "
                f"{type(item.error).__name__}: {item.error}",
                stage_id=self.stage_id,
                request_id=request_id,
            ) from item.error
        return item

    # -- requests ------------------------------------------------------------------------
    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        assert self._info is not None
        info = self._info
        streaming = self.config.stream_input and info.hop_length is not None
        size = info.frame_size  # spans, chunks and context count whole frames
        chunk_size = self.options.chunk_size // size if streaming else None
        codes: list[int] = []
        done = 0
        chunk_index = 0
        final = False
        finished = False
        while not final:
            try:
                chunk = await inputs.receive()
            except trio.EndOfChannel:
                final = True
            else:
                final = chunk.final
                try:
                    new = codes_of(chunk, info.vocab_size)
                except ValueError as exc:
                    raise StageError(
                        f"stage {self.name}: request {request_id!r}: invalid input "
                        f"(after {len(codes)} codes): {exc}",
                        stage_id=self.stage_id,
                        request_id=request_id,
                    ) from None
                codes.extend(new)
            if final and len(codes) % size:
                raise StageError(
                    f"stage {self.name}: request {request_id!r}: the input ended inside a "
                    f"frame ({len(codes)} codes; frames are {size} codes)",
                    stage_id=self.stage_id,
                    request_id=request_id,
                )
            frames = len(codes) // size
            for start, end in chunk_spans(done, frames, chunk_size=chunk_size, final=final):
                window_start, trim = context_window(start, end, info.context_codes // size)
                window = tuple(codes[window_start * size : end * size])
                lead = info.output_delay if start == 0 else 0
                item = await self._decode(request_id, window, trim, lead)
                done = end
                last = final and end == frames
                await emit(_output(info, item, (end - start) * size, chunk_index, last))
                chunk_index += 1
                finished = last
        if not finished:
            # no codes at all, or the final chunk brought none: close with an empty output
            await emit(_output(info, None, 0, chunk_index, True))

    # -- control -------------------------------------------------------------------------
    async def _rpc(
        self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        info = self._info
        assert info is not None
        described = info.describe()
        if method in described:
            return described[method]
        if method == "describe":
            return described
        if method == "batching_statistics":
            return self.batching_statistics()
        return await super()._rpc(method, args, kwargs)

    def batching_statistics(self) -> BatchingStatistics:
        """A frozen snapshot of this replica's batcher. Does not checkpoint."""
        return BatchingStatistics(
            pending=len(self._pending),
            running_batches=self._running_batches,
            batches_run=self._batches_run,
            items_run=self._items_run,
            largest_batch=self._largest_batch,
            dropped_pending=self._dropped_pending,
            dropped_running=self._dropped_running,
            compute_s=self._compute_s,
        )

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        return (
            f"{base} pending={len(self._pending)} running_batches={self._running_batches} "
            f"batches_run={self._batches_run}>"
        )
