import pytest
import trio

import omni_trio
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline


def test_scripted_pipeline_builds_a_valid_linear_config():
    cfg = scripted_pipeline(
        ["x", "y", "z"],
        outputs=3,
        stream_input=["z"],
        replicas={"y": 2},
        stage_options={"y": {"latency_s": 1.0}},
    )
    assert cfg.stage_ids == ["x", "y", "z"]
    assert [s.inputs for s in cfg.stages] == [[], ["x"], ["y"]]
    assert cfg.final_output_stages == ["z"]
    assert cfg.stage("y").replicas == 2
    assert cfg.stage("y").options == {"outputs": 3, "latency_s": 1.0}
    assert [s.stream_input for s in cfg.stages] == [False, False, True]


async def test_assert_nothing_in_flight_detects_leftovers(autojump_clock):
    cfg = scripted_pipeline(2, hang=True)
    async with omni_trio.open_engine(cfg) as engine:
        assert_nothing_in_flight(engine)
        async with engine.generate("x"):
            await trio.sleep(1)
            with pytest.raises(AssertionError, match="in flight in the orchestrator"):
                assert_nothing_in_flight(engine)
        assert_nothing_in_flight(engine)
        assert len(scripted_backends(engine, "s0")) == 1
