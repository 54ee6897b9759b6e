import sys

import pytest

from omni_trio import ConfigError, open_engine
from omni_trio.context import RequestContext
from omni_trio.outputs import StageOutput
from omni_trio.stages.processors import (
    StageContext,
    accepts_context,
    load_processor,
    map_tokens,
    original_prompt,
    passthrough,
    reads_text,
    token_handoff,
)


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


def test_reads_text_is_false_only_for_builtins_that_take_no_upstream_text():
    # the default hand-off and original_prompt take token ids / the user's prompt, unless
    # an option asks for the upstream text; anything else may read it
    assert not reads_text(token_handoff, None)
    assert not reads_text(token_handoff, {"offset": 3})
    assert reads_text(token_handoff, {"include_text": True})
    assert not reads_text(original_prompt, {})
    assert reads_text(original_prompt, {"include_upstream_text": True})
    assert reads_text(passthrough, None)
    assert reads_text(lambda upstream, *, final, options: None, None)
    # what the loader returns for a config's processor is what is checked
    assert not reads_text(load_processor(None), None)


def test_load_processor():
    assert load_processor(None) is token_handoff
    assert load_processor("omni_trio.stages.processors:passthrough") is passthrough
    with pytest.raises(ConfigError, match="must be 'package.module:function'"):
        load_processor("nocolon", where="$.stages[1].input_processor")
    with pytest.raises(ConfigError, match="cannot import input_processor module"):
        load_processor("no_such_mod:f")
    with pytest.raises(ConfigError, match="has no 'zz'"):
        load_processor("omni_trio.stages.processors:zz")


# -- the request context (original prompt, the target stage's sampling params) --------------


def ctx(prompt, stage_id="img", params=None):
    request = RequestContext("r", prompt, {"llm": {"max_tokens": 4}, stage_id: params})
    return StageContext.of(request, stage_id)


def test_stage_context_is_the_target_stages_view():
    view = ctx("a cat", params={"steps": 20})
    assert (view.request_id, view.stage_id, view.prompt) == ("r", "img", "a cat")
    assert view.sampling_params == {"steps": 20}  # its own, not the llm's
    assert view.request.sampling_params["llm"] == {"max_tokens": 4}
    assert "'img'" in repr(view)


def test_original_prompt_hands_the_users_prompt_on():
    upstream = {"llm": [out(5, 6, text="thinking", data={"h": 1})]}
    assert original_prompt(upstream, final=False, context=ctx("a cat")) is None
    res = original_prompt(upstream, final=True, context=ctx("a cat"))
    assert res.prompt == "a cat" and res.token_ids == () and res.data == {"h": 1}
    assert res.final and res.source == "llm"
    res = original_prompt(
        upstream, final=True, options={"include_upstream_text": True}, context=ctx("a cat")
    )
    assert res.prompt == "a cat\nthinking"
    assert original_prompt({}, final=True, context=ctx([3, 4])).token_ids == (3, 4)
    res = original_prompt(upstream, final=True, context=ctx({"prompt": "p", "size": 64}))
    assert res.data == {"prompt": "p", "size": 64}
    with pytest.raises(ValueError, match="needs the request context"):
        original_prompt(upstream, final=True)


def test_context_goes_only_to_processors_that_take_it(user_module):
    name = user_module(
        """
        def old(upstream, *, final, options):
            return None

        def new(upstream, *, final, options, context):
            return context

        def kwargs(upstream, **kw):
            return kw["context"]
        """
    )
    assert accepts_context(token_handoff) and accepts_context(original_prompt)
    old = load_processor(f"{name}:old")
    assert not accepts_context(sys.modules[name].old)
    assert old.__wrapped__ is sys.modules[name].old  # wrapped once, at load
    assert old({}, final=True, options={}, context=ctx("x")) is None
    view = ctx("x")
    assert load_processor(f"{name}:new")({}, final=True, options={}, context=view) is view
    assert load_processor(f"{name}:kwargs") is sys.modules[name].kwargs
    assert not accepts_context(len)  # a builtin without a readable signature


RECORDER = """
SEEN = []

def record(upstream, *, final, options, context=None):
    SEEN.append((context.request_id, context.stage_id, context.prompt, context.sampling_params,
                 {k: sum(len(o.token_ids) for o in v) for k, v in upstream.items()}))
    return original_prompt(upstream, final=final, options=options, context=context)

def old_style(upstream, *, final, options):
    return token_handoff(upstream, final=final, options=options)

from omni_trio.stages.processors import original_prompt, token_handoff
"""


async def test_processors_see_the_original_prompt_and_their_stages_params(
    autojump_clock, user_module
):
    name = user_module(RECORDER)
    cfg = {
        "stages": [
            {"id": "llm", "options": {"outputs": 3}, "default_sampling_params": {"t": 0.5}},
            {
                "id": "img",
                "inputs": ["llm"],
                "input_processor": f"{name}:record",
                "default_sampling_params": {"steps": 10},
                "final_output": True,
            },
            {
                "id": "old",
                "inputs": ["llm"],
                "input_processor": f"{name}:old_style",
                "final_output": True,
            },
        ]
    }
    async with open_engine(cfg) as engine:
        outs = await engine.generate(
            "a red cat", request_id="r", sampling_params={"img": {"steps": 30}}
        ).collect()
        img_input = engine.pools["img"].replicas[0].received["r"]
        old_input = engine.pools["old"].replicas[0].received["r"]
    assert sys.modules[name].SEEN == [("r", "img", "a red cat", {"steps": 30}, {"llm": 3})]
    # the image stage got the user's prompt; the old-style processor still hands tokens on
    assert [(c.prompt, c.token_ids) for c in img_input] == [("a red cat", ())]
    assert len(old_input) == 1 and len(old_input[0].token_ids) == 3
    assert old_input[0].prompt is None
    assert {o.stage_id for o in outs if o.finished} == {"img", "old"}
