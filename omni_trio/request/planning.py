"""Request planning: which stages a request runs on and what each stage's sampling params are.

Pure functions of the pipeline config and the request's arguments; no I/O, no checkpoints.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..config.graph import few_ids, some_ids
from ..config.pipeline import PipelineConfig
from ..config.stageinfo import modality_stages
from ..errors import InvalidRequestError
from ..outputs import SamplingParams, StageInput

__all__ = [
    "RequestPlan",
    "RoutePlanner",
    "plan_request",
    "prompt_to_input",
    "resolve_sampling_params",
    "stage_path",
    "stage_ref",
]

#: how a request's stage is run (see :func:`stage_path`)
StagePath = Literal["pulled", "collected", "routed"]


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Which stages a request runs on (graph order), which of them take the prompt (its entry
    stages: the active stages without inputs, graph order) and which the caller receives.
    ``output_set`` is ``outputs`` as a set (a membership test per output stays O(1) when a
    route has thousands of output stages)."""

    active: tuple[str, ...]
    outputs: tuple[str, ...]
    entries: tuple[str, ...]
    output_set: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_set", frozenset(self.outputs))


def stage_path(*, output: bool, feeds: int, streamed: bool, observed: bool) -> StagePath:
    """How the orchestrator runs one stage of a request (pure).

    ``"pulled"``: an output stage feeding no other stage; its outputs go to the consumer's
    queue as emitted and the consumer builds the OmniOutputs. ``"collected"``: a stage whose
    outputs nobody needs as they come (``streamed`` false: no caller, no streaming downstream
    stage); they are routed downstream once its backend returned. ``"routed"``: anything
    else, or any stage while observers watch (their per-output events need a routing task):
    a routing task beside the backend delivers each output.
    """
    if observed:
        return "routed"
    if output and not feeds:
        return "pulled"
    if not streamed:
        return "collected"
    return "routed"


def prompt_to_input(prompt: object) -> StageInput:
    """The entry stages' input for a prompt: text, token ids, or a prompt dict (pure).
    Raises InvalidRequestError saying what is wrong with it."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is an empty string")
        return StageInput(prompt=prompt)
    if isinstance(prompt, Mapping):
        if not prompt:
            raise InvalidRequestError("prompt dict is empty")
        return StageInput(data=dict(prompt))
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise InvalidRequestError("prompt token id list is empty")
        ids = tuple(prompt)
        # plain ints (the common case) checked in C; anything else one by one
        plain = set(map(type, ids)) == {int}
        if not (plain and min(ids) >= 0) and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise InvalidRequestError("prompt token ids must be non-negative integers")
        return StageInput(token_ids=ids)
    raise InvalidRequestError(
        f"prompt must be a str, a list of token ids or a prompt dict, not {type(prompt).__name__}"
    )


def stage_ref(cfg: PipelineConfig, ref: str | int, what: str) -> str:
    """The stage id for a stage id or index (pure). Raises InvalidRequestError naming ``ref``."""
    if isinstance(ref, int) and not isinstance(ref, bool):
        if 0 <= ref < len(cfg.stages):
            return cfg.stages[ref].id
        raise InvalidRequestError(
            f"{what} {ref} is not a stage index (the pipeline has {len(cfg.stages)} stages)"
        )
    graph = cfg.graph()
    if isinstance(ref, str) and ref in graph.index:
        return ref
    raise InvalidRequestError(
        f"{what} {ref!r} is not a stage of the pipeline; {some_ids(graph.ids)}"
    )


def plan_request(
    cfg: PipelineConfig,
    final_stage_id: str | int | None = None,
    output_stages: Sequence[str | int] | None = None,
    output_modalities: Sequence[str] | None = None,
) -> RequestPlan:
    """Decide a request's stages (pure). Raises InvalidRequestError naming the bad stage.

    With ``final_stage_id`` only that stage and what it depends on run; the default
    ``output_stages`` are the ``final_output`` stages among those, plus the final stage.
    ``output_modalities`` picks the output stages by their ``output_type`` instead
    (:func:`~omni_trio.config.stageinfo.modality_stages`; it cannot be combined with
    ``output_stages``). Either way only the output stages and what they depend on run: the
    route ends after the last output stage (a text-only answer never runs the talker).
    """
    # linear in the stages and edges: a request's route is planned at once at any size
    graph = cfg.graph()
    allowed: Collection[str] = graph.index
    final: str | None = None
    if final_stage_id is not None:
        final = stage_ref(cfg, final_stage_id, "final_stage_id")
        allowed = graph.closure((final,))
    if output_modalities is not None:
        if output_stages is not None:
            raise InvalidRequestError(
                "output_modalities and output_stages cannot be combined: output_modalities "
                "picks the output stages by their output_type; give one of them"
            )
        output_stages = modality_stages(cfg, output_modalities, None if final is None else allowed)
    if output_stages is None:
        outs = [s for s in cfg.final_output_stages if s in allowed]
        if final is not None and final not in outs:
            outs.append(final)
    else:
        if isinstance(output_stages, (str, int)):
            output_stages = [output_stages]
        chosen: dict[str, None] = {}
        for ref in output_stages:
            sid = stage_ref(cfg, ref, "output stage")
            if sid not in allowed:
                raise InvalidRequestError(
                    f"output stage {sid!r} does not run when final_stage_id is {final!r}: "
                    f"only {few_ids(sorted(allowed, key=graph.index.__getitem__))} do"
                )
            chosen[sid] = None
        outs = list(chosen)
    if not outs:
        raise InvalidRequestError("the request has no output stage: output_stages is empty")
    needed = graph.closure(outs)
    active = tuple(s for s in graph.order if s in needed)
    entries = tuple(s for s in active if not cfg.stage(s).inputs)
    return RequestPlan(
        active=active, outputs=tuple(sorted(outs, key=graph.index.__getitem__)), entries=entries
    )


class RoutePlanner:
    """Plans a pipeline's requests once per distinct route (``final_stage_id``,
    ``output_stages`` and ``output_modalities``), not per request. Synchronous; keeps at most
    ``size`` routes."""

    def __init__(self, cfg: PipelineConfig, size: int = 256) -> None:
        self._cfg = cfg
        self._size = size
        self._plans: dict[tuple[object, object, object], RequestPlan] = {}

    def plan(
        self,
        final_stage_id: str | int | None = None,
        output_stages: Sequence[str | int] | None = None,
        output_modalities: Sequence[str] | None = None,
    ) -> RequestPlan:
        """:func:`plan_request` for this pipeline, remembered. Raises InvalidRequestError."""
        key = (final_stage_id, _route_key(output_stages), _route_key(output_modalities))
        if not _hashable(key):  # a stage reference no dict can hold: planned, not cached
            return plan_request(self._cfg, final_stage_id, output_stages, output_modalities)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_request(self._cfg, final_stage_id, output_stages, output_modalities)
            if len(self._plans) < self._size:
                self._plans[key] = plan
        return plan


def _route_key(refs: object) -> object:
    # a list of stage refs or modalities keys like the tuple of it; a str or int is itself;
    # any other iterable is not cached (a list key is unhashable): keying a generator by
    # identity would only fill the cache
    if refs is None or isinstance(refs, (str, int)):
        return refs
    return tuple(refs) if isinstance(refs, Sequence) else [refs]


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _keyed_by_stage(cfg: PipelineConfig, value: Mapping[object, object]) -> bool:
    """Whether a sampling-params mapping is keyed by stage (True) or is one params mapping for
    every stage (False). A mapping with some stage keys and some others is a typo: raises
    InvalidRequestError naming the first key that is no stage id or index."""
    graph = cfg.graph()
    ids = graph.index
    n = len(cfg.stages)

    def is_stage(k: object) -> bool:
        if isinstance(k, int) and not isinstance(k, bool):
            return 0 <= k < n
        return isinstance(k, str) and k in ids

    stage_keys = [k for k in value if is_stage(k)]
    if not stage_keys and not any(isinstance(k, int) and not isinstance(k, bool) for k in value):
        return False
    if len(stage_keys) == len(value):
        return True
    unknown = next(k for k in value if not is_stage(k))
    raise InvalidRequestError(
        f"sampling_params is keyed by stage ({stage_keys[0]!r} is a stage) but {unknown!r} is "
        f"neither a stage id nor a stage index; {some_ids(graph.ids)}"
        if stage_keys
        else f"sampling_params key {unknown!r} is not a stage index (the pipeline has {n} stages)"
    )


def resolve_sampling_params(cfg: PipelineConfig, value: object) -> dict[str, SamplingParams]:
    """Per-stage sampling params (pure): ``value`` is one value for all stages, a list (one per
    stage), or a dict keyed by stage id (or index). Plain dicts are merged over each stage's
    ``default_sampling_params``; other objects (a vLLM ``SamplingParams``) pass unchanged."""
    ids = cfg.graph().ids
    per_stage: dict[str, object]
    if value is None:
        per_stage = {sid: None for sid in ids}
    elif isinstance(value, (list, tuple)):
        if len(value) != len(ids):
            raise InvalidRequestError(
                f"sampling_params as a list needs one entry per stage "
                f"({len(ids)}: {few_ids(ids)}), got {len(value)}"
            )
        per_stage = dict(zip(ids, value, strict=True))
    elif isinstance(value, Mapping) and value and _keyed_by_stage(cfg, value):
        per_stage = {sid: None for sid in ids}
        for k, v in value.items():
            per_stage[ids[k] if isinstance(k, int) else k] = v
    else:
        per_stage = {sid: value for sid in ids}
    out: dict[str, SamplingParams] = {}
    for st in cfg.stages:
        v = per_stage[st.id]
        if v is None:
            out[st.id] = dict(st.default_sampling_params)
        elif isinstance(v, Mapping):
            out[st.id] = {**st.default_sampling_params, **v}
        else:
            out[st.id] = v
    return out
