"""The ``scripted`` backend: a deterministic, model-free stage that behaves like a real one.

It is a product feature: users test their applications against it. Everything it does is on
the trio clock, so under ``trio.testing.MockClock(autojump_threshold=0)`` a whole pipeline with
latencies, hangs and crashes runs instantly and deterministically.

Options (under the stage's ``options:``):

``outputs`` (int, 8)            outputs per request, the last one ``finished``
``latency_s`` (float, 0)        trio-clock delay before each output
``fail_at_output`` (int|null)   raise a request-scoped :class:`StageError` at that output (0-based)
``crash_at_request`` (int|null) the replica dies at its n-th request (1-based), failing every
                                request bound to it with :class:`ReplicaDeadError`
``crash_replica`` (int|null)    only this replica index crashes (default: every replica)
``hang`` (bool)                 requests never produce an output (until cancelled)
``start_delay_s`` (float, 0)    trio-clock delay before the replica reports ready
``fail_start`` (bool)           start-up raises
``stop_delay_s`` (float, 0)     trio-clock delay while stopping
``abort_delay_s`` (float, 0)    trio-clock delay of a request's abort cleanup: a cancelled
                                request waits this long, shielded, before it lets the
                                cancellation through (a real engine's slow abort)
``token_offset`` (int, 1)       see below
``audio_samples`` (int, 0)      each output carries this many samples of silence as ``data``
                                (a tuple of floats) and ``metrics["sample_rate"]``: an audio
                                stage with known packet lengths (0: no audio)
``sample_rate`` (int, 16000)    the sample rate those outputs report
``record`` (int|false, 10000)   how many entries the records below keep (the most recent);
                                ``false``: none, so a long-running scripted server stays flat
``omit_kv_params_at_request``,  a prefill stage's n-th request (1-based) finishes without
``malformed_kv_params_at_request``  ``kv_transfer_params``, or with ones that are no mapping
(int|null)
``require_kv_params`` (bool)    a request whose sampling params bring no
                                ``kv_transfer_params`` with ``do_remote_prefill`` fails

They are declared by :class:`~omni_trio.config.options.ScriptedOptions` and checked when the
config is loaded. A stage's stop is bounded by the stage key ``shutdown_timeout``.

What flows where: a request's input token ids ``T`` are the entry prompt's UTF-8 bytes (text
prompts) or the token ids it was given. Output ``k`` carries ``token_ids == (T[k % len(T)] +
token_offset,)`` and ``text == f"{stage_id}:{token} "``. So a chain of scripted stages adds
``token_offset`` per hop, and a test can tell which stage's output reached which stage. The
finished output carries ``metrics == {"output_index": k, "prompt_token_ids": T}`` (a vllm
stage's finished output carries its prompt's ids too); the others carry none. With
``stream_input: true`` output ``k`` is produced as soon as input token ``k`` has arrived. A
request whose outputs nobody needs as they come (``outputs_streamed`` is false: no caller
reads the stage and no ``stream_input`` stage takes them) gets its finished output only,
carrying every token and the whole text, at the time its last output would have come: a vllm
stage asks vLLM for ``FINAL_ONLY`` output then.

Prefill/decode pairs (:mod:`omni_trio.config.pd`): a scripted stage stands in for a vLLM
engine with a KV connector. A request whose sampling params bring
``extra_args.kv_transfer_params`` with ``do_remote_decode`` (what a prefill stage is sent)
finishes with ``metrics["kv_transfer_params"]`` naming the replica and the request
(``remote_engine_id``, ``remote_request_id``, its ``transfer_id``); a decode stage's
``sampling`` record shows the params it was given, ``received`` its input.

Interactions (``engine.interact`` / ``stream.interact``): ``{"stop": True}`` finishes the
request now: it cuts short the wait the request is in (its input, its latency, a hang), and
its next output is its finished one, empty (with the tokens so far when the outputs go out
whole), with ``finish_reason="stop"``. A stop that
arrives while the request is not waiting (an output is being delivered, or a zero-latency
stage is at its schedule point before one) takes effect right after that output. Every
interaction, the stop included, is recorded.

``received[request_id]`` records the input chunks a request brought, ``sampling[request_id]``
the sampling params it brought (a one-item list), ``interactions[request_id]``
the interactions it received, ``aborted`` the ids that were cancelled before finishing,
``completed`` those that finished (each keeps the last ``record`` entries;
``completed == ["r"]`` compares like a list); ``collective_rpc``
answers ``echo`` (returns its args), ``sleep`` (sleeps ``args[0]`` seconds, returns it),
``hang`` (never returns), ``stats`` (the replica's statistics) and ``fail`` (raises).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, SupportsFloat, TypeVar, cast, overload

import trio

from ..config.options import ScriptedOptions, parse_options
from ..config.stage import StageConfig
from ..errors import StageError
from ..outputs import SamplingParams, StageInput, StageOutput
from ..stages.backend import StageBackend
from ..stages.emit import Emit, nowait_of
from ..stages.input_stream import InputStream

__all__ = ["RecentList", "ScriptedBackend", "input_tokens", "kv_params_brought", "scripted_tokens"]

T = TypeVar("T")


class RecentList(Sequence[str]):
    """The last ``limit`` items appended (oldest first); equal to any sequence of the same
    items, so ``backend.completed == ["r"]`` reads naturally in tests."""

    def __init__(self, limit: int) -> None:
        self._items: deque[str] = deque(maxlen=limit)

    def append(self, item: str) -> None:
        self._items.append(item)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return list(self._items)[index]
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RecentList, list, tuple, deque)):
            return list(self._items) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RecentList({list(self._items)!r}, limit={self._items.maxlen})"


class _Recent(dict[str, list[T]]):
    """Request id -> what it brought (input chunks, interactions), for the ``limit`` most
    recent requests."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def start(self, request_id: str) -> list[T]:
        chunks = self.get(request_id)
        if chunks is not None:
            return chunks
        chunks = []
        if self.limit:
            while len(self) >= self.limit:
                del self[next(iter(self))]  # dicts keep insertion order: the oldest
            self[request_id] = chunks
        return chunks


class _Live:
    """A request running on a scripted replica, as its interactions see it."""

    __slots__ = ("parked", "stop", "waiting")

    def __init__(self) -> None:
        self.stop = False  # a stop interaction came
        # the scope of the wait the request is in (its input, its latency), if any: a stop
        # cancels it. Entered only around a wait (a cancel scope costs microseconds to enter
        # and exit, and most zero-latency runs never wait), so a stop that comes while the
        # request is not waiting (it is delivering an output, or at a schedule point) takes
        # effect once that output is delivered.
        self.waiting: trio.CancelScope | None = None
        # the task parked in a hang (a stop wakes it). A hang holds no cancel scope, as a
        # request queued in a real engine holds none: a held request costs the heap that
        # bench_orchestrator measures as omni-trio's, not the fake's.
        self.parked: trio.lowlevel.Task | None = None

    def wait_scope(self) -> trio.CancelScope:
        """The scope for one wait, already cancelled if a stop came. Synchronous."""
        scope = self.waiting = trio.CancelScope()
        if self.stop:
            scope.cancel()
        return scope

    async def hang(self) -> None:
        """Park until a stop (:meth:`wake`) or a cancellation. Always checkpoints. Called
        first thing, before any checkpoint: no stop can have come yet."""
        self.parked = trio.lowlevel.current_task()
        try:
            await trio.lowlevel.wait_task_rescheduled(self._abort_hang)
        finally:
            self.parked = None

    def _abort_hang(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self.parked = None  # trio wakes it with the Cancelled: a stop must not wake it again
        return trio.lowlevel.Abort.SUCCEEDED

    def wake(self) -> None:
        """A stop came: cut short the wait or the hang the request is in. Synchronous."""
        self.stop = True
        if self.waiting is not None:
            self.waiting.cancel()
        if self.parked is not None:
            trio.lowlevel.reschedule(self.parked)
            self.parked = None


def scripted_tokens(inputs: Sequence[int], n_outputs: int, offset: int = 1) -> list[int]:
    """The token each output of a scripted stage carries, given its input tokens (pure)."""
    if not inputs:
        return [offset + k for k in range(n_outputs)]
    return [inputs[k % len(inputs)] + offset for k in range(n_outputs)]


def _done_metrics(
    k: int, prompt: Sequence[int], kv: object, audio_metrics: dict[str, object] | None = None
) -> dict[str, object]:
    """A finished output's metrics: its index, its prompt's ids, an audio stage's packet
    metrics, and the ``kv_transfer_params`` of a prefill (``kv``; None: none). Pure."""
    metrics: dict[str, object] = {
        "output_index": k,
        "prompt_token_ids": tuple(prompt),
        **(audio_metrics or {}),
    }
    if kv is not None:
        metrics["kv_transfer_params"] = kv
    return metrics


def _whole(
    stage_id: str,
    tokens: Sequence[int],
    reason: str,
    k: int,
    prompt: Sequence[int],
    kv: object = None,
    audio: tuple[float, ...] | None = None,
    audio_metrics: dict[str, object] | None = None,
) -> StageOutput:
    """A finished output carrying ``tokens`` (none: an empty stop output) and, for an audio
    stage, a packet's samples per token. Pure."""
    return StageOutput(
        token_ids=tuple(tokens),
        text="".join(f"{stage_id}:{token} " for token in tokens),
        data=audio * len(tokens) if audio and tokens else None,
        finished=True,
        finish_reason=reason,
        metrics=_done_metrics(k, prompt, kv, audio_metrics),
    )


def kv_params_brought(sampling_params: SamplingParams) -> Mapping[str, object] | None:
    """The ``kv_transfer_params`` a request's sampling params bring (in ``extra_args``, as
    vLLM reads them), or None. Pure."""
    if not isinstance(sampling_params, Mapping):
        return None
    extra = sampling_params.get("extra_args")
    kv = extra.get("kv_transfer_params") if isinstance(extra, Mapping) else None
    return kv if isinstance(kv, Mapping) else None


def input_tokens(chunk: StageInput) -> tuple[int, ...]:
    """The token ids an input chunk brings: its ``token_ids``, else its ``prompt``'s UTF-8
    bytes, else ``data["prompt_token_ids"]``, else ``data["prompt"]``'s UTF-8 bytes; none
    if it has none of them. Pure."""
    if chunk.token_ids:
        return chunk.token_ids
    if chunk.prompt is not None:
        return tuple(chunk.prompt.encode("utf-8"))
    if isinstance(chunk.data, dict):
        ids = chunk.data.get("prompt_token_ids")
        if ids is not None:
            return tuple(int(t) for t in ids)
        if isinstance(chunk.data.get("prompt"), str):
            return tuple(chunk.data["prompt"].encode("utf-8"))
    return ()


class ScriptedBackend(StageBackend):
    """A deterministic, model-free stage replica. See the module docstring for its options."""

    backend_name = "scripted"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        self.options: ScriptedOptions = parse_options(
            ScriptedOptions,
            config.options,
            where=f"$.stages[{stage_index}].options",
            backend="scripted",
        )
        limit = self.options.record_limit
        self.received: _Recent[StageInput] = _Recent(limit)
        self.sampling: _Recent[object] = _Recent(limit)
        self.aborted = RecentList(limit)
        self.completed = RecentList(limit)
        #: request id -> the interactions it received, in order (the ``record`` most recent
        #: requests)
        self.interactions: _Recent[Any] = _Recent(limit)
        self._live: dict[str, _Live] = {}
        self.requests_seen = 0
        # what every output of an audio stage carries (one shared tuple: no copy per output)
        n = self.options.audio_samples
        self._audio: tuple[float, ...] | None = (0.0,) * n if n else None
        self._audio_metrics: dict[str, object] | None = (
            {"sample_rate": self.options.sample_rate} if n else None
        )

    async def _start(self) -> None:
        await trio.sleep(self.options.start_delay_s)
        if self.options.fail_start:
            raise StageError(
                f"scripted stage {self.name} was configured with fail_start: true",
                stage_id=self.stage_id,
            )

    async def _stop(self) -> None:
        await trio.sleep(self.options.stop_delay_s)

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        self.requests_seen += 1
        crash_at = self.options.crash_at_request
        crash_here = self.options.crash_replica in (None, self.replica)
        if crash_at is not None and crash_here and self.requests_seen >= crash_at:
            self._die(
                StageError(
                    f"scripted crash at request {self.requests_seen}", stage_id=self.stage_id
                )
            )
            await trio.lowlevel.checkpoint()  # the scope is cancelled: this raises
        n_outputs = self.options.outputs
        self.sampling.start(request_id).append(sampling_params)
        kv_out = self._kv_params(request_id, kv_params_brought(sampling_params))
        if isinstance(sampling_params, dict) and "max_tokens" in sampling_params:
            n_outputs = min(n_outputs, int(sampling_params["max_tokens"]))
        fail_at = self.options.fail_at_output
        latency = self.options.latency_s
        offset = self.options.token_offset
        chunks = self.received.start(request_id)
        tokens: list[int] = []
        input_done = False
        # a whole input (or a chunk already queued) is taken without waiting
        receive_nowait = getattr(inputs, "receive_nowait", None)
        live = self._live[request_id] = _Live()
        # the emit's fast path: an output delivered at once needs no awaited emit (its
        # coroutines); the awaited one decides every other case (waits, aborts, raises)
        nowait = nowait_of(emit)
        # nobody needs the outputs as they come: its tokens go out whole, in the finished one
        final_only = not self.outputs_streamed(request_id)
        held: list[int] = []
        k = 0
        # a stop cut a wait short: output k is the stop output
        stopped = False
        try:
            if self.options.hang:
                await live.hang()
                stopped = True  # only a stop ends the hang
            for k in range(0 if stopped else n_outputs):
                # wait until input token k is here (streamed input) or the input is complete
                while not input_done and len(tokens) <= k:
                    try:
                        if receive_nowait is None:
                            raise trio.WouldBlock
                        chunk = receive_nowait()
                    except trio.WouldBlock:
                        with live.wait_scope() as scope:
                            chunk = await inputs.receive()
                        if scope.cancelled_caught:
                            stopped = True
                            break
                    except trio.EndOfChannel:
                        input_done = True
                        break
                    chunks.append(chunk)
                    tokens.extend(input_tokens(chunk))
                    input_done = chunk.final
                if stopped:
                    break
                if latency:
                    with live.wait_scope() as scope:
                        await trio.sleep(latency)
                    if scope.cancelled_caught:
                        stopped = True
                        break
                else:
                    # a schedule point per output (without a wait: a stop here is taken
                    # once this output is delivered)
                    await trio.lowlevel.checkpoint()
                if fail_at is not None and k == fail_at:
                    raise StageError(
                        f"scripted stage {self.name} was configured to fail at output {k} "
                        f"(request {request_id!r})",
                        stage_id=self.stage_id,
                        request_id=request_id,
                    )
                token = tokens[k % len(tokens)] + offset if tokens else offset + k
                last = k == n_outputs - 1
                if final_only:
                    held.append(token)
                    if last:
                        await emit(
                            _whole(
                                self.stage_id,
                                held,
                                "length",
                                k,
                                tokens,
                                kv_out,
                                self._audio,
                                self._audio_metrics,
                            )
                        )
                else:
                    audio_metrics = self._audio_metrics
                    out = StageOutput(
                        token_ids=(token,),
                        text=f"{self.stage_id}:{token} ",
                        data=self._audio,
                        finished=last,
                        finish_reason="length" if last else None,
                        # metrics once per request, on its finished output (as vllm's); an
                        # audio packet says its sample rate
                        metrics=_done_metrics(k, tokens, kv_out, audio_metrics)
                        if last
                        else audio_metrics,
                    )
                    if nowait is None or not nowait(out):
                        await emit(out)
                if live.stop:
                    k += 1
                    break
            if live.stop and (stopped or k < n_outputs):
                # stopped by an interaction: the next output is the finished one, empty (or
                # carrying the tokens held for a whole-output request)
                await emit(_whole(self.stage_id, held, "stop", k, tokens, kv_out))
            self.completed.append(request_id)
        except trio.Cancelled:
            self.aborted.append(request_id)
            if self.options.abort_delay_s:
                with trio.CancelScope(shield=True):
                    await trio.sleep(self.options.abort_delay_s)
            raise
        finally:
            del self._live[request_id]

    def _kv_params(self, request_id: str, brought: Mapping[str, object] | None) -> object:
        """What this request's finished output carries as ``kv_transfer_params`` (None:
        nothing), as a vLLM engine with a KV connector would: a prefill (``brought`` asks
        for ``do_remote_decode``) gets params naming this replica and the request, unless
        an ``*_kv_params_at_request`` option says otherwise. Synchronous. Raises
        StageError when ``require_kv_params`` is set and ``brought`` asks for no
        ``do_remote_prefill``."""
        if self.options.require_kv_params and not (brought and brought.get("do_remote_prefill")):
            raise StageError(
                f"scripted stage {self.name} requires kv_transfer_params with "
                f"do_remote_prefill (require_kv_params: true); request {request_id!r} "
                f"brought {brought!r}",
                stage_id=self.stage_id,
                request_id=request_id,
            )
        if not (brought and brought.get("do_remote_decode")):
            return None
        n = self.requests_seen
        if n == self.options.omit_kv_params_at_request:
            return None
        if n == self.options.malformed_kv_params_at_request:
            return "not a mapping"
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"scripted:{self.stage_id}:{self.replica}",
            "remote_request_id": request_id,
            "transfer_id": brought.get("transfer_id"),
        }

    async def _interact(self, request_id: str, payload: object) -> None:
        """``{"stop": True}`` finishes the request now (its next output is its finished one,
        empty, ``finish_reason="stop"``); anything else is recorded in
        :attr:`interactions`. Synchronous apart from the base class's checkpoint."""
        if isinstance(payload, dict) and payload.get("stop") is True:
            live = self._live.get(request_id)
            if live is not None and not live.stop:
                live.wake()
        self.interactions.start(request_id).append(payload)

    async def _rpc(
        self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        if method == "echo":
            return {"stage": self.stage_id, "replica": self.replica, "args": list(args), **kwargs}
        if method == "sleep":
            seconds = float(cast(SupportsFloat, args[0])) if args else 0.0
            await trio.sleep(seconds)
            return seconds
        if method == "hang":
            await trio.sleep(math.inf)
        if method == "stats":
            return self.statistics()
        if method == "fail":
            raise StageError(f"rpc 'fail' on {self.name}", stage_id=self.stage_id)
        return await super()._rpc(method, args, kwargs)
