"""Loading a pipeline config (``omni_trio.config.load_config``): dicts, files, a loaded config
again, top-level and stage overrides, and keys of vLLM-Omni's layout refused with a hint.

``stage`` and ``linear`` (config dicts) serve the other ``test_config_*`` modules too."""

import json

import pytest

from omni_trio import ConfigError, load_config


def stage(sid, **kw):
    return {"id": sid, "backend": "scripted", **kw}


def linear(*ids, final=None):
    out = []
    for i, sid in enumerate(ids):
        out.append(
            stage(sid, inputs=[ids[i - 1]] if i else [], final_output=sid == (final or ids[-1]))
        )
    return {"name": "t", "stages": out}


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_loads_files(tmp_path, suffix):
    data = linear("thinker", "talker")
    path = tmp_path / f"p{suffix}"
    if suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(data))
    elif suffix == ".toml":
        import tomli_w

        path.write_text(tomli_w.dumps(data))
    else:
        path.write_text(json.dumps(data))
    cfg = load_config(path)
    assert cfg.stage_ids == ["thinker", "talker"]
    assert cfg.source == str(path)


def test_unknown_key_rejected_with_file_and_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nstages:\n  - id: a\n    final_output: true\n    bogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "$.stages[0]" in msg
    assert "bogus" in msg


def test_stage_overrides_dict_and_json():
    cfg = load_config(
        linear("a", "b"), stage_overrides={"b": {"replicas": 3, "options": {"outputs": 2}}}
    )
    assert cfg.stage("b").replicas == 3
    assert cfg.stage("b").options == {"outputs": 2}
    cfg = load_config(linear("a", "b"), stage_overrides='{"a": {"options": {"latency_s": 0.5}}}')
    assert cfg.stage("a").options == {"latency_s": 0.5}
    with pytest.raises(ConfigError, match="unknown stage 'zz'"):
        load_config(linear("a", "b"), stage_overrides={"zz": {"replicas": 2}})
    with pytest.raises(ConfigError, match="stage_overrides must be JSON"):
        load_config(linear("a", "b"), stage_overrides="{not json")
    with pytest.raises(ConfigError) as info:
        load_config(linear("a", "b"), stage_overrides='{"a": {"replicas": 2, "replicas": 3}}')
    assert info.value.path == "$.stage_overrides.a.replicas"
    with pytest.raises(ConfigError, match="must be finite") as info:
        load_config(linear("a"), stage_overrides={"a": {"stage_init_timeout": float("nan")}})
    assert info.value.path == "$.stage_overrides.a.stage_init_timeout"
    with pytest.raises(ConfigError, match="must be finite") as info:
        load_config(linear("a"), shutdown_timeout=float("inf"))
    assert info.value.path == "$.shutdown_timeout"


def test_top_level_overrides():
    cfg = load_config(linear("a"), stage_init_timeout=5, max_requests_in_flight=3)
    assert cfg.stage_init_timeout == 5
    assert cfg.max_requests_in_flight == 3
    with pytest.raises(ConfigError, match=r"\$\.max_requests_in_flight: Expected `int` >= 1"):
        load_config(linear("a"), max_requests_in_flight=0)


@pytest.mark.parametrize("key", ["stage_configs_path", "stage_configs"])
def test_legacy_keys_refused_with_hint(key):
    data = linear("a")
    data[key] = "x.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert key in str(info.value)
    assert "stages" in str(info.value)
    with pytest.raises(ConfigError, match=key):
        load_config(linear("a"), **{key: "x.yaml"})


def test_roundtrip_of_a_config_object():
    cfg = load_config(linear("a", "b"))
    again = load_config(cfg, stage_overrides={"a": {"replicas": 2}})
    assert again.stage("a").replicas == 2
    assert cfg.stage("a").replicas == 1


def test_stage_overrides_merge_into_a_placement():
    data = linear("a")
    data["stages"][0]["placement"] = {"ray": {"num_gpus": 1, "resources": {"x": 1}}}
    for config in (data, load_config(data)):  # a dict, and a loaded config
        cfg = load_config(config, stage_overrides={"a": {"placement": {"ray": {"num_cpus": 2}}}})
        ray = cfg.stage("a").placement.ray
        assert (ray.num_cpus, ray.num_gpus, ray.resources) == (2.0, 1.0, {"x": 1.0})
