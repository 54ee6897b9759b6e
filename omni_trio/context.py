"""What a request carries besides its input: :class:`RequestContext`, built once per request.

Every stage of the request sees it: backends through ``StageBackend.request_context``, input
processors through their ``context`` argument. It holds the request's original prompt (after
any ``prompt_transform`` hook), every stage's resolved sampling params, and the per-request
options vLLM takes (``priority``, ``arrival_time``, ``lora_request``, ``trace_headers``,
``tokenization_kwargs``); other backends may read or ignore them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ._values import direct_init
from .errors import InvalidRequestError
from .outputs import Prompt, SamplingParams, StageInput

__all__ = ["Artifacts", "PlannedCompanion", "RequestContext", "check_request_options"]


class Artifacts(Protocol):
    """What a request holds of the directories its ``prompt_transform`` hooks left: they are
    deleted once, whoever gets there first (:mod:`omni_trio.request.hooks` makes them)."""

    @property
    def removed(self) -> bool:
        """Whether they were deleted (or their deletion has begun)."""
        ...

    def take(self) -> list[str]:
        """The directories to delete, once: later calls get ``[]``. Synchronous."""
        ...

    def remove_nowait(self) -> None:
        """Delete them now, on this thread. Blocking."""
        ...


@dataclass(frozen=True, slots=True)
class PlannedCompanion:
    """A checked CFG companion (:mod:`omni_trio.request.companions`): its role, its id on the entry
    stage, its input and params."""

    role: str
    request_id: str
    first_input: StageInput
    sampling_params: SamplingParams


@direct_init  # one per request: see omni_trio._values
@dataclass(frozen=True, slots=True, weakref_slot=True)
class RequestContext:
    """One request's context, shared by all its stages. Immutable."""

    request_id: str
    #: the prompt as the caller gave it (after the entry stage's prompt_transform, if any)
    prompt: Prompt
    #: every stage's sampling params, resolved (stage defaults merged), by stage id
    sampling_params: Mapping[str, SamplingParams] = field(default_factory=dict)
    #: scheduling priority (vLLM: lower runs first under the priority scheduling policy)
    priority: int = 0
    #: when the request arrived (``time.time()``), if the caller knows better than the engine
    arrival_time: float | None = None
    #: a vLLM ``LoRARequest`` (or a backend's own adapter reference)
    lora_request: object = None
    #: tracing headers handed to the engine (W3C ``traceparent`` ...)
    trace_headers: Mapping[str, str] | None = None
    #: extra tokenizer arguments for the prompt (vLLM ``tokenization_kwargs``)
    tokenization_kwargs: Mapping[str, object] | None = None
    #: the caller sends the entry stage's input in segments (``RequestStream.send_input``)
    streaming_input: bool = False
    #: the directories the prompt_transform hooks returned, deleted when the request ends
    #: (:mod:`omni_trio.request.hooks`; weakly referenceable so that a stream dropped unentered
    #: still has them deleted)
    artifacts: Artifacts | None = None
    #: the entry stage's ``prompt_expand`` companions (:mod:`omni_trio.request.companions`), and
    #: that stage
    companions: tuple[PlannedCompanion, ...] = ()
    companion_stage: str | None = None

    def __repr__(self) -> str:
        extras = [
            f"{name}={value!r}"
            for name, value in (
                ("priority", self.priority),
                ("arrival_time", self.arrival_time),
                ("lora_request", self.lora_request),
                ("trace_headers", self.trace_headers),
                ("tokenization_kwargs", self.tokenization_kwargs),
                ("streaming_input", self.streaming_input),
                ("companions", tuple(c.role for c in self.companions)),
            )
            if value not in (None, 0, False, ())
        ]
        return f"<RequestContext {self.request_id!r} stages={list(self.sampling_params)}" + (
            " " + " ".join(extras) + ">" if extras else ">"
        )


def check_request_options(
    priority: object,
    arrival_time: object,
    trace_headers: object,
    tokenization_kwargs: object,
) -> None:
    """Check the per-request options ``generate()`` takes (pure). Raises
    :class:`InvalidRequestError` naming the option and what it must be."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an int, not {type(priority).__name__}")
    if arrival_time is not None and (
        not isinstance(arrival_time, (int, float))
        or isinstance(arrival_time, bool)
        or not math.isfinite(arrival_time)
        or arrival_time < 0
    ):
        raise InvalidRequestError(
            f"arrival_time must be a finite, non-negative time.time() value, not {arrival_time!r}"
        )
    if trace_headers is not None and not (
        isinstance(trace_headers, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in trace_headers.items())
    ):
        raise InvalidRequestError("trace_headers must be a mapping of str to str")
    if tokenization_kwargs is not None and not (
        isinstance(tokenization_kwargs, Mapping)
        and all(isinstance(k, str) for k in tokenization_kwargs)
    ):
        raise InvalidRequestError("tokenization_kwargs must be a mapping with str keys")
