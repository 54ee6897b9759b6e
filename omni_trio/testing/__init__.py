"""Helpers for deterministic tests of applications built on omni-trio.

Typical use, with pytest-trio and ``trio.testing.MockClock(autojump_threshold=0)``::

    from omni_trio.testing import scripted_pipeline, assert_nothing_in_flight

    async def test_my_app(autojump_clock):
        cfg = scripted_pipeline(["thinker", "talker"], outputs=4, latency_s=0.01)
        async with omni_trio.open_engine(cfg) as engine:
            await my_app(engine)
            assert_nothing_in_flight(engine)

Cancellation at every checkpoint of your own consumer code: :func:`cancel_at_every_checkpoint`
(see :mod:`omni_trio.testing.cancellation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..config.loading import load_config
from ..config.pipeline import PipelineConfig
from ..engine.engine import Engine
from ..stages.scripted import ScriptedBackend, scripted_tokens
from ._checks import (
    assert_nothing_in_flight,
    in_flight_problems,
    wait_until_idle,
    wait_until_settled,
)
from .cancellation import CancellationFailure, CancellationReport, cancel_at_every_checkpoint

__all__ = [
    "CancellationFailure",
    "CancellationReport",
    "assert_nothing_in_flight",
    "cancel_at_every_checkpoint",
    "in_flight_problems",
    "scripted_backends",
    "scripted_pipeline",
    "scripted_tokens",
    "wait_until_idle",
    "wait_until_settled",
]


def scripted_pipeline(
    stages: int | Sequence[str] = 2,
    *,
    name: str = "scripted",
    stage_options: Mapping[str, Mapping[str, Any]] | None = None,
    stream_input: bool | Sequence[str] = False,
    final_outputs: Sequence[str] | None = None,
    replicas: int | Mapping[str, int] = 1,
    engine_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> PipelineConfig:
    """A validated linear pipeline of ``scripted`` stages (``s0 -> s1 -> ...`` or the given ids).

    ``options`` apply to every stage (``outputs=4, latency_s=0.01``), ``stage_options`` to
    one stage (``{"s1": {"fail_at_output": 2}}``). ``stream_input`` is True for all stages
    after the first, or a list of stage ids. ``final_outputs`` defaults to the last stage.
    ``replicas`` is one count or a count per stage. ``engine_options`` are top-level keys
    (``max_requests_in_flight``...). Synchronous; raises ConfigError.
    """
    ids = [f"s{i}" for i in range(stages)] if isinstance(stages, int) else list(stages)
    finals = set(final_outputs if final_outputs is not None else ids[-1:])
    per_stage = dict(stage_options or {})
    streaming = set(ids[1:]) if stream_input is True else set(stream_input or ())
    cfg_stages = []
    for i, sid in enumerate(ids):
        cfg_stages.append(
            {
                "id": sid,
                "backend": "scripted",
                "inputs": [ids[i - 1]] if i else [],
                "options": {**options, **per_stage.get(sid, {})},
                "final_output": sid in finals,
                "output_type": "text",
                "stream_input": sid in streaming,
                "replicas": replicas.get(sid, 1) if isinstance(replicas, Mapping) else replicas,
            }
        )
    return load_config({"name": name, "stages": cfg_stages, **dict(engine_options or {})})


def scripted_backends(engine: Engine, stage_id: str) -> list[ScriptedBackend]:
    """The scripted replicas of a stage (to assert on ``received`` / ``aborted``)."""
    replicas = engine.pools[stage_id].replicas
    out = [r for r in replicas if isinstance(r, ScriptedBackend)]
    if len(out) != len(replicas):
        raise TypeError(f"stage {stage_id!r} is not a scripted stage")
    return out
