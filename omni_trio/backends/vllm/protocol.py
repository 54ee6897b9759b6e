"""Messages between the vllm backend (caller side) and its worker thread, and the pure
conversions between omni-trio and vLLM values. No vllm import here.

Results cross the thread boundary as :mod:`outcome` values: the start result
(``Outcome[Ready]``) on the event bridge, then :class:`Died` if the engine dies; each RPC's
``Outcome`` on its reply bridge; a request's failure as an ``outcome.Error`` after its
outputs. The caller unwraps them, so the worker's exception is raised on its side.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import outcome

from ...context import RequestContext
from ...errors import InvalidRequestError, ReplicaDeadError
from ...outputs import StageInput, StageOutput
from ...transport.bridge import BridgeSender

#: applied on CPU machines when the stage's engine_args do not set them (the defaults of
#: vLLM fail or crawl there: 0.92 of a NUMA node for the KV cache, CUDA-graph capture)
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "gpu_memory_utilization": 0.15,
    "max_model_len": 256,
    "max_num_seqs": 8,
}


# -- messages -----------------------------------------------------------------------------
class Flow:
    """One request's output flow control, shared by the worker (which sends its outputs) and
    the backend (which takes them): at most ``window`` outputs sent and not yet taken.

    A request out of credit is *stalled*: the worker leaves its outputs in vLLM's per-request
    collector (which merges DELTA outputs) until the backend, having taken enough, tells it
    to resume. The lock makes "out of credit" and "stalled" one decision, so a resume is
    never missed. Both methods are synchronous and thread-safe.
    """

    __slots__ = ("_lock", "_sent", "_stalled", "_taken", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._sent = 0
        self._taken = 0
        self._stalled = False

    def reserve(self) -> bool:
        """Worker side: count one more output sent, or (no credit) mark the flow stalled."""
        with self._lock:
            if self._sent - self._taken >= self.window:
                self._stalled = True
                return False
            self._sent += 1
            return True

    def took(self) -> bool:
        """Backend side: count one output taken; true when the worker must be told to
        resume (it was stalled and half the window is free again)."""
        with self._lock:
            self._taken += 1
            if self._stalled and self._sent - self._taken <= self.window // 2:
                self._stalled = False
                return True
            return False

    def __repr__(self) -> str:
        return f"<Flow in_flight={self._sent - self._taken}/{self.window} stalled={self._stalled}>"


@dataclass(frozen=True, slots=True)
class Submit:
    request_id: str
    prompt: StageInput
    sampling_params: Any  # the user's: None, a dict or a vllm SamplingParams
    final_only: bool  # nobody streams this request's outputs: ask vLLM for the last one only
    flow: Flow
    #: the request's per-request vLLM options that are not vLLM's defaults (None: none; see
    #: :func:`request_options`); most requests carry none
    options: dict[str, Any] | None = None
    #: ``prompt`` is the first of several input segments; the others follow as
    #: :class:`Segment` commands (vLLM's streaming input: a resumable request)
    segmented: bool = False
    #: someone reads the outputs' text: else vLLM need not detokenize them
    text: bool = True


@dataclass(frozen=True, slots=True)
class Segment:
    """The next input segment of a ``segmented`` request; ``None``: its input ended."""

    request_id: str
    chunk: StageInput | None


@dataclass(frozen=True, slots=True)
class Resume:
    """A stalled request has credit again (see :class:`Flow`)."""

    request_id: str


class End:
    """A request's last item when it did not finish: the worker is done with it (an abort
    was confirmed by vLLM, or it failed)."""

    def __repr__(self) -> str:
        return "END"


END: Final = End()

#: what the worker sends on a replica's output bridge: every request's items of one engine
#: step, in order (outputs, a request's failure, END)
Batch = list[tuple[str, "StageOutput | outcome.Error | End"]]


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Rpc:
    # the user's arguments and the engine's answer are open by nature
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    reply: BridgeSender[outcome.Outcome[Any]]


@dataclass(frozen=True, slots=True)
class Ready:
    core_pids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Died:
    reason: str
    #: the exception behind ``reason``, if there is one (the replica's death is caused by it)
    error: BaseException | None = None


def died_of(death: BaseException | None, crash: BaseException) -> bool:
    """Whether a replica that died of ``death`` died of the worker's ``crash``: the crash
    itself, or a crash whose one cause is the death's (a request task's failure that its
    :class:`Died` reported). Pure."""
    if death is None:
        return False
    cause = death.__cause__
    return cause is crash or (cause is not None and crash.__cause__ is cause)


#: what the worker reports on its event bridge: its start outcome, then maybe a death
Event = outcome.Outcome[Ready] | Died


def engine_died(name: str, exc: BaseException) -> outcome.Error:
    """A request failure because the engine died: it travels as :class:`ReplicaDeadError`
    (caused by vLLM's error), so the caller tells it apart without importing vllm. Pure."""
    error = ReplicaDeadError(f"replica {name}: engine died: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return outcome.Error(error)


# -- pure helpers -------------------------------------------------------------------------
def request_options(context: RequestContext, *, entry: bool, traced: bool) -> dict[str, Any] | None:
    """The per-request options of ``context`` a vllm stage hands to vLLM, those that are not
    vLLM's defaults, or ``None`` (the usual case, decided without building a dict). Pure.

    ``priority``, ``arrival_time`` and ``trace_headers`` go to every vllm stage of the request
    (``AsyncLLM.add_request`` keywords); ``trace_headers`` only to an engine that traces
    (``traced``: its ``otlp_traces_endpoint`` is set): any other engine drops them, with a
    warning that tracing is disabled. ``lora_request`` and
    ``tokenization_kwargs`` concern the prompt the caller gave and the model it addressed, so
    only an entry stage takes them: a downstream stage's prompt is token ids from upstream,
    often for another model. The worker applies ``tokenization_kwargs`` where the prompt is
    tokenized (it renders prompts itself; vLLM reads them only for raw prompts).
    """
    if (
        context.priority == 0
        and context.arrival_time is None
        and (context.trace_headers is None or not traced)
        and (not entry or (context.lora_request is None and context.tokenization_kwargs is None))
    ):
        return None
    options: dict[str, Any] = {}
    if context.priority != 0:
        options["priority"] = context.priority
    if context.arrival_time is not None:
        options["arrival_time"] = float(context.arrival_time)
    if traced and context.trace_headers is not None:
        options["trace_headers"] = dict(context.trace_headers)
    if entry and context.lora_request is not None:
        options["lora_request"] = context.lora_request
    if entry and context.tokenization_kwargs is not None:
        options["tokenization_kwargs"] = dict(context.tokenization_kwargs)
    return options or None


def merge_engine_args(engine_args: dict[str, Any], *, on_cpu: bool) -> dict[str, Any]:
    """The stage's engine args over the CPU defaults (on CPU only). Pure."""
    return {**CPU_ENGINE_DEFAULTS, **engine_args} if on_cpu else dict(engine_args)


def chat_template_of(tokenizer: Any) -> str | None:
    """A tokenizer's default chat template: its ``chat_template`` string, the ``default``
    of named templates, or None (no tokenizer, no template). Pure."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def check_sampling_keys(params: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Raise InvalidRequestError naming the first key SamplingParams does not have. Pure."""
    for key in params:
        if key not in fields:
            raise InvalidRequestError(
                f"sampling_params key {key!r} is not a vllm SamplingParams field "
                f"(output_kind is always DELTA)"
            )


def metrics_of(ro: Any) -> dict[str, Any] | None:
    """vLLM's per-request metrics of a (finished) RequestOutput as a plain dict (None if
    absent), with its prompt's ids and, from an engine with a KV connector, the
    ``kv_transfer_params`` it returned. Built once per request and stage. Pure."""
    m = getattr(ro, "metrics", None)
    out: dict[str, Any] = {}
    if m is not None and dataclasses.is_dataclass(m) and not isinstance(m, type):
        out.update(_fields_of(m))
    if getattr(ro, "num_cached_tokens", None) is not None:
        out["num_cached_tokens"] = ro.num_cached_tokens
    if ro.prompt_token_ids is not None:
        out["num_prompt_tokens"] = len(ro.prompt_token_ids)
        # the prompt as the engine saw it (after templating): a downstream stage that
        # conditions on the whole turn (a Qwen-Omni talker) reads it
        out["prompt_token_ids"] = tuple(ro.prompt_token_ids)
    kv = getattr(ro, "kv_transfer_params", None)
    if kv is not None:
        # what a prefill engine's KV connector returned for the decode engine to load the
        # cache with (a prefill/decode pair: omni_trio.request.pd); a copy, not vLLM's dict
        out["kv_transfer_params"] = dict(kv) if isinstance(kv, Mapping) else kv
    return out or None


_SCALARS = (int, float, str, bool, type(None))


def _fields_of(m: Any) -> dict[str, Any]:
    # vLLM's RequestStateStats holds scalars only: read its fields, without asdict's
    # recursive deep copy (12 calls a request, most of the metrics' cost in the engine
    # thread); anything nested still gets asdict's copy, so nothing shares vLLM's objects
    out: dict[str, Any] = {}
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if not isinstance(value, _SCALARS):
            return dataclasses.asdict(m)
        out[f.name] = value
    return out


#: the finished output of a streaming-input request whose last segment's output was sent
_STREAM_END = StageOutput(finished=True, finish_reason="stop")


def to_stage_output(ro: Any) -> StageOutput:
    """One vLLM RequestOutput (a delta, or the whole output with FINAL_ONLY) as a
    StageOutput; metrics only on the finished one."""
    if not ro.outputs:
        # vLLM's STREAM_FINISHED: a streaming-input request ended with nothing pending
        return _STREAM_END
    comp = ro.outputs[0]
    if not ro.finished:
        return StageOutput(token_ids=tuple(comp.token_ids), text=comp.text)
    return StageOutput(
        token_ids=tuple(comp.token_ids),
        text=comp.text,
        finished=True,
        finish_reason=comp.finish_reason,
        metrics=metrics_of(ro),
    )
