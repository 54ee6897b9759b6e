import pytest

from omni_trio import InvalidRequestError, load_config
from omni_trio.request.planning import plan_request, resolve_sampling_params, stage_path
from omni_trio.testing import scripted_pipeline


def test_plan_request_is_pure():
    cfg = scripted_pipeline(["a", "b", "c"], final_outputs=["a", "c"])
    assert plan_request(cfg) == plan_request(cfg, None, None)
    plan = plan_request(cfg)
    assert plan.active == ("a", "b", "c") and plan.outputs == ("a", "c")
    plan = plan_request(cfg, final_stage_id="b")
    assert plan.active == ("a", "b") and plan.outputs == ("a", "b")
    plan = plan_request(cfg, output_stages=["b"])
    assert plan.active == ("a", "b") and plan.outputs == ("b",)
    with pytest.raises(InvalidRequestError, match="7 is not a stage index"):
        plan_request(cfg, final_stage_id=7)


def test_sampling_params_resolution():
    cfg = load_config(
        {
            "stages": [
                {"id": "a", "default_sampling_params": {"max_tokens": 4, "temperature": 0.0}},
                {"id": "b", "inputs": ["a"], "final_output": True},
            ]
        }
    )
    assert resolve_sampling_params(cfg, None) == {
        "a": {"max_tokens": 4, "temperature": 0.0},
        "b": {},
    }
    assert resolve_sampling_params(cfg, {"max_tokens": 9}) == {
        "a": {"max_tokens": 9, "temperature": 0.0},
        "b": {"max_tokens": 9},
    }
    assert resolve_sampling_params(cfg, [{"top_p": 0.5}, None])["a"]["top_p"] == 0.5
    by_id = resolve_sampling_params(cfg, {"b": {"max_tokens": 1}})
    assert by_id["a"] == {"max_tokens": 4, "temperature": 0.0} and by_id["b"] == {"max_tokens": 1}
    assert resolve_sampling_params(cfg, {1: {"max_tokens": 2}})["b"] == {"max_tokens": 2}
    marker = object()
    assert resolve_sampling_params(cfg, marker) == {"a": marker, "b": marker}


def test_route_planner_plans_each_route_once():
    from omni_trio.request.planning import RoutePlanner
    from omni_trio.testing import scripted_pipeline

    planner = RoutePlanner(scripted_pipeline(3, final_outputs=["s1", "s2"]))
    first = planner.plan(final_stage_id=1)
    assert first.active == ("s0", "s1") and first.outputs == ("s1",)
    assert planner.plan(final_stage_id=1) is first  # remembered, not recomputed
    assert planner.plan(output_stages=["s2", "s1"]) is planner.plan(output_stages=("s2", "s1"))
    with pytest.raises(InvalidRequestError, match="'nope' is not a stage"):
        planner.plan(final_stage_id="nope")


def test_stage_path_by_who_needs_the_outputs():
    # a leaf output stage: the consumer reads its outputs as emitted
    assert stage_path(output=True, feeds=0, streamed=True, observed=False) == "pulled"
    # nobody needs the outputs as they come: routed once the backend returned
    assert stage_path(output=False, feeds=1, streamed=False, observed=False) == "collected"
    # an output stage feeding another, or a stage feeding a stream_input stage: routed
    assert stage_path(output=True, feeds=1, streamed=True, observed=False) == "routed"
    assert stage_path(output=False, feeds=1, streamed=True, observed=False) == "routed"
    # observers get their per-output events from a routing task, whatever the stage
    for output, feeds, streamed in [(True, 0, True), (False, 1, False)]:
        assert stage_path(output=output, feeds=feeds, streamed=streamed, observed=True) == "routed"


def test_planning_a_20000_stage_chain():
    # one walk of the graph per plan, whatever the route: no ancestor set per output stage,
    # no list lookups per stage (each was quadratic in the stages)
    n = 20_000
    ids = [f"s{i}" for i in range(n)]
    cfg = scripted_pipeline(ids)
    plan = plan_request(cfg)
    assert plan.active == tuple(ids) and plan.outputs == (ids[-1],)
    plan = plan_request(cfg, final_stage_id=n // 2)
    assert plan.active == tuple(ids[: n // 2 + 1]) and plan.outputs == (ids[n // 2],)
    plan = plan_request(cfg, output_stages=list(reversed(ids)))
    assert plan.outputs == tuple(ids) and plan.output_set == frozenset(ids)
    plan = plan_request(cfg, output_stages=[ids[5], 3, ids[5]])
    assert plan.active == tuple(ids[:6]) and plan.outputs == (ids[3], ids[5])
    # errors name a few stages, not 20,000
    with pytest.raises(
        InvalidRequestError, match=r"stages are \['s0', .* \.\.\. \(20000 in all\)$"
    ):
        plan_request(cfg, output_stages=["nope"])
    only = r"only \['s0', 's1', .*'s9'\] \.\.\. \(11 in all\) do"
    with pytest.raises(InvalidRequestError, match=only):
        plan_request(cfg, final_stage_id=10, output_stages=[ids[-1]])
    with pytest.raises(InvalidRequestError, match=r"\(20000: \['s0', .* in all\)\), got 1"):
        resolve_sampling_params(cfg, [{}])
