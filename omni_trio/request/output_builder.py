"""The :class:`OutputBuilder`: the :class:`~omni_trio.outputs.OmniOutput` a caller gets for a
stage's output (a :data:`Convert`; the orchestrator makes one per engine, each
:class:`~omni_trio.request.state.Request` holds it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..outputs import OmniOutput, StageOutput

__all__ = ["Convert", "OutputBuilder"]

#: builds the OmniOutput a caller gets (request id, stage id, the stage's output)
Convert = Callable[[str, str, StageOutput], OmniOutput]


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
        token_ids = out.token_ids
        # positional: OmniOutput's __init__ sets its slots directly (omni_trio._values)
        return OmniOutput(
            request_id,
            stage_id,
            index,
            kind,
            out.text,
            token_ids if type(token_ids) is tuple else tuple(token_ids),
            out.data,
            out.finished,
            out.finish_reason,
            out.metrics,
        )
