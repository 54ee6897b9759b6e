"""The wire format of replicas in other processes (Ray actors): msgspec MessagePack messages.

What crosses, one message each:

- a stage's input chunks (:func:`encode_inputs`): one or more :class:`StageInput`;
- one engine step's outputs of a request (:func:`encode_outputs`): a batch of
  :class:`StageOutput`, so that a step costs one remote yield, not one per token;
- a request's context (:func:`encode_context`): a :class:`RequestContext` without its local
  cleanup state (``artifacts``) and without its CFG companions (the orchestrator's business);
- any other value (:func:`encode_value`): sampling params (a dict or a vLLM
  ``SamplingParams``), an RPC's arguments and result, an interaction's payload.

Payloads (``data``, ``metrics`` values, prompts, sampling params) are open: every value
round-trips to an equal value of the same type. Plain ``str``/``int``/``float``/``bool``/
``None``/``bytes`` and exact ``list``/``dict`` (``str`` or ``int`` keys) are MessagePack's
own; the rest travel as MessagePack extensions: a tuple as its items (so it stays a tuple), a
numpy array as dtype, shape and its raw bytes (one copy each way, no pickle), anything else
(a user object, a set, a namedtuple, a ``SamplingParams``) pickled. Pickled values need their
classes importable on the other side, and unpickling runs code: peers are trusted, as Ray's
own workers are.

Every function is pure and synchronous. Encoding a value that cannot cross (an unpicklable
object) and decoding a malformed message both raise :class:`~omni_trio.errors.CodecError`
naming the message and what was wrong, never a bare msgspec error.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import msgspec
from msgspec.msgpack import Ext

from ..context import RequestContext
from ..errors import CodecError
from ..outputs import StageInput, StageOutput

if TYPE_CHECKING:
    import numpy

__all__ = [
    "decode_context",
    "decode_inputs",
    "decode_outputs",
    "decode_value",
    "encode_context",
    "encode_inputs",
    "encode_outputs",
    "encode_value",
]

# extension type codes (0..127 are the application's)
_TUPLE = 1
_NDARRAY = 2
_PICKLE = 3

_LEAVES = frozenset({str, float, bool, bytes, type(None)})
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # MessagePack's integers


# -- the messages (array-like: field names do not cross; the tag names the message) -------


class _Input(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    prompt: str | None
    token_ids: tuple[int, ...]
    data: object  # a prepared payload (see _prepare)
    final: bool
    source: str | None


class _Output(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    token_ids: tuple[int, ...]
    text: str
    data: object
    finished: bool
    finish_reason: str | None
    metrics: dict[str, object] | None


class _Inputs(msgspec.Struct, array_like=True, frozen=True, tag="inputs"):
    chunks: list[_Input]


class _Outputs(msgspec.Struct, array_like=True, frozen=True, tag="outputs"):
    outputs: list[_Output]


class _Context(msgspec.Struct, array_like=True, frozen=True, tag="context"):
    request_id: str
    prompt: object
    sampling_params: dict[str, object]
    priority: int
    arrival_time: float | None
    lora_request: object
    trace_headers: dict[str, str] | None
    tokenization_kwargs: dict[str, object] | None
    streaming_input: bool


class _Value(msgspec.Struct, array_like=True, frozen=True, tag="value"):
    value: object


# -- payloads: any value to MessagePack's own types plus extensions, and back ---------------


def _prepare(obj: object) -> object:
    """``obj`` with every value MessagePack would not give back as it was replaced by an
    :class:`Ext`. Returns ``obj`` itself when nothing needed replacing (no copy)."""
    # exact types, not isinstance: a subclass (an IntEnum, a namedtuple) is pickled whole
    t = type(obj)
    if t in _LEAVES:
        return obj
    if t is int:
        return obj if _INT_MIN <= cast(int, obj) <= _INT_MAX else _pickled(obj)
    if t is list:
        seq = cast("list[object]", obj)
        items = [_prepare(x) for x in seq]
        return obj if all(a is b for a, b in zip(items, seq, strict=True)) else items
    if t is tuple:
        return Ext(_TUPLE, _ENCODER.encode([_prepare(x) for x in cast("tuple[object, ...]", obj)]))
    if t is dict:
        mapping = cast("dict[object, object]", obj)
        if not all(
            type(k) is str or (type(k) is int and _INT_MIN <= k <= _INT_MAX) for k in mapping
        ):
            return _pickled(obj)  # tuple, float, object keys: MessagePack maps cannot say
        prepared = {k: _prepare(v) for k, v in mapping.items()}
        return obj if all(prepared[k] is v for k, v in mapping.items()) else prepared
    np = sys.modules.get("numpy")  # no numpy imported: no value is an array
    if np is not None and t is np.ndarray:
        array = cast("numpy.ndarray[tuple[int, ...], numpy.dtype[numpy.generic[object]]]", obj)
        if not array.dtype.hasobject and array.dtype.fields is None:
            data = array if array.flags.c_contiguous else np.ascontiguousarray(array)
            return Ext(_NDARRAY, _ENCODER.encode((array.dtype.str, array.shape, data.data)))
    return _pickled(obj)


def _pickled(obj: object) -> Ext:
    try:
        return Ext(_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        raise _Unencodable(type(obj), exc) from exc


class _BadField(Exception):
    """A typed field holds what its message type cannot carry (the reason is the text)."""


class _Unencodable(Exception):
    def __init__(self, kind: type, cause: Exception) -> None:
        self.kind = kind
        self.cause = cause
        super().__init__(
            f"a {kind.__module__}.{kind.__qualname__} value is not a MessagePack value, "
            f"a tuple or a numpy array, and pickling it failed: {type(cause).__name__}: {cause}"
        )


_ARRAY_HEADER = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], memoryview])


_KINDS = {_TUPLE: "a tuple", _NDARRAY: "an ndarray", _PICKLE: "a pickled"}  # by type code


class _BadPayload(Exception):
    def __init__(self, reason: str, cause: Exception | None = None) -> None:
        self.cause = cause
        super().__init__(reason)


def _ext_hook(code: int, data: memoryview) -> object:
    # ``data`` is a view into the message: everything returned is copied out of it
    try:
        if code == _TUPLE:
            return tuple(_ANY.decode(data))
        if code == _NDARRAY:
            import numpy as np

            dtype, shape, raw = _ARRAY_HEADER.decode(data)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        if code == _PICKLE:
            return pickle.loads(data)
    except _BadPayload:
        raise  # a nested payload's, already named
    except Exception as exc:
        kind = _KINDS[code]
        raise _BadPayload(
            f"{kind} payload failed to decode: {type(exc).__name__}: {exc}", exc
        ) from exc
    raise _BadPayload(f"unknown extension type {code} (known: 1 tuple, 2 ndarray, 3 pickle)")


_ENCODER = msgspec.msgpack.Encoder()
_ANY = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


# -- encoding and decoding with typed errors -------------------------------------------------

_M = TypeVar("_M")


def _encode(what: str, build: Callable[[], msgspec.Struct]) -> bytes:
    try:
        return _ENCODER.encode(build())
    except _Unencodable as exc:
        raise CodecError("encode", what, str(exc)) from exc.cause
    except _BadField as exc:
        raise CodecError("encode", what, str(exc)) from None
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        # msgspec's own refusals (a non-str metrics key, a str that is not UTF-8 ...)
        raise CodecError("encode", what, f"{type(exc).__name__}: {exc}") from exc


def _decode(what: str, decoder: msgspec.msgpack.Decoder[_M], data: bytes) -> _M:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise CodecError("decode", what, f"not the {what} message: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise CodecError("decode", what, f"malformed MessagePack: {exc}") from exc
    except _BadPayload as exc:  # a bad array header, a failed unpickle
        raise CodecError("decode", what, str(exc)) from exc.cause


def _decoder(kind: type[_M]) -> msgspec.msgpack.Decoder[_M]:
    return msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook)


_INPUTS = _decoder(_Inputs)
_OUTPUTS = _decoder(_Outputs)
_CONTEXT = _decoder(_Context)
_VALUE = _decoder(_Value)


def encode_inputs(chunks: Sequence[StageInput]) -> bytes:
    """One message of a stage's input chunks, in order. Raises :class:`CodecError` if a
    chunk's ``data`` cannot cross (see the module docstring)."""
    return _encode(
        "inputs",
        lambda: _Inputs(
            [_Input(c.prompt, c.token_ids, _prepare(c.data), c.final, c.source) for c in chunks]
        ),
    )


def decode_inputs(data: bytes) -> list[StageInput]:
    """The chunks :func:`encode_inputs` encoded, equal to the originals. Raises
    :class:`CodecError` naming what was wrong with a malformed message."""
    msg = _decode("inputs", _INPUTS, data)
    return [StageInput(c.prompt, c.token_ids, c.data, c.final, c.source) for c in msg.chunks]


def encode_outputs(outs: Sequence[StageOutput]) -> bytes:
    """One message of a batch of outputs (one engine step's, for one request), in order.
    Raises :class:`CodecError` if a ``data`` or metrics value cannot cross."""
    return _encode(
        "outputs",
        lambda: _Outputs(
            [
                _Output(
                    o.token_ids,
                    o.text,
                    _prepare(o.data),
                    o.finished,
                    o.finish_reason,
                    _plain("metrics", o.metrics),
                )
                for o in outs
            ]
        ),
    )


def decode_outputs(data: bytes) -> list[StageOutput]:
    """The batch :func:`encode_outputs` encoded, equal to the originals (``metrics`` comes
    back as a ``dict``). Raises :class:`CodecError` for a malformed message."""
    msg = _decode("outputs", _OUTPUTS, data)
    return [
        StageOutput(o.token_ids, o.text, o.data, o.finished, o.finish_reason, o.metrics)
        for o in msg.outputs
    ]


def _plain(name: str, mapping: Mapping[str, object] | None) -> dict[str, object] | None:
    """A str-keyed mapping's prepared copy (its keys cross as MessagePack strings)."""
    if mapping is None:
        return None
    for key in mapping:
        if type(key) is not str:
            raise _BadField(f"{name} keys must be str, not {type(key).__name__} {key!r}")
    return {k: _prepare(v) for k, v in mapping.items()}


def encode_context(ctx: RequestContext) -> bytes:
    """One message of a request's context: its id, prompt, every stage's sampling params
    and the per-request options. ``artifacts`` (the caller's cleanup state) and the
    companions stay behind. Raises :class:`CodecError` if a value cannot cross."""

    def build() -> _Context:
        return _Context(
            ctx.request_id,
            _prepare(ctx.prompt),
            _plain("sampling_params", ctx.sampling_params) or {},
            ctx.priority,
            ctx.arrival_time,
            _prepare(ctx.lora_request),
            # str values are their own prepared form (a wrong one fails the decode's check)
            cast("dict[str, str] | None", _plain("trace_headers", ctx.trace_headers)),
            _plain("tokenization_kwargs", ctx.tokenization_kwargs),
            ctx.streaming_input,
        )

    return _encode("context", build)


def decode_context(data: bytes) -> RequestContext:
    """The context :func:`encode_context` encoded, without ``artifacts`` or companions
    (mappings come back as ``dict``). Raises :class:`CodecError` for a malformed message."""
    # the message's fields are RequestContext's, by name
    return RequestContext(**msgspec.structs.asdict(_decode("context", _CONTEXT, data)))


def encode_value(obj: object) -> bytes:
    """One message of any value (sampling params, an RPC's arguments or result). Raises
    :class:`CodecError` if it cannot cross (an unpicklable object)."""
    return _encode("value", lambda: _Value(_prepare(obj)))


def decode_value(data: bytes) -> object:
    """The value :func:`encode_value` encoded, equal to it and of the same type. Raises
    :class:`CodecError` for a malformed message."""
    return _decode("value", _VALUE, data).value
