"""The pipeline's schema (``omni_trio._config_pipeline``): the stage graph's queries and
topological order (cached, without recursion on 20,000 stages), and the JSON Schema of the
file format (``omni-trio schema``)."""

import json
from pathlib import Path

import pytest

import omni_trio.pipelines
from omni_trio import ConfigError, PipelineConfig, StageConfig, load_config
from omni_trio.config import topological_order

from .test_config import linear, stage
from .test_config_read import write


def test_loads_dict_and_indexes_stages():
    cfg = load_config(linear("a", "b", "c"))
    assert isinstance(cfg, PipelineConfig)
    assert cfg.stage_ids == ["a", "b", "c"]
    assert cfg.index_of("c") == 2
    assert cfg.entry_stages == ["a"]
    assert cfg.final_output_stages == ["c"]
    assert cfg.downstream("a") == ["b"]
    assert cfg.ancestors("c") == {"a", "b"}


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


def test_20000_stage_chain_listed_downstream_first(tmp_path):
    n = 20_000
    stages = [
        {"id": f"s{i}", "inputs": [f"s{i - 1}"] if i else [], "final_output": i == n - 1}
        for i in reversed(range(n))
    ]
    path = write(tmp_path, "chain.json", json.dumps({"name": "chain", "stages": stages}))
    cfg = load_config(path)
    order = topological_order(cfg)
    assert order[0] == "s0" and order[-1] == f"s{n - 1}" and len(order) == n
    assert cfg.index_of("s0") == n - 1 and cfg.stage("s5").inputs == ["s4"]
    assert len(cfg.ancestors(f"s{n - 1}")) == n - 1
    assert cfg.downstream("s0") == ["s1"] and cfg.entry_stages == ["s0"]
    # a cycle far down the chain is still found, without recursion
    stages[-1]["inputs"] = [f"s{n - 1}"]
    with pytest.raises(ConfigError, match="no entry stage"):
        load_config({"stages": stages})


def test_long_cycle_is_reported_without_recursion():
    n = 5_000
    stages = [stage("entry", final_output=True)]
    stages += [stage(f"c{i}", inputs=[f"c{(i + 1) % n}"]) for i in range(n)]
    with pytest.raises(ConfigError) as info:
        load_config({"stages": stages})
    assert "cycle: c0 -> c1 -> c2" in str(info.value) and info.value.path == "$.stages[1].inputs"


def test_graph_helpers_are_cached_and_follow_a_new_stage_list():
    cfg = load_config(linear("a", "b"))
    assert cfg.stage("b").id == "b"
    cfg.stages = [*cfg.stages, StageConfig(id="c", inputs=["b"], final_output=True)]
    assert cfg.index_of("c") == 2 and topological_order(cfg) == ["a", "b", "c"]
    with pytest.raises(KeyError):
        cfg.stage("zz")
    with pytest.raises(ValueError, match="'zz' is not a stage"):
        cfg.index_of("zz")


# -- the schema ------------------------------------------------------------------------


def schema_from_cli(capsys):
    from omni_trio.cli import main

    assert main(["schema"]) == 0
    return json.loads(capsys.readouterr().out)


def test_schema_validates_shipped_pipelines_and_rejects_broken_ones(capsys):
    import jsonschema
    import yaml

    from omni_trio.config import config_schema

    schema = schema_from_cli(capsys)
    assert schema == config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    shipped = sorted(Path(omni_trio.pipelines.__file__).parent.glob("*.yaml"))
    assert len(shipped) >= 2
    for path in shipped:
        data = yaml.safe_load(path.read_text())
        assert not list(validator.iter_errors(data)), path.name
        broken = json.loads(json.dumps(data))
        broken["stages"][0]["replicas"] = "two"
        assert not validator.is_valid(broken)
    base = {"stages": [{"id": "a", "final_output": True}]}
    assert validator.is_valid(base)
    for bad_stage in (
        {"id": "a", "bogus": 1},
        {"id": "a", "replicas": 1000},
        {"id": "a", "options": {"outptus": 3}},  # scripted, the default backend
        {"id": "a", "backend": "vllm", "options": {"cpu_bnd": "0"}},
        {"id": "a", "backend": "torch", "options": {"max_batch_size": 0}},
        {"id": "a", "backend": "not a backend"},
        {"id": "a", "input_processor": ".relative:f"},
    ):
        assert not validator.is_valid({"stages": [bad_stage]}), bad_stage
    assert validator.is_valid({"stages": [{"id": "a", "backend": "torch", "options": {"seed": 3}}]})


def test_schema_fields_have_descriptions():
    from omni_trio.config import config_schema

    defs = config_schema()["$defs"]
    names = ("PipelineConfig", "StageConfig", "Placement", "RayPlacement")
    for name in (*names, "ScriptedOptions", "TorchOptions", "VllmOptions"):
        props = defs[name]["properties"]
        missing = [k for k, v in props.items() if not v.get("description")]
        assert not missing, (name, missing)
    assert "source" not in defs["PipelineConfig"]["properties"]
