"""Stage metadata: what each stage of a pipeline is and produces, and what the pipeline can do.

:class:`StageInfo` is the frozen public description of one stage (``engine.stages``);
:func:`supported_tasks` derives the pipeline's tasks from them; :func:`modality_stages`
picks the stages that answer in the requested output modalities (``generate(...,
output_modalities=...)``). Everything here is pure and synchronous: no I/O, no checkpoints.

Output modalities are the stages' ``output_type`` values (``text``, ``tokens``, ``audio``,
``image``, ``tensor``) and each matches only its own type. In particular ``"text"`` does
*not* match ``tokens`` stages: a ``tokens`` stage (an omni talker's codec tokens) produces ids
for the next model, not an answer a reader wants, and matching it would make a text-only
answer run the talker. OpenAI's chat modalities (``"text"``, ``"audio"``) are a subset.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidRequestError
from .pipeline import PipelineConfig, topological_order
from .stage import OUTPUT_TYPES, OutputType

__all__ = [
    "OUTPUT_MODALITIES",
    "StageInfo",
    "SupportedTask",
    "audio_stage",
    "image_stage",
    "modality_stages",
    "produced_modalities",
    "stage_infos",
    "supported_tasks",
    "text_stage",
]

#: the output modalities a request may ask for: every stage ``output_type``
OUTPUT_MODALITIES: tuple[str, ...] = OUTPUT_TYPES

#: what a pipeline can serve: ``generate`` (text out), ``speech`` (audio out), ``image``
#: (images out)
SupportedTask = Literal["generate", "speech", "image"]


@dataclass(frozen=True, slots=True)
class StageInfo:
    """One stage as users see it (frozen). ``index`` is its position in the config,
    ``inputs`` its upstream stage ids (none for an entry stage), ``final_output`` whether its
    outputs reach callers by default, ``replicas`` how many replicas the stage has now
    (members, ready or not: the configured count until ``add_replica``/``remove_replica``
    change it)."""

    id: str
    index: int
    backend: str
    output_type: OutputType
    inputs: tuple[str, ...]
    final_output: bool
    replicas: int


def stage_infos(
    cfg: PipelineConfig, replicas: Mapping[str, int] | None = None
) -> tuple[StageInfo, ...]:
    """Every stage's :class:`StageInfo`, in config order. ``replicas`` overrides the
    configured replica counts by stage id (the live membership of a running engine)."""
    counts = replicas or {}
    return tuple(
        StageInfo(
            id=st.id,
            index=i,
            backend=st.backend,
            output_type=st.output_type,
            inputs=tuple(st.inputs),
            final_output=st.final_output,
            replicas=counts.get(st.id, st.replicas),
        )
        for i, st in enumerate(cfg.stages)
    )


def supported_tasks(stages: Sequence[StageInfo]) -> tuple[SupportedTask, ...]:
    """The tasks a pipeline serves: ``generate`` when a stage produces text (``output_type:
    text``; ``tokens`` stages do not count), ``speech`` when an audio stage can be final,
    ``image`` when an image stage can be.

    Every stage *can* be a request's final stage (``final_stage_id``, ``output_stages`` or
    ``output_modalities`` select any of them, ``final_output`` only sets the default), so
    ``speech`` means: the pipeline has an audio stage, whether or not it is marked
    ``final_output``. This is also when the server's ``/v1/audio/speech`` answers (and, for
    ``image``, ``/v1/images/generations``)."""
    types = {st.output_type for st in stages}
    tasks: list[SupportedTask] = []
    if "text" in types:
        tasks.append("generate")
    if "audio" in types:
        tasks.append("speech")
    if "image" in types:
        tasks.append("image")
    return tuple(tasks)


def produced_modalities(
    cfg: PipelineConfig, allowed: Collection[str] | None = None
) -> dict[str, list[str]]:
    """Output type -> the stages producing it (graph order), for the types the pipeline (or
    its stages in ``allowed``) has. Pure."""
    out: dict[str, list[str]] = {}
    for sid in topological_order(cfg):
        if allowed is None or sid in allowed:
            out.setdefault(cfg.stage(sid).output_type, []).append(sid)
    return out


def _describe(produced: Mapping[str, list[str]], where: str) -> str:
    if not produced:
        return f"no stage {where} produces anything"
    parts = (f"{kind} ({', '.join(sids)})" for kind, sids in produced.items())
    return f"the stages {where} produce " + ", ".join(parts)


def modality_stages(
    cfg: PipelineConfig,
    modalities: Sequence[str] | str,
    allowed: Collection[str] | None = None,
) -> list[str]:
    """The output stages answering in ``modalities`` (graph order, no repeats). Pure.

    For each modality: the stages of that ``output_type`` marked ``final_output``; when none
    is, the last stage of that type in graph order (the most processed one). Only stages in
    ``allowed`` (default: all; a request's ``final_stage_id`` narrows it) are considered.
    A str is one modality. Raises :class:`InvalidRequestError` for an empty or non-string
    list, an unknown modality, or one no allowed stage produces (naming it and what the
    pipeline produces).
    """
    if isinstance(modalities, str):
        modalities = (modalities,)
    if not isinstance(modalities, Sequence) or not modalities:
        raise InvalidRequestError(
            "output_modalities must be a non-empty list of output types "
            f"({', '.join(OUTPUT_MODALITIES)}), got {modalities!r}"
        )
    produced = produced_modalities(cfg, allowed)
    where = "of the pipeline" if allowed is None else "that run for this request"
    chosen: set[str] = set()
    for modality in modalities:
        if not isinstance(modality, str) or modality not in OUTPUT_MODALITIES:
            raise InvalidRequestError(
                f"output modality {modality!r} is not one of {', '.join(OUTPUT_MODALITIES)}; "
                + _describe(produced, where)
            )
        stages = produced.get(modality)
        if not stages:
            raise InvalidRequestError(
                f"no stage {where} produces output modality {modality!r}; "
                + _describe(produced, where)
            )
        finals = [sid for sid in stages if cfg.stage(sid).final_output]
        chosen.update(finals or stages[-1:])
    return [sid for sid in topological_order(cfg) if sid in chosen]


def text_stage(cfg: PipelineConfig) -> str:
    """The stage that answers in text: the first final-output text stage, else the first
    text stage, else the entry stage. Pure."""
    for st in cfg.stages:
        if st.final_output and st.output_type == "text":
            return st.id
    for st in cfg.stages:
        if st.output_type == "text":
            return st.id
    return cfg.entry_stages[0]


def _last_of_type(cfg: PipelineConfig, output_type: OutputType) -> str | None:
    found = [st.id for st in cfg.stages if st.output_type == output_type]
    return found[-1] if found else None


def audio_stage(cfg: PipelineConfig) -> str | None:
    """The stage whose outputs are the pipeline's audio (the last audio stage), or None."""
    return _last_of_type(cfg, "audio")


def image_stage(cfg: PipelineConfig) -> str | None:
    """The stage whose outputs are the pipeline's images (the last image stage), or None.
    Pure."""
    return _last_of_type(cfg, "image")
