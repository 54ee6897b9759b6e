"""Stage metadata and output modalities: StageInfo, supported_tasks, modality_stages, and
``generate(..., output_modalities=...)`` pruning the route (scripted stages, MockClock)."""

from __future__ import annotations

import dataclasses

import pytest

import omni_trio
from omni_trio import InvalidRequestError, StageInfo, load_config
from omni_trio.config.stageinfo import (
    image_stage,
    modality_stages,
    stage_infos,
    supported_tasks,
)
from omni_trio.request.planning import RoutePlanner, plan_request
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline


def omni(**extra):
    """The omni shape, all scripted: thinker (text, final) -> talker (tokens) -> code2wav
    (audio, final)."""
    return load_config(
        {
            "name": "omni",
            "stages": [
                {
                    "id": "thinker",
                    "options": {"outputs": 3},
                    "final_output": True,
                    "output_type": "text",
                },
                {
                    "id": "talker",
                    "inputs": ["thinker"],
                    "options": {"outputs": 4},
                    "output_type": "tokens",
                },
                {
                    "id": "code2wav",
                    "inputs": ["talker"],
                    "options": {"outputs": 2},
                    "final_output": True,
                    "output_type": "audio",
                    "replicas": 2,
                },
            ],
            **extra,
        }
    )


# -- pure ---------------------------------------------------------------------------------------


def test_stage_infos_describe_every_stage_frozen():
    infos = stage_infos(omni())
    assert infos == (
        StageInfo("thinker", 0, "scripted", "text", (), True, 1),
        StageInfo("talker", 1, "scripted", "tokens", ("thinker",), False, 1),
        StageInfo("code2wav", 2, "scripted", "audio", ("talker",), True, 2),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        infos[0].replicas = 3  # type: ignore[misc]
    assert stage_infos(omni(), {"code2wav": 5})[2].replicas == 5


def test_supported_tasks_follow_the_output_types():
    assert supported_tasks(stage_infos(omni())) == ("generate", "speech")
    assert supported_tasks(stage_infos(scripted_pipeline(2))) == ("generate",)
    # an audio stage counts even when it is not final_output: final_stage_id can end on it
    not_final = load_config(
        {
            "name": "x",
            "stages": [
                {"id": "a", "output_type": "tokens", "final_output": True},
                {"id": "b", "inputs": ["a"], "output_type": "audio"},
            ],
        }
    )
    assert supported_tasks(stage_infos(not_final)) == ("speech",)
    # tokens are not text: no `generate`
    assert supported_tasks(stage_infos(not_final)[:1]) == ()


def test_image_stages_serve_the_image_task_and_the_last_one_is_the_pipelines():
    cfg = load_config(
        {
            "name": "x",
            "stages": [
                {"id": "llm", "output_type": "text", "final_output": True},
                {"id": "sketch", "inputs": ["llm"], "output_type": "image"},
                {"id": "paint", "inputs": ["sketch"], "output_type": "image"},
            ],
        }
    )
    assert supported_tasks(stage_infos(cfg)) == ("generate", "image")
    assert image_stage(cfg) == "paint"
    assert image_stage(omni()) is None


def test_modality_stages_pick_final_stages_of_each_type():
    cfg = omni()
    assert modality_stages(cfg, ["text"]) == ["thinker"]
    assert modality_stages(cfg, "audio") == ["code2wav"]
    assert modality_stages(cfg, ("audio", "text", "text")) == ["thinker", "code2wav"]
    assert modality_stages(cfg, ["tokens"]) == ["talker"]  # no final tokens stage: the last one
    # only the final text stage of a chain of text stages answers; with none final, the last
    assert modality_stages(scripted_pipeline(3), ["text"]) == ["s2"]
    assert modality_stages(scripted_pipeline(3, final_outputs=["s0", "s2"]), ["text"]) == [
        "s0",
        "s2",
    ]
    assert modality_stages(scripted_pipeline(3), ["text"], allowed={"s0", "s1"}) == ["s1"]


@pytest.mark.parametrize(
    ("modalities", "message"),
    [
        (["video"], "output modality 'video' is not one of text, tokens, audio, image, tensor"),
        (["image"], "no stage of the pipeline produces output modality 'image'"),
        ([], "output_modalities must be a non-empty list"),
        ([3], "output modality 3 is not one of"),
    ],
)
def test_modality_errors_name_the_modality_and_what_the_pipeline_produces(modalities, message):
    with pytest.raises(InvalidRequestError) as err:
        modality_stages(omni(), modalities)
    assert message in str(err.value)
    if modalities:
        produced = "text (thinker), tokens (talker), audio (code2wav)"
        assert f"the stages of the pipeline produce {produced}" in str(err.value)


def test_plan_request_cuts_the_route_after_the_modalities_stages():
    cfg = omni()
    text = plan_request(cfg, output_modalities=["text"])
    assert (text.active, text.outputs) == (("thinker",), ("thinker",))
    both = plan_request(cfg, output_modalities=["text", "audio"])
    assert both.active == ("thinker", "talker", "code2wav")
    assert both.outputs == ("thinker", "code2wav")
    audio = plan_request(cfg, output_modalities=["audio"])
    assert audio.outputs == ("code2wav",)
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        plan_request(cfg, output_stages=["thinker"], output_modalities=["text"])
    # with final_stage_id, only the stages that run are considered
    with pytest.raises(InvalidRequestError, match="no stage that run for this request produces"):
        plan_request(cfg, final_stage_id="talker", output_modalities=["audio"])
    assert plan_request(cfg, final_stage_id="talker", output_modalities=["tokens"]).outputs == (
        "talker",
    )


def test_route_planner_caches_per_distinct_modalities():
    planner = RoutePlanner(omni())
    first = planner.plan(output_modalities=["text"])
    assert planner.plan(output_modalities=("text",)) is first
    assert planner.plan(output_modalities="text") is not first  # another key, same route
    assert planner.plan(output_modalities="text") == first
    both = planner.plan(output_modalities=["text", "audio"])
    assert both is not first and both.outputs == ("thinker", "code2wav")
    assert planner.plan() is not first  # no modalities: the final_output stages
    assert planner.plan().outputs == ("thinker", "code2wav")
    with pytest.raises(InvalidRequestError):
        planner.plan(output_modalities=["nope"])


# -- the engine ---------------------------------------------------------------------------------


async def test_engine_stages_and_supported_tasks(autojump_clock):
    async with omni_trio.open_engine(omni()) as engine:
        assert engine.stages == stage_infos(omni())
        assert all(isinstance(st, StageInfo) for st in engine.stages)
        assert engine.supported_tasks == ("generate", "speech")
        assert await engine.add_replica("talker") == 1
        assert [st.replicas for st in engine.stages] == [1, 2, 2]
        assert set(engine.pools) == {"thinker", "talker", "code2wav"}  # the pools, as before
        await engine.remove_replica("code2wav", 0)
        assert [st.replicas for st in engine.stages] == [1, 2, 1]


async def test_text_modality_never_runs_the_talker_or_the_vocoder(autojump_clock):
    async with omni_trio.open_engine(omni()) as engine:
        async with engine.generate("hi", "t", output_modalities=("text",)) as stream:
            outs = [o async for o in stream]
        assert {o.stage_id for o in outs} == {"thinker"}
        assert outs[-1].finished and len(outs) == 3
        assert scripted_backends(engine, "thinker")[0].completed == ["t"]
        assert "t" not in scripted_backends(engine, "talker")[0].received
        for backend in scripted_backends(engine, "code2wav"):
            assert "t" not in backend.received and list(backend.completed) == []

        async with engine.generate("hi", "ta", output_modalities=("text", "audio")) as stream:
            outs = [o async for o in stream]
        assert {o.stage_id for o in outs} == {"thinker", "code2wav"}
        assert {o.kind for o in outs} == {"text", "audio"}
        assert scripted_backends(engine, "talker")[0].completed == ["ta"]
        assert sum("ta" in b.completed for b in scripted_backends(engine, "code2wav")) == 1

        async with engine.generate("hi", "a", output_modalities=["audio"]) as stream:
            outs = [o async for o in stream]
        assert {o.stage_id for o in outs} == {"code2wav"}  # the thinker ran, unseen
        assert "a" in scripted_backends(engine, "thinker")[0].completed
        assert_nothing_in_flight(engine)


async def test_generate_rejects_bad_modalities_before_anything_runs(autojump_clock):
    async with omni_trio.open_engine(omni()) as engine:
        with pytest.raises(InvalidRequestError, match="cannot be combined"):
            engine.generate("hi", output_stages=["thinker"], output_modalities=["text"])
        with pytest.raises(InvalidRequestError) as err:
            engine.generate("hi", output_modalities=["image"])
        assert "'image'" in str(err.value) and "audio (code2wav)" in str(err.value)
        with pytest.raises(InvalidRequestError, match="'speech' is not one of"):
            engine.generate("hi", output_modalities=["speech"])
        assert engine.statistics().requests_total == 0
        assert all(not b.received for b in scripted_backends(engine, "thinker"))


async def test_final_stage_id_narrows_the_modalities(autojump_clock):
    cfg = scripted_pipeline(["a", "b", "c"], outputs=2)  # all text, only c final
    async with omni_trio.open_engine(cfg) as engine:
        stream = engine.generate("x", "r", final_stage_id="b", output_modalities=["text"])
        async with stream:
            outs = [o async for o in stream]
        assert {o.stage_id for o in outs} == {"b"}
        assert "r" not in scripted_backends(engine, "c")[0].received
