"""The vllm backend's pure parts: per-request flow control and output conversion."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_trio.backends.vllm.protocol import Flow, died_of, to_stage_output
from omni_trio.errors import ReplicaDeadError, StageError


def test_flow_stalls_without_credit_and_resumes_at_half_the_window() -> None:
    flow = Flow(4)
    assert [flow.reserve() for _ in range(5)] == [True, True, True, True, False]
    assert "stalled=True" in repr(flow)
    # taking one leaves 3 of 4 in flight: no resume; the second leaves half: resume, once
    assert [flow.took(), flow.took()] == [False, True]
    assert flow.reserve() and not flow.took()
    assert "in_flight=2/4 stalled=False" in repr(flow)


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class _Metrics:
    num_generation_tokens: int


@dataclass
class _RequestOutput:
    outputs: list[_Completion]
    finished: bool
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    metrics: _Metrics | None = None
    num_cached_tokens: int | None = 0
    kv_transfer_params: dict[str, object] | None = None


def test_metrics_are_built_only_for_the_finished_output() -> None:
    delta = to_stage_output(_RequestOutput([_Completion([5, 6], "ab", None)], finished=False))
    assert (delta.token_ids, delta.text, delta.finished, delta.metrics) == (
        (5, 6),
        "ab",
        False,
        None,
    )
    last = to_stage_output(
        _RequestOutput([_Completion([7], "c", "length")], True, metrics=_Metrics(3))
    )
    assert (last.token_ids, last.finished, last.finish_reason) == ((7,), True, "length")
    assert last.metrics == {
        "num_generation_tokens": 3,
        "num_cached_tokens": 0,
        "num_prompt_tokens": 3,
        # the prompt as the engine saw it: a Qwen-Omni talker stage conditions on it
        "prompt_token_ids": (1, 2, 3),
    }


def test_a_prefill_engines_kv_transfer_params_ride_on_the_finished_output() -> None:
    # what a KV connector returned (RequestOutput.kv_transfer_params): the decode stage of a
    # prefill/decode pair is started with them (omni_trio.request.pd); a copy, not vLLM's
    returned: dict[str, object] = {"do_remote_prefill": True, "remote_block_ids": [4, 5]}
    ro = _RequestOutput([_Completion([7], "c", "length")], True, kv_transfer_params=returned)
    metrics = to_stage_output(ro).metrics
    assert metrics is not None and metrics["kv_transfer_params"] == returned
    assert metrics["kv_transfer_params"] is not returned
    plain = to_stage_output(_RequestOutput([_Completion([7], "c", "length")], True)).metrics
    assert plain is not None and "kv_transfer_params" not in plain


@dataclass
class _NestedMetrics:
    num_generation_tokens: int
    spans: list[float]


def test_metrics_are_plain_values_that_share_nothing_with_vllms() -> None:
    nested = _NestedMetrics(2, [0.5, 1.5])
    ro = _RequestOutput([_Completion([7], "c", "stop")], True, metrics=nested)  # type: ignore[arg-type]
    metrics = to_stage_output(ro).metrics
    assert metrics is not None and metrics["spans"] == [0.5, 1.5]
    # a nested value is a copy: vLLM changing its own does not change the output's
    nested.spans.append(9.0)
    assert metrics["spans"] == [0.5, 1.5] and metrics["num_generation_tokens"] == 2


def test_request_options_only_what_is_not_vllms_default() -> None:
    from omni_trio.backends.vllm.protocol import request_options
    from omni_trio.context import RequestContext

    plain = RequestContext("r", "hi")
    assert request_options(plain, entry=True, traced=True) is None
    assert request_options(plain, entry=False, traced=True) is None
    full = RequestContext(
        "r",
        "hi",
        priority=-2,
        arrival_time=12,
        lora_request="an adapter",
        trace_headers={"traceparent": "00-abc"},
        tokenization_kwargs={"truncate_prompt_tokens": 2},
    )
    assert request_options(full, entry=True, traced=True) == {
        "priority": -2,
        "arrival_time": 12.0,
        "trace_headers": {"traceparent": "00-abc"},
        "lora_request": "an adapter",
        "tokenization_kwargs": {"truncate_prompt_tokens": 2},
    }
    # a downstream stage's prompt is upstream tokens: the prompt's options stay upstream
    assert request_options(full, entry=False, traced=True) == {
        "priority": -2,
        "arrival_time": 12.0,
        "trace_headers": {"traceparent": "00-abc"},
    }
    # an engine without an otlp_traces_endpoint would drop them with a warning
    assert request_options(full, entry=False, traced=False) == {
        "priority": -2,
        "arrival_time": 12.0,
    }
    only_trace = RequestContext("r", "hi", trace_headers={"traceparent": "00-abc"})
    assert request_options(only_trace, entry=True, traced=False) is None
    only_prompt = RequestContext("r", "hi", tokenization_kwargs={"add_special_tokens": False})
    assert request_options(only_prompt, entry=False, traced=True) is None
    assert request_options(only_prompt, entry=True, traced=True) == {
        "tokenization_kwargs": {"add_special_tokens": False}
    }


def test_died_of_tells_a_crash_the_replica_died_of_from_a_new_one() -> None:
    task_error = RuntimeError("abort broke")
    death = ReplicaDeadError("replica a[0]: request 'r' could not be dropped")
    death.__cause__ = task_error
    stop_failure = StageError("replica a[0]: 1 request task(s) failed while the worker stopped")
    stop_failure.__cause__ = task_error
    assert died_of(death, stop_failure)  # the one task error its death reported
    loop_crash = OSError("loop broke")
    crashed = ReplicaDeadError("replica a[0]: its worker's loop crashed")
    crashed.__cause__ = loop_crash
    assert died_of(crashed, loop_crash)
    other = StageError("replica a[0]: 1 request task(s) failed while the worker stopped")
    other.__cause__ = RuntimeError("another")
    assert not died_of(death, other)  # a failure the death did not report
    assert not died_of(None, stop_failure)  # a replica that did not die
    assert not died_of(ReplicaDeadError("killed"), loop_crash)  # died of something else
