"""The pipeline's schema (``omni_trio.config.pipeline``): the stage graph's queries and
topological order (cached, without recursion on 20,000 stages), and the JSON Schema of the
file format (``omni-trio schema``)."""

import json
from pathlib import Path

import pytest

import omni_trio.pipelines
from omni_trio import ConfigError, PipelineConfig, StageConfig, load_config
from omni_trio.config import topological_order

from .test_loading import linear, stage
from .test_reading import write


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
    from omni_trio.cli.main import main

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


# -- a config built in Python is checked like a loaded one, when it is built --------------


@pytest.mark.parametrize(
    ("keys", "where", "reason"),
    [
        ({"stages": "nope"}, "$.stages", "Expected `array`, got str 'nope'"),
        ({"stages": ["a"]}, "$.stages[0]", "Expected `object`, got str 'a'"),
        ({"stages": [{"id": 3}]}, "$.stages[0].id", "Expected `str`, got int 3"),
        ({"stages": [{"id": "a", "replicas": 0}]}, "$.stages[0].replicas", ">= 1, got int 0"),
        ({"stages": [{"id": "a", "inptus": []}]}, "$.stages[0].inptus", "unknown field"),
        ({"max_requests_in_flight": "x"}, "$.max_requests_in_flight", "got str 'x'"),
        ({"admission": "maybe"}, "$.admission", "Expected one of 'reject', 'wait'"),
        ({"stage_init_timeout": -1}, "$.stage_init_timeout", "Expected `float` > 0.0"),
        ({"name": None}, "$.name", "Expected `str`, got None"),
    ],
)
def test_a_wrong_constructor_argument_is_a_config_error_naming_the_field(keys, where, reason):
    keys = {"stages": [StageConfig(id="a", final_output=True)], **keys}
    with pytest.raises(ConfigError) as caught:
        PipelineConfig(**keys)
    err = caught.value
    assert (err.source, err.path) == ("<PipelineConfig>", where)
    assert reason in err.reason and not isinstance(err, TypeError)


def test_a_config_built_in_python_holds_checked_values(tmp_path):
    # plain stage data is converted, as load_config would; values keep their meaning
    cfg = PipelineConfig(stages=[{"id": "a", "final_output": True}], stage_init_timeout=5)
    assert isinstance(cfg.stages[0], StageConfig) and cfg.stage_init_timeout == 5.0
    assert load_config(cfg).stages[0].final_output
    given = StageConfig(id="b", inputs=["a"], options={"outputs": 2})
    cfg = PipelineConfig(stages=[cfg.stages[0], given], source="mine.yaml")
    assert cfg.stages[1] is given and cfg.source == "mine.yaml"
    with pytest.raises(ConfigError, match=r"^mine.yaml: \$.output_buffer: Expected `int` >= 1"):
        PipelineConfig(stages=[given], source="mine.yaml", output_buffer=0)
    for bad in ({"id": 3}, {"id": "a", "inputs": "b"}, {"id": "a", "placement": {"ray": 1}}):
        with pytest.raises(ConfigError, match=r"^<StageConfig>: \$\.(id|inputs|placement\.ray): "):
            StageConfig(**bad)


def test_errors_about_a_20000_stage_pipeline_stay_short():
    n = 20_000
    ring = [{"id": f"s{i}", "inputs": [f"s{(i - 1) % n}"]} for i in range(n)]
    entry = {"id": "e", "final_output": True}
    with pytest.raises(ConfigError) as caught:
        load_config({"stages": [entry, *ring]})
    reason = caught.value.reason
    assert reason.startswith("the stage graph has a cycle: s0 -> s19999 -> s19998 -> ")
    assert reason.endswith(" -> s2 -> s1 -> s0 (20000 stages)") and len(reason) < 200
    chain = [{"id": f"s{i}", "inputs": [f"s{i - 1}"] if i else []} for i in range(n)]
    chain[-1]["final_output"] = True
    with pytest.raises(ConfigError) as caught:
        load_config({"stages": chain}, stage_overrides={"x": {"replicas": 2}})
    assert caught.value.reason.endswith("'s9'] ... (20000 in all)") and caught.value.path == (
        "$.stage_overrides.x"
    )
