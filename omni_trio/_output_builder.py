"""The :class:`OutputBuilder`: the :class:`~omni_trio.outputs.OmniOutput` a caller gets for a
stage's output, built by setting its slots (a :data:`Convert`; the orchestrator makes one per
engine, each :class:`~omni_trio.requests.Request` holds it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .outputs import OmniOutput, StageOutput

__all__ = ["Convert", "OutputBuilder"]

#: builds the OmniOutput a caller gets (request id, stage id, the stage's output)
Convert = Callable[[str, str, StageOutput], OmniOutput]

# OmniOutput's slots, set directly: its frozen dataclass __init__ sets each field through
# object.__setattr__, 2.6 us per output against 0.8 us (one OmniOutput per output a caller
# reads). tests/test_output_builder.py checks these are all of its fields, in order.
_SLOTS = OmniOutput.__dict__
_set_request_id = _SLOTS["request_id"].__set__
_set_stage_id = _SLOTS["stage_id"].__set__
_set_stage_index = _SLOTS["stage_index"].__set__
_set_kind = _SLOTS["kind"].__set__
_set_text = _SLOTS["text"].__set__
_set_token_ids = _SLOTS["token_ids"].__set__
_set_data = _SLOTS["data"].__set__
_set_finished = _SLOTS["finished"].__set__
_set_finish_reason = _SLOTS["finish_reason"].__set__
_set_metrics = _SLOTS["metrics"].__set__
_BUILT_FIELDS = (
    "request_id",
    "stage_id",
    "stage_index",
    "kind",
    "text",
    "token_ids",
    "data",
    "finished",
    "finish_reason",
    "metrics",
)


class OutputBuilder:
    """Builds the :class:`OmniOutput` a caller gets for a stage's output (a
    :data:`Convert`): the stage's index and ``output_type`` from the config, the rest from
    the output. Synchronous, pure."""

    __slots__ = ("_kinds",)

    def __init__(self, stages: Sequence[tuple[str, str]]) -> None:
        # stage id -> (index, output type), from (stage id, output type) in config order
        self._kinds = {sid: (i, kind) for i, (sid, kind) in enumerate(stages)}

    def __call__(self, request_id: str, stage_id: str, out: StageOutput) -> OmniOutput:
        index, kind = self._kinds[stage_id]
        built: OmniOutput = object.__new__(OmniOutput)
        _set_request_id(built, request_id)
        _set_stage_id(built, stage_id)
        _set_stage_index(built, index)
        _set_kind(built, kind)
        _set_text(built, out.text)
        token_ids = out.token_ids
        _set_token_ids(built, token_ids if type(token_ids) is tuple else tuple(token_ids))
        _set_data(built, out.data)
        _set_finished(built, out.finished)
        _set_finish_reason(built, out.finish_reason)
        _set_metrics(built, out.metrics)
        return built
