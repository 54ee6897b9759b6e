"""A stage's schema (``omni_trio.config.stage``): each key's type and bounds, the
stage-level ``shutdown_timeout``, the replicas' upper bound, and ``placement`` (Ray)."""

import pytest

from omni_trio import ConfigError, load_config

from .test_loading import linear
from .test_reading import config_error, one_stage_yaml, stage_error, write


def test_bad_values_named():
    data = linear("a")
    data["stages"][0]["replicas"] = 0
    with pytest.raises(
        ConfigError, match=r"\$\.stages\[0\]\.replicas: Expected `int` >= 1, got int 0"
    ):
        load_config(data)
    data = linear("a")
    data["stages"][0]["output_type"] = "video"
    with pytest.raises(ConfigError, match=r"\$\.stages\[0\]\.output_type"):
        load_config(data)


def test_shutdown_timeout_is_a_stage_key(tmp_path):
    where = "$.stages[0].options.shutdown_timeout"
    assert "stage key" in stage_error(tmp_path, "    options: {shutdown_timeout: 5}\n", where)
    cfg = load_config(write(tmp_path, "ok.yaml", one_stage_yaml("    shutdown_timeout: 5\n")))
    assert cfg.stages[0].shutdown_timeout == 5.0
    assert load_config(linear("a")).stages[0].shutdown_timeout is None
    msg = stage_error(tmp_path, "    shutdown_timeout: 0\n", "$.stages[0].shutdown_timeout")
    assert "> 0.0" in msg


def test_replicas_upper_bound(tmp_path):
    bad = write(tmp_path, "r.yaml", one_stage_yaml("    replicas: 1000000000\n"))
    msg = config_error(bad, "$.stages[0].replicas")
    assert "<= 256" in msg and "MAX_REPLICAS = 256" in msg
    assert (
        load_config(linear("a"), stage_overrides={"a": {"replicas": 256}}).stages[0].replicas == 256
    )


# -- placement: where a stage's replicas run ---------------------------------------------


def test_ray_placement_loads_with_defaults_and_every_key(tmp_path):
    from omni_trio.config import Placement, RayPlacement

    data = linear("thinker", "talker")
    data["stages"][0]["placement"] = {"ray": {}}
    data["stages"][1]["placement"] = {
        "ray": {
            "num_cpus": 0.5,
            "num_gpus": 1,
            "resources": {"accelerator_type:A10": 0.25},
            "runtime_env": {"env_vars": {"HF_HOME": "/cache"}, "pip": ["numpy"]},
        }
    }
    cfg = load_config(data)
    assert cfg.stage("thinker").placement == Placement(ray=RayPlacement())
    assert RayPlacement() == RayPlacement(
        address=None, num_cpus=1.0, num_gpus=0.0, resources={}, runtime_env={}
    )
    ray = cfg.stage("talker").placement.ray
    assert (ray.num_cpus, ray.num_gpus) == (0.5, 1.0)
    assert ray.resources == {"accelerator_type:A10": 0.25}
    assert ray.runtime_env == {"env_vars": {"HF_HOME": "/cache"}, "pip": ["numpy"]}
    assert load_config(linear("a")).stage("a").placement is None
    path = tmp_path / "p.yaml"
    path.write_text(
        "stages:\n  - id: a\n    final_output: true\n"
        "    placement: {ray: {address: 'ray://head:10001', num_gpus: 2}}\n"
    )
    ray = load_config(path).stage("a").placement.ray
    assert (ray.address, ray.num_gpus, ray.num_cpus) == ("ray://head:10001", 2.0, 1.0)


@pytest.mark.parametrize(
    ("placement", "where", "reason"),
    [
        ({}, "$.stages[0].placement", "one of ray .*leave placement out"),
        ({"ray": None}, "$.stages[0].placement", "one of ray"),
        ({"kubernetes": {}}, "$.stages[0].placement.kubernetes", "unknown field"),
        ({"ray": {"num_cpus": -1}}, "$.stages[0].placement.ray.num_cpus", ">= 0"),
        ({"ray": {"num_gpus": -0.5}}, "$.stages[0].placement.ray.num_gpus", ">= 0"),
        ({"ray": {"resources": {"x": -1}}}, r"$.stages[0].placement.ray.resources", ">= 0"),
        ({"ray": {"resources": {"x": "a"}}}, r"$.stages[0].placement.ray.resources", "float"),
        ({"ray": {"address": ""}}, "$.stages[0].placement.ray.address", "length >= 1"),
        ({"ray": {"adress": "auto"}}, "$.stages[0].placement.ray.adress", "unknown field"),
        ({"ray": {"runtime_env": []}}, "$.stages[0].placement.ray.runtime_env", "object"),
    ],
)
def test_bad_placements_are_config_errors_at_their_path(placement, where, reason):
    data = linear("a")
    data["stages"][0]["placement"] = placement
    with pytest.raises(ConfigError, match=reason) as info:
        load_config(data)
    assert info.value.path.startswith(where), info.value.path
