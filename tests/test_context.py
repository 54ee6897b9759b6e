"""The request context: built once per request, seen by every stage's backend."""

import pytest

from omni_trio import InvalidRequestError, open_engine
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.context import RequestContext, check_request_options
from omni_trio.testing import scripted_pipeline


class RecordsContext(ScriptedBackend):
    seen: list = []

    async def _run(self, request_id, inputs, sampling_params, emit):
        RecordsContext.seen.append((self.stage_id, self.request_context(request_id)))
        await super()._run(request_id, inputs, sampling_params, emit)


async def test_every_stage_sees_the_original_prompt_params_and_options(autojump_clock):
    cfg = {
        "stages": [
            {
                "id": "a",
                "backend": "tests.test_context:RecordsContext",
                "options": {"outputs": 2},
                "default_sampling_params": {"temperature": 0.5},
            },
            {
                "id": "b",
                "backend": "tests.test_context:RecordsContext",
                "inputs": ["a"],
                "final_output": True,
            },
        ]
    }
    RecordsContext.seen = []
    async with open_engine(cfg) as engine:
        await engine.generate(
            "hello",
            request_id="r",
            sampling_params={"b": {"max_tokens": 3}},
            priority=5,
            arrival_time=1.5,
            trace_headers={"traceparent": "00-abc"},
            tokenization_kwargs={"truncation": True},
        ).collect()
        backend = engine.pools["a"].replicas[0]
        assert backend.request_context("r") is None  # only while it runs there
    assert [sid for sid, _ in RecordsContext.seen] == ["a", "b"]
    (_, ctx_a), (_, ctx_b) = RecordsContext.seen
    assert ctx_a is ctx_b  # one context per request
    assert isinstance(ctx_a, RequestContext)
    assert ctx_a.request_id == "r" and ctx_a.prompt == "hello"
    assert ctx_a.sampling_params == {"a": {"temperature": 0.5}, "b": {"max_tokens": 3}}
    assert (ctx_a.priority, ctx_a.arrival_time) == (5, 1.5)
    assert ctx_a.trace_headers == {"traceparent": "00-abc"}
    assert ctx_a.tokenization_kwargs == {"truncation": True}
    assert "priority=5" in repr(ctx_a)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"priority": "high"}, "priority must be an int, not str"),
        ({"priority": True}, "priority must be an int, not bool"),
        ({"arrival_time": -1.0}, "arrival_time must be a finite, non-negative"),
        ({"arrival_time": float("nan")}, "arrival_time must be a finite, non-negative"),
        ({"trace_headers": {"a": 1}}, "trace_headers must be a mapping of str to str"),
        ({"tokenization_kwargs": ["x"]}, "tokenization_kwargs must be a mapping"),
    ],
)
async def test_bad_request_options_are_typed_errors_naming_the_option(
    autojump_clock, kwargs, message
):
    async with open_engine(scripted_pipeline(1)) as engine:
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate("x", **kwargs)
        assert engine.statistics().requests_total == 0
        assert (await engine.generate("x").collect())[-1].finished


def test_check_request_options_accepts_the_defaults():
    check_request_options(0, None, None, None)
    check_request_options(-3, 0.0, {"k": "v"}, {})
