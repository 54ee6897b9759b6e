"""Helpers for deterministic tests of applications built on omni-trio.

Typical use, with pytest-trio and ``trio.testing.MockClock(autojump_threshold=0)``::

    from omni_trio.testing import scripted_pipeline, assert_nothing_in_flight

    async def test_my_app(autojump_clock):
        cfg = scripted_pipeline(["thinker", "talker"], outputs=4, latency_s=0.01)
        async with omni_trio.open_engine(cfg) as engine:
            await my_app(engine)
            assert_nothing_in_flight(engine)

Its modules:

- here: :func:`scripted_pipeline` and :func:`fake_engine_pipeline` (linear pipelines of
  ``scripted`` or fake engine stages), :func:`scripted_backends` and
  :func:`fake_engine_backends` (a stage's replicas, to assert on);
- :mod:`~omni_trio.testing.cancellation`: :func:`cancel_at_every_checkpoint`, which cancels
  your own consumer code at each of its checkpoints in turn;
- :mod:`~omni_trio.testing.fake_engine`: :class:`FakeEngine`, a fake batching engine with
  fixed-time steps (slots, a queue for them), and :class:`FakeEngineBackend`, the stage
  that drives one (``backend: "omni_trio.testing.fake_engine:FakeEngineBackend"``);
- :mod:`~omni_trio.testing.exact_clock`: :class:`ExactStepClock`, a trio clock whose sleeps
  end at their deadline, for benchmarks that time fixed-time steps;
- ``_checks``: :func:`assert_nothing_in_flight`, :func:`in_flight_problems`,
  :func:`wait_until_idle`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ..backends.scripted import ScriptedBackend, scripted_tokens
from ..config.loading import load_config
from ..config.pipeline import PipelineConfig
from ..engine.engine import Engine
from ..stages.backend import StageBackend
from ._checks import (
    assert_nothing_in_flight,
    in_flight_problems,
    wait_until_idle,
    wait_until_settled,
)
from .cancellation import CancellationFailure, CancellationReport, cancel_at_every_checkpoint
from .exact_clock import ExactStepClock
from .fake_engine import (
    FakeEngine,
    FakeEngineBackend,
    FakeEngineOptions,
    FakeEngineStatistics,
    FakeRequest,
)

__all__ = [
    "CancellationFailure",
    "CancellationReport",
    "FAKE_ENGINE_BACKEND",
    "ExactStepClock",
    "FakeEngine",
    "FakeEngineBackend",
    "FakeEngineOptions",
    "FakeEngineStatistics",
    "FakeRequest",
    "assert_nothing_in_flight",
    "cancel_at_every_checkpoint",
    "fake_engine_backends",
    "fake_engine_pipeline",
    "in_flight_problems",
    "scripted_backends",
    "scripted_pipeline",
    "scripted_tokens",
    "wait_until_idle",
    "wait_until_settled",
]


#: the dotted path of the fake engine backend, as a config names it
FAKE_ENGINE_BACKEND = "omni_trio.testing.fake_engine:FakeEngineBackend"

B = TypeVar("B", bound=StageBackend)


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
    return _linear_pipeline(
        "scripted",
        stages,
        name=name,
        options=options,
        stage_options=stage_options,
        stream_input=stream_input,
        final_outputs=final_outputs,
        replicas=replicas,
        engine_options=engine_options,
    )


def fake_engine_pipeline(
    stages: int | Sequence[str] = 2,
    *,
    slots: int = 8,
    step_s: float = 0.002,
    tokens: int = 16,
    name: str = "fake-engine",
    **layout: Any,
) -> PipelineConfig:
    """A validated linear pipeline of fake engine stages
    (:class:`~omni_trio.testing.fake_engine.FakeEngineBackend`), each running ``slots``
    requests at once, one token each per step of ``step_s`` trio-clock seconds, ``tokens``
    tokens per request (:class:`FakeEngineOptions`). ``layout``: the other keywords of
    :func:`scripted_pipeline` (``stage_options`` overrides the shape of one stage,
    ``{"s1": {"slots": 2}}``). Synchronous; raises ConfigError.
    """
    shape = {"slots": slots, "step_s": step_s, "tokens": tokens}
    return _linear_pipeline(FAKE_ENGINE_BACKEND, stages, name=name, options=shape, **layout)


def _linear_pipeline(
    backend: str,
    stages: int | Sequence[str],
    *,
    name: str,
    options: Mapping[str, Any],
    stage_options: Mapping[str, Mapping[str, Any]] | None = None,
    stream_input: bool | Sequence[str] = False,
    final_outputs: Sequence[str] | None = None,
    replicas: int | Mapping[str, int] = 1,
    engine_options: Mapping[str, Any] | None = None,
) -> PipelineConfig:
    ids = [f"s{i}" for i in range(stages)] if isinstance(stages, int) else list(stages)
    finals = set(final_outputs if final_outputs is not None else ids[-1:])
    per_stage = dict(stage_options or {})
    streaming = set(ids[1:]) if stream_input is True else set(stream_input or ())
    cfg_stages = []
    for i, sid in enumerate(ids):
        cfg_stages.append(
            {
                "id": sid,
                "backend": backend,
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
    """The scripted replicas of a stage (to assert on ``received`` / ``aborted``).
    Synchronous; raises TypeError if the stage is not a scripted one."""
    return _backends_of(engine, stage_id, ScriptedBackend, "a scripted stage")


def fake_engine_backends(engine: Engine, stage_id: str) -> list[FakeEngineBackend]:
    """The fake engine replicas of a stage (each one's ``engine`` to assert on: its
    ``statistics()``, its ``steps``). Synchronous; raises TypeError if the stage is not a
    fake engine one."""
    return _backends_of(engine, stage_id, FakeEngineBackend, "a fake engine stage")


def _backends_of(engine: Engine, stage_id: str, cls: type[B], what: str) -> list[B]:
    replicas = engine.pools[stage_id].replicas
    out = [r for r in replicas if isinstance(r, cls)]
    if len(out) != len(replicas):
        raise TypeError(f"stage {stage_id!r} is not {what}")
    return out
