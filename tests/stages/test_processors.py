import pytest

from omni_trio import ConfigError
from omni_trio.outputs import StageOutput
from omni_trio.stages.processors import load_processor, map_tokens, passthrough, token_handoff


def out(*tokens, text="", data=None, finished=False):
    return StageOutput(token_ids=tokens, text=text, data=data, finished=finished)


def test_map_tokens():
    assert map_tokens([1, 2, 3]) == (1, 2, 3)
    assert map_tokens([1, 2, 3], offset=10) == (11, 12, 13)
    assert map_tokens([1, 2, 3], mapping={2: 7}) == (1, 7, 3)
    assert map_tokens([500, 3], offset=20, vocab_size=512) == (8, 23)


def test_token_handoff_concatenates_in_input_order():
    res = token_handoff({"a": [out(1, 2), out(3)], "b": [out(9)]}, final=True)
    assert res.token_ids == (1, 2, 3, 9)
    assert res.final and res.prompt is None and res.source == "a,b"
    res = token_handoff({"a": [out(1)]}, final=True, options={"offset": 5, "mapping": {"1": 2}})
    assert res.token_ids == (7,)
    # each mapping option on its own still applies (only their absence skips the mapping)
    assert token_handoff({"a": [out(3)]}, final=True, options={"offset": 2}).token_ids == (5,)
    assert token_handoff({"a": [out(7)]}, final=True, options={"vocab_size": 5}).token_ids == (2,)
    res = token_handoff({"a": [out(1, 4)]}, final=True, options={"mapping": {1: 8}})
    assert res.token_ids == (8, 4)
    with pytest.raises(ValueError):
        token_handoff({"a": [out(1)]}, final=True, options={"offset": "x"})


def test_token_handoff_streaming_and_empty_deltas():
    assert token_handoff({"a": [out()]}, final=False) is None
    res = token_handoff({}, final=True)
    assert res.final and res.token_ids == ()
    res = token_handoff({"a": [out(4, data=[0.5])]}, final=False)
    assert res.token_ids == (4,) and res.data == [0.5] and not res.final


def test_passthrough_keeps_text():
    res = passthrough({"a": [out(1, text="he"), out(2, text="llo")]}, final=True)
    assert res.prompt == "hello" and res.token_ids == (1, 2)


def test_load_processor():
    assert load_processor(None) is token_handoff
    assert load_processor("omni_trio.stages.processors:passthrough") is passthrough
    with pytest.raises(ConfigError, match="must be 'package.module:function'"):
        load_processor("nocolon", where="$.stages[1].input_processor")
    with pytest.raises(ConfigError, match="cannot import input_processor module"):
        load_processor("no_such_mod:f")
    with pytest.raises(ConfigError, match="has no 'zz'"):
        load_processor("omni_trio.stages.processors:zz")
