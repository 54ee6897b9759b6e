"""The resource keys at load (``omni_trio.config.resources``): each stage's ``resources``
against the pipeline's ``capacities``, every error a ConfigError naming its path; and
``max_requests_in_graph``'s bounds."""

import pytest

from omni_trio import ConfigError, load_config

from .test_loading import linear


def with_resources(capacities=None, **per_stage):
    data = linear("a", "b")
    for st in data["stages"]:
        if st["id"] in per_stage:
            st["resources"] = per_stage[st["id"]]
    if capacities is not None:
        data["capacities"] = capacities
    return data


def load_error(data):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    return info.value


def test_resources_and_capacities_load():
    cfg = load_config(
        with_resources(
            {"device_memory_fraction": 1.0, "cpu_cores": 4},
            a={"device_memory_fraction": 0.5, "cpu_cores": 1},
            b={"memory_gib": 2, "device_memory_fraction": 0.25},
        )
    )
    assert cfg.stages[0].resources == {"device_memory_fraction": 0.5, "cpu_cores": 1.0}
    assert cfg.capacities == {"device_memory_fraction": 1.0, "cpu_cores": 4.0}
    # the defaults: nothing reserved, no capacity declared, no graph limit
    plain = load_config(linear("a"))
    assert (plain.stages[0].resources, plain.capacities, plain.max_requests_in_graph) == (
        {},
        {},
        None,
    )


def test_a_resource_without_a_capacity_is_named():
    error = load_error(with_resources(a={"gpu_slots": 1}))
    assert error.path == "$.stages[0].resources.gpu_slots"
    assert "stage 'a' reserves 'gpu_slots'" in error.reason
    assert "capacities: {gpu_slots: <total>}" in error.reason


def test_machine_resources_need_no_declared_capacity():
    cfg = load_config(with_resources(a={"cpu_cores": 1, "memory_gib": 0.5}))
    assert cfg.capacities == {}


def test_one_replica_over_a_declared_capacity_can_never_start():
    error = load_error(with_resources({"gpu_slots": 2}, b={"gpu_slots": 3}))
    assert error.path == "$.stages[1].resources.gpu_slots"
    assert "one replica of stage 'b' reserves gpu_slots=3" in error.reason
    assert "capacity of 2" in error.reason
    # the sum of several replicas is the ledger's question at start, not the config's
    data = with_resources({"gpu_slots": 2}, b={"gpu_slots": 2})
    data["stages"][1]["replicas"] = 3
    assert load_config(data).stages[1].replicas == 3


def test_a_capacity_no_stage_reserves_is_a_typo():
    error = load_error(with_resources({"cpu_core": 2}, a={"cpu_cores": 1}))
    assert error.path == "$.capacities.cpu_core"
    assert "no stage reserves 'cpu_core' (the stages reserve: cpu_cores)" in error.reason


def test_a_ray_stage_reserves_through_ray():
    data = with_resources(a={"cpu_cores": 1})
    data["stages"][0]["placement"] = {"ray": {"num_cpus": 1}}
    error = load_error(data)
    assert error.path == "$.stages[0].resources"
    assert "placement.ray's num_cpus" in error.reason


@pytest.mark.parametrize(
    ("key", "value", "path"),
    [
        ("resources", {"cpu_cores": 0}, "$.stages[0].resources.cpu_cores"),
        ("resources", {"cpu_cores": -1}, "$.stages[0].resources.cpu_cores"),
        ("resources", {"": 1}, "$.stages[0].resources"),
        ("resources", {"cpu_cores": float("inf")}, "$.stages[0].resources.cpu_cores"),
        ("resources", {"cpu_cores": float("nan")}, "$.stages[0].resources.cpu_cores"),
        ("resources", [1], "$.stages[0].resources"),
    ],
)
def test_bad_amounts_are_named(key, value, path):
    data = linear("a")
    data["stages"][0][key] = value
    error = load_error(data)
    assert error.path == path


def test_an_amount_of_the_wrong_type_is_refused_by_its_type():
    data = linear("a")
    data["stages"][0]["resources"] = {"cpu_cores": "two"}
    error = load_error(data)
    assert error.path.startswith("$.stages[0].resources")
    assert "Expected `float`" in error.reason


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"x": -1}, "$.capacities.x"),
        ({"x": float("inf")}, "$.capacities.x"),
        ("lots", "$.capacities"),
    ],
)
def test_bad_capacities_are_named(value, path):
    data = linear("a")
    data["capacities"] = value
    assert load_error(data).path == path


@pytest.mark.parametrize("value", [0, -1, 1.5, "one", 10**7])
def test_max_requests_in_graph_bounds(value):
    data = linear("a")
    data["max_requests_in_graph"] = value
    assert load_error(data).path == "$.max_requests_in_graph"


def test_max_requests_in_graph_loads():
    data = linear("a")
    data["max_requests_in_graph"] = 1
    assert load_config(data).max_requests_in_graph == 1
