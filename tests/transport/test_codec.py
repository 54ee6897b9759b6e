"""The wire format of remote replicas: every message round-trips to equal values of the same
types, and malformed or unencodable messages raise CodecError naming what was wrong."""

from __future__ import annotations

import collections
import importlib
import pickle
import threading

import msgspec
import numpy as np
import pytest

from omni_trio.context import RequestContext
from omni_trio.errors import CodecError, OmniTrioError
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.request.hooks import ArtifactKeeper
from omni_trio.transport.codec import (
    decode_context,
    decode_inputs,
    decode_outputs,
    decode_value,
    encode_context,
    encode_inputs,
    encode_outputs,
    encode_value,
)

Point = collections.namedtuple("Point", "x y")

#: values whose type MessagePack alone would change (tuple -> list, set -> list, key types)
NESTED = {
    "ids": (1, 2, 3),
    "rows": [(1, "a"), [2, (3, (4,))]],
    "set": {1, 2},
    "frozen": frozenset({"x"}),
    "int_keys": {1: "one", -2: (2,)},
    "tuple_keys": {(1, 2): "pair"},
    "big": 2**70,
    "bytes": b"\x00\xff",
    "float": 1.5,
    "none": None,
    "bool": True,
    "named": Point(1, 2),
    "ordered": collections.OrderedDict(a=1),
}


def _same(a: object, b: object) -> bool:
    """Equal, and of the same type all the way down (== alone says (1,) == [1] is false but
    1 == 1.0 and {1} == frozenset({1}) are true)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())  # type: ignore[union-attr]
    return a == b


def test_inputs_round_trip_every_field():
    chunks = [
        StageInput(prompt="hello", token_ids=(1, 2, 3), data=NESTED, final=False, source="a"),
        StageInput(),  # every default
        StageInput(token_ids=(7,), data=(4, 5), source="thinker:neg"),
    ]
    back = decode_inputs(encode_inputs(chunks))
    assert back == chunks
    assert all(type(b.token_ids) is tuple for b in back)
    assert _same(back[0].data, NESTED)
    assert _same(back[2].data, (4, 5))
    assert decode_inputs(encode_inputs([])) == []


def test_outputs_round_trip_every_field_in_order():
    outs = [
        StageOutput(token_ids=(9, 8), text="hé", data=None, metrics={"prompt_tokens": 3}),
        StageOutput(
            token_ids=(),
            text="",
            data=[1, (2,)],
            finished=True,
            finish_reason="stop",
            metrics={"output_index": 0, "timings": (0.5, 1.25), "spec": {"k": [1]}},
        ),
    ]
    back = decode_outputs(encode_outputs(outs))
    assert back == outs
    assert _same(back[1].data, [1, (2,)])
    assert _same(back[1].metrics, outs[1].metrics)
    assert back[0].metrics is not None and type(back[0].metrics) is dict


def test_lists_and_tuples_keep_their_types():
    value = [(), [], ((),), [[]], (1, [2, (3, [4])])]
    assert _same(decode_value(encode_value(value)), value)
    assert _same(decode_value(encode_value((1,))), (1,))
    assert _same(decode_value(encode_value([1])), [1])


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.array([1, -2, 3], dtype=">i8"),  # big-endian stays big-endian
        np.zeros((0, 5), dtype=np.int16),
        np.array(3.5),  # 0-d
        np.arange(20, dtype=np.complex128).reshape(4, 5)[:, ::2],  # not contiguous
        np.array(["ab", "c"]),
        np.array([True, False]),
    ],
    ids=["f32-3d", "i8-big-endian", "empty", "0-d", "strided", "unicode", "bool"],
)
def test_numpy_arrays_round_trip(array):
    out = decode_outputs(encode_outputs([StageOutput(data={"audio": array, "sr": 24000})]))[0]
    got = out.data["audio"]
    assert _same(got, array)
    assert got.flags.writeable and got.flags.c_contiguous
    got[...] = got  # a writable array of its own, not a view into the message


def test_numpy_arrays_cross_without_pickle():
    array = np.arange(1000, dtype=np.float32)
    msg = encode_value(array)
    assert b"numpy" not in msg  # pickle would name numpy's reconstructor
    assert len(msg) < array.nbytes + 64


def test_object_arrays_and_numpy_scalars_cross_pickled():
    value = [np.array([1, "a", None], dtype=object), np.float32(0.25), np.int64(-3)]
    back = decode_value(encode_value(value))
    assert isinstance(back, list)
    assert back[0].dtype == object and list(back[0]) == [1, "a", None]
    assert _same(back[1:], value[1:])


def test_a_user_object_crosses_pickled(user_module):
    name = user_module(
        """
        from dataclasses import dataclass

        @dataclass
        class Frame:
            index: int
            pixels: tuple
        """
    )
    frame = importlib.import_module(name).Frame(3, (1, 2))
    back = decode_outputs(encode_outputs([StageOutput(data=frame, metrics={"f": frame})]))[0]
    assert back.data == frame and type(back.data) is type(frame)
    assert back.metrics is not None and back.metrics["f"] == frame


def test_sampling_params_dicts_and_rpc_values():
    params = {"temperature": 0.0, "max_tokens": 16, "stop": ["\n"], "logit_bias": {5: -1.0}}
    assert _same(decode_value(encode_value(params)), params)
    call = ("collective_rpc", ("method",), {"timeout": 2.5, "args": (1, None)})
    assert _same(decode_value(encode_value(call)), call)
    assert decode_value(encode_value(None)) is None


@pytest.mark.slow  # importing vllm takes seconds
def test_vllm_sampling_params_cross():
    vllm = pytest.importorskip("vllm")
    params = vllm.SamplingParams(temperature=0.0, max_tokens=7, stop=["x"], seed=3)
    back = decode_value(encode_value({"talker": params}))
    assert isinstance(back, dict)
    assert type(back["talker"]) is vllm.SamplingParams
    assert back["talker"] == params and back["talker"].max_tokens == 7


def test_context_crosses_without_artifacts_or_companions(tmp_path):
    ctx = RequestContext(
        request_id="r1",
        prompt={"prompt": "hi", "multi_modal_data": {"ids": (1, 2)}},
        sampling_params={"thinker": {"max_tokens": 4}, "talker": {"stop": ("a",)}},
        priority=-2,
        arrival_time=1700000000.25,
        lora_request=("adapter", 1),
        trace_headers={"traceparent": "00-abc-01"},
        tokenization_kwargs={"truncation": True},
        streaming_input=True,
        artifacts=ArtifactKeeper().hold("r1", (str(tmp_path),)),
        companion_stage="thinker",
    )
    back = decode_context(encode_context(ctx))
    assert back.artifacts is None and back.companions == () and back.companion_stage is None
    for field in (
        "request_id",
        "prompt",
        "sampling_params",
        "priority",
        "arrival_time",
        "lora_request",
        "trace_headers",
        "tokenization_kwargs",
        "streaming_input",
    ):
        assert _same(getattr(back, field), getattr(ctx, field)), field
    plain = RequestContext(request_id="r2", prompt=(1, 2, 3))
    assert decode_context(encode_context(plain)) == plain


def _raises(data: bytes, decode, *, match: str) -> CodecError:
    with pytest.raises(CodecError, match=match) as info:
        decode(data)
    assert isinstance(info.value, OmniTrioError) and info.value.operation == "decode"
    assert not isinstance(info.value, msgspec.MsgspecError)
    return info.value


def test_malformed_bytes_raise_codec_error():
    good = encode_outputs([StageOutput(text="x", finished=True)])
    err = _raises(good[:-2], decode_outputs, match="the outputs message: malformed")
    assert err.what == "outputs"
    _raises(b"", decode_inputs, match="the inputs message: malformed")
    _raises(b"\xc1", decode_value, match="malformed")


def test_the_wrong_message_raises_codec_error_naming_it():
    inputs = encode_inputs([StageInput(prompt="p")])
    _raises(inputs, decode_outputs, match=r"not the outputs message: .*'inputs'")
    _raises(encode_value(1), decode_context, match="not the context message")
    _raises(msgspec.msgpack.encode({"chunks": []}), decode_inputs, match="not the inputs")
    # the right tag with a field of the wrong type
    bad = msgspec.msgpack.encode(["outputs", [[["a"], "", None, True, None, None]]])
    _raises(bad, decode_outputs, match=r"not the outputs message: .*\$\[1\]\[0\]\[0\]")
    extra = msgspec.msgpack.encode(["inputs", [[None, [], None, True, None, "more"]]])
    _raises(extra, decode_inputs, match="not the inputs message")


def test_bad_payloads_raise_codec_error():
    unknown_ext = msgspec.msgpack.encode(["value", msgspec.msgpack.Ext(99, b"")])
    _raises(unknown_ext, decode_value, match="unknown extension type 99")
    missing = pickle.dumps(object()).replace(b"builtins", b"nomodule")
    err = _raises(
        msgspec.msgpack.encode(["value", msgspec.msgpack.Ext(3, missing)]),
        decode_value,
        match="a pickled payload failed to decode: ModuleNotFoundError",
    )
    assert isinstance(err.__cause__, ModuleNotFoundError)
    bad_array = msgspec.msgpack.encode(["value", msgspec.msgpack.Ext(2, b"\x93\xa3<f4")])
    _raises(bad_array, decode_value, match="an ndarray payload failed to decode: .*truncated")
    nested = msgspec.msgpack.encode(["value", [msgspec.msgpack.Ext(1, b"\x91" + unknown_ext[-3:])]])
    _raises(nested, decode_value, match="extension type 99")


def test_values_that_cannot_cross_raise_codec_error_on_encode():
    with pytest.raises(CodecError, match="_thread.lock value .* pickling it failed") as info:
        encode_outputs([StageOutput(data={"lock": threading.Lock()})])
    assert info.value.operation == "encode" and info.value.what == "outputs"
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(CodecError, match="metrics keys must be str, not int 1"):
        encode_outputs([StageOutput(metrics={1: "x"})])  # type: ignore[dict-item]
    with pytest.raises(CodecError, match="the inputs message: .*surrogates"):
        encode_inputs([StageInput(prompt="\ud800")])
    with pytest.raises(CodecError, match="the value message"):
        encode_value(lambda: None)
