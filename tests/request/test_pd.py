"""A prefill/decode pair's per-request functions (``omni_trio.request.pd``), pure: the
sampling rewrite, the checks of the pair's params, the ``kv_transfer_params`` taken from the
prefill's finished output, the decode's input, and a route's params."""

from __future__ import annotations

import pytest

from omni_trio import InvalidRequestError, StageError, load_config
from omni_trio.config.pd import PDPair
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.request.pd import (
    NOT_ON_A_PAIR,
    check_pair_params,
    decode_input,
    decode_sampling_params,
    kv_transfer_params_of,
    pd_request_params,
    prefill_sampling_params,
)
from omni_trio.request.planning import plan_request, resolve_sampling_params

from ..config.test_pd import decode, pd, prefill, stage

PAIR = PDPair("p", "d", 0, 1, "NixlConnector")
CONTENT = PDPair("p", "d", 0, 1, "ExampleConnector", kv_params_required=False)
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def test_prefill_params_one_token_no_stops_and_a_remote_decode():
    params = {
        **GREEDY,
        "stop": ["\n"],
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
        "min_tokens": 4,
        "extra_args": {"mine": 1, "kv_transfer_params": {"hint": "x"}},
    }
    before = repr(params)
    out = prefill_sampling_params(params, "r1")
    assert out == {
        "temperature": 0.0,
        "max_tokens": 1,
        "min_tokens": 1,  # ends by length: a connector hands the cache over only then
        "stop": [],
        "stop_token_ids": [],
        "extra_args": {
            "mine": 1,
            "kv_transfer_params": {
                "hint": "x",
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": "xfer-r1",
            },
        },
    }
    assert repr(params) == before  # the request's own params are not changed


def test_decode_params_copy_the_requests_and_carry_the_prefills_kv_params():
    returned = {"remote_block_ids": [1, 2], "remote_engine_id": "e", "do_remote_prefill": True}
    params = {**GREEDY, "seed": 3, "extra_args": {"mine": 1}}
    out = decode_sampling_params(params, returned, "r1")
    assert out == {
        **GREEDY,
        "seed": 3,
        "extra_args": {
            "mine": 1,
            "kv_transfer_params": {
                "transfer_id": "xfer-r1",
                "remote_block_ids": [1, 2],
                "remote_engine_id": "e",
                "do_remote_prefill": True,
                "do_remote_decode": False,
            },
        },
    }
    assert params == {**GREEDY, "seed": 3, "extra_args": {"mine": 1}}
    # the prefill's own transfer id wins; a connector that returns nothing gets ours
    assert decode_sampling_params({}, {"transfer_id": "t9"}, "r1")["extra_args"] == {
        "kv_transfer_params": {
            "transfer_id": "t9",
            "do_remote_prefill": True,
            "do_remote_decode": False,
        }
    }
    assert decode_sampling_params({}, None, "r1")["extra_args"]["kv_transfer_params"] == {
        "transfer_id": "xfer-r1",
        "do_remote_prefill": True,
        "do_remote_decode": False,
    }


@pytest.mark.parametrize(
    ("params", "decode", "phrase"),
    [
        ({**GREEDY, "n": 2}, False, "sampling param 'n' of stage 'x' (prefill half of"),
        ({**GREEDY, "n": True}, True, "'n'"),
        *[
            ({**GREEDY, key: 1}, True, f"sampling param {key!r} is not supported")
            for key in NOT_ON_A_PAIR
        ],
        ({"max_tokens": 4}, True, "greedy (temperature: 0) or seeded"),
        ({"temperature": 0.7}, True, "got temperature 0.7 and no seed"),
        ({"temperature": False}, True, "greedy (temperature: 0) or seeded"),
        ({**GREEDY, "extra_args": 3}, True, "'extra_args'"),
        ({**GREEDY, "extra_args": {"kv_transfer_params": 3}}, True, "'extra_args'"),
        (object(), True, "must be a mapping of vLLM SamplingParams fields"),
    ],
)
def test_pair_params_checked_naming_the_param_and_the_pair(params, decode, phrase):
    with pytest.raises(InvalidRequestError) as info:
        check_pair_params(params, "x", PAIR, decode=decode)
    assert phrase in str(info.value)
    assert "prefill/decode pair 'p' -> 'd'" in str(info.value)


def test_pair_params_that_pass():
    for ok in (GREEDY, {"temperature": 0}, {"temperature": 0.8, "seed": 7}, {**GREEDY, "n": 1}):
        assert check_pair_params(ok, "d", PAIR, decode=True) is ok
    # the prefill's one token is thrown away: its sampling need not be seeded
    assert check_pair_params({}, "p", PAIR, decode=False) == {}


def done(metrics: object, reason: str = "length") -> StageOutput:
    return StageOutput(token_ids=(5,), finished=True, finish_reason=reason, metrics=metrics)


def test_kv_params_taken_from_the_prefills_finished_output():
    kv = {"remote_engine_id": "e"}
    assert kv_transfer_params_of([done({"kv_transfer_params": kv})], PAIR, "r") is kv
    assert kv_transfer_params_of([done({"output_index": 0})], CONTENT, "r") is None


@pytest.mark.parametrize(
    ("outputs", "phrase"),
    [
        ([], "without a finished output"),
        ([StageOutput(token_ids=(1,))], "without a finished output"),
        (
            [done(None, "stop")],
            "finished request 'r' (finish_reason 'stop') without kv_transfer_params",
        ),
        ([done({"prompt_token_ids": (1,)})], "connector 'NixlConnector'"),
        ([done({"kv_transfer_params": "x"})], "malformed kv_transfer_params for request 'r'"),
        ([done({"kv_transfer_params": {1: 2}})], "a mapping with string keys is needed"),
    ],
)
def test_missing_or_malformed_kv_params_are_a_stage_error_naming_the_pair(outputs, phrase):
    with pytest.raises(StageError) as info:
        kv_transfer_params_of(outputs, PAIR, "r")
    assert phrase in str(info.value)
    assert str(info.value).startswith("prefill/decode pair 'p' -> 'd': ")
    assert (info.value.stage_id, info.value.request_id) == ("d", "r")
    # a malformed value is malformed even where none is fine
    if "malformed" in phrase or "string keys" in phrase:
        with pytest.raises(StageError):
            kv_transfer_params_of(outputs, CONTENT, "r")


def test_decode_input_is_the_prompt_the_prefill_computed():
    text = StageInput(prompt="hi", data=b"audio", source="up")
    reported = {"prompt_token_ids": (7, 8, 9)}
    # the ids the prefill's engine tokenized (templates and tokenization_kwargs applied)
    assert decode_input(text, reported, PAIR) == StageInput(None, (7, 8, 9), b"audio", True, "p")
    ids = StageInput(token_ids=(1, 2), final=False)
    assert decode_input(ids, {"prompt_token_ids": [1, 2]}, PAIR) == StageInput(
        None, (1, 2), None, True, "p"
    )
    # a prompt dict (multimodal data the decode needs too), or no usable ids: the input
    mm = StageInput(data={"prompt": "hi", "multi_modal_data": {"image": 1}}, source="up")
    assert decode_input(mm, reported, PAIR) == StageInput(None, (), mm.data, True, "p")
    for metrics in (None, {}, {"prompt_token_ids": ()}, {"prompt_token_ids": [1, -2]}):
        assert decode_input(text, metrics, PAIR) == StageInput("hi", (), b"audio", True, "p")


def test_a_routes_params_rewritten_for_each_pair_on_it():
    cfg = load_config(pd(stage("after", inputs=["d"], final_output=True)))
    params = resolve_sampling_params(cfg, GREEDY)
    pairs = [PAIR]
    out = pd_request_params(pairs, plan_request(cfg), params, "r")
    assert (
        out["p"]["max_tokens"] == 1 and out["d"] is params["d"] and out["after"] is params["after"]
    )
    assert params["p"] == GREEDY  # a new mapping, the resolved one untouched
    # a route without the pair leaves every stage's params as they are
    other = load_config(
        {"stages": [prefill(), decode(final_output=False), stage("x", final_output=True)]}
    )
    plan = plan_request(other, output_stages=["x"])
    assert pd_request_params(pairs, plan, {"p": 1, "d": 2, "x": 3}, "r") == {"p": 1, "d": 2, "x": 3}


def test_a_route_must_run_the_decode_of_a_prefill_it_runs():
    cfg = load_config(pd())
    with pytest.raises(InvalidRequestError, match="runs prefill stage 'p' .* without its decode"):
        pd_request_params([PAIR], plan_request(cfg, final_stage_id="p"), {}, "r")


def test_streaming_input_or_a_lora_cannot_reach_a_prefill():
    cfg = load_config(pd())
    params = resolve_sampling_params(cfg, GREEDY)
    with pytest.raises(InvalidRequestError, match="streaming_input cannot feed prefill stage 'p'"):
        pd_request_params([PAIR], plan_request(cfg), params, "r", streaming_input=True)
    with pytest.raises(InvalidRequestError, match="lora_request is not supported on prefill"):
        pd_request_params([PAIR], plan_request(cfg), params, "r", lora_request=object())
    # a prefill that is no entry stage takes neither (it gets its upstream's tokens)
    chained = load_config({"stages": [stage("up"), prefill("p", inputs=["up"]), decode()]})
    plan = plan_request(chained)
    out = pd_request_params(
        [PDPair("p", "d", 1, 2, "NixlConnector")], plan, params | {"up": {}}, "r", lora_request=1
    )
    assert out["p"]["max_tokens"] == 1
