"""Messages between the vllm backend (caller side) and its worker thread, and the pure
conversions between omni-trio and vLLM values. No vllm import here.

Results cross the thread boundary as :mod:`outcome` values: the start result
(``Outcome[Ready]``) on the event bridge, then :class:`Died` if the engine dies; each RPC's
``Outcome`` on its reply bridge; a request's failure as an ``outcome.Error`` after its
outputs. The caller unwraps them, so the worker's exception is raised on its side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import outcome

from ..errors import InvalidRequestError, ReplicaDeadError
from ..outputs import StageInput, StageOutput
from ..transport.bridge import BridgeSender

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
@dataclass(frozen=True, slots=True)
class Submit:
    request_id: str
    prompt: StageInput
    sampling_params: Any  # the user's: None, a dict or a vllm SamplingParams
    out: BridgeSender[StageOutput | outcome.Error]


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


#: what the worker reports on its event bridge: its start outcome, then maybe a death
Event = outcome.Outcome[Ready] | Died


def engine_died(name: str, exc: BaseException) -> outcome.Error:
    """A request failure because the engine died: it travels as :class:`ReplicaDeadError`
    (caused by vLLM's error), so the caller tells it apart without importing vllm. Pure."""
    error = ReplicaDeadError(f"replica {name}: engine died: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return outcome.Error(error)


# -- pure helpers -------------------------------------------------------------------------
def merge_engine_args(engine_args: dict[str, Any], *, on_cpu: bool) -> dict[str, Any]:
    """The stage's engine args over the CPU defaults (on CPU only). Pure."""
    return {**CPU_ENGINE_DEFAULTS, **engine_args} if on_cpu else dict(engine_args)


def check_sampling_keys(params: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Raise InvalidRequestError naming the first key SamplingParams does not have. Pure."""
    for key in params:
        if key not in fields:
            raise InvalidRequestError(
                f"sampling_params key {key!r} is not a vllm SamplingParams field "
                f"(output_kind is always DELTA)"
            )


def metrics_of(ro: Any) -> dict[str, Any] | None:
    """vLLM's per-request metrics of a RequestOutput as a plain dict (None if absent)."""
    m = getattr(ro, "metrics", None)
    out: dict[str, Any] = {}
    if m is not None and dataclasses.is_dataclass(m) and not isinstance(m, type):
        out.update(dataclasses.asdict(m))
    if getattr(ro, "num_cached_tokens", None) is not None:
        out["num_cached_tokens"] = ro.num_cached_tokens
    if ro.prompt_token_ids is not None:
        out["num_prompt_tokens"] = len(ro.prompt_token_ids)
    return out or None


def to_stage_output(ro: Any) -> StageOutput:
    comp = ro.outputs[0]
    return StageOutput(
        token_ids=tuple(comp.token_ids),
        text=comp.text,
        finished=bool(ro.finished),
        finish_reason=comp.finish_reason if ro.finished else None,
        metrics=metrics_of(ro),
    )
