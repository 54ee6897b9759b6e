import json

import pytest

from omni_trio import ConfigError, PipelineConfig, load_config
from omni_trio.config import topological_order


def stage(sid, **kw):
    return {"id": sid, "backend": "scripted", **kw}


def linear(*ids, final=None):
    out = []
    for i, sid in enumerate(ids):
        out.append(
            stage(sid, inputs=[ids[i - 1]] if i else [], final_output=sid == (final or ids[-1]))
        )
    return {"name": "t", "stages": out}


def test_loads_dict_and_indexes_stages():
    cfg = load_config(linear("a", "b", "c"))
    assert isinstance(cfg, PipelineConfig)
    assert cfg.stage_ids == ["a", "b", "c"]
    assert cfg.index_of("c") == 2
    assert cfg.entry_stages == ["a"]
    assert cfg.final_output_stages == ["c"]
    assert cfg.downstream("a") == ["b"]
    assert cfg.ancestors("c") == {"a", "b"}


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


def test_unknown_input_stage_names_path():
    data = linear("a", "b")
    data["stages"][1]["inputs"] = ["nope"]
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.path == "$.stages[1].inputs[0]"
    assert "unknown input stage 'nope'" in str(info.value)


def test_cycle_detected():
    data = {
        "stages": [
            stage("a"),
            stage("b", inputs=["a", "c"]),
            stage("c", inputs=["b"], final_output=True),
        ]
    }
    with pytest.raises(ConfigError, match=r"cycle: .*b -> .*c|cycle: .*c -> .*b"):
        load_config(data)


def test_no_entry_stage():
    data = {"stages": [stage("a", inputs=["b"]), stage("b", inputs=["a"], final_output=True)]}
    with pytest.raises(ConfigError, match="no entry stage"):
        load_config(data)


def test_no_final_output_stage():
    data = linear("a", "b")
    data["stages"][1]["final_output"] = False
    with pytest.raises(ConfigError, match="no stage has final_output"):
        load_config(data)


def test_duplicate_ids():
    data = {"stages": [stage("a", final_output=True), stage("a")]}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.path == "$.stages[1].id"
    assert "duplicate stage id 'a'" in str(info.value)


def test_bad_values_named():
    data = linear("a")
    data["stages"][0]["replicas"] = 0
    with pytest.raises(ConfigError, match=r"\$\.stages\[0\]\.replicas: replicas must be >= 1"):
        load_config(data)
    data = linear("a")
    data["stages"][0]["output_type"] = "video"
    with pytest.raises(ConfigError, match=r"\$\.stages\[0\]\.output_type"):
        load_config(data)
    data = linear("a")
    data["stages"][0]["backend"] = "not a backend"
    with pytest.raises(ConfigError, match="unknown backend"):
        load_config(data)
    with pytest.raises(ConfigError, match="at least one stage"):
        load_config({"stages": []})


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


def test_top_level_overrides():
    cfg = load_config(linear("a"), stage_init_timeout=5, max_requests_in_flight=3)
    assert cfg.stage_init_timeout == 5
    assert cfg.max_requests_in_flight == 3
    with pytest.raises(ConfigError, match="max_requests_in_flight must be >= 1"):
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


def test_unreadable_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    odd = tmp_path / "x.ini"
    odd.write_text("")
    with pytest.raises(ConfigError, match="unsupported config file type"):
        load_config(odd)


def test_roundtrip_of_a_config_object():
    cfg = load_config(linear("a", "b"))
    again = load_config(cfg, stage_overrides={"a": {"replicas": 2}})
    assert again.stage("a").replicas == 2
    assert cfg.stage("a").replicas == 1


def test_topological_order_with_fan_in():
    data = {
        "stages": [
            stage("d", inputs=["b", "c"], final_output=True),
            stage("c", inputs=["a"]),
            stage("a"),
            stage("b", inputs=["a"]),
        ]
    }
    cfg = load_config(data)
    order = topological_order(cfg)
    assert order.index("a") < order.index("b") < order.index("d")
    assert order.index("c") < order.index("d")
