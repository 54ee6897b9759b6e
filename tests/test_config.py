import json
from pathlib import Path

import pytest

import omni_trio.pipelines
from omni_trio import ConfigError, PipelineConfig, StageConfig, load_config
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
    with pytest.raises(
        ConfigError, match=r"\$\.stages\[0\]\.replicas: Expected `int` >= 1, got int 0"
    ):
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


# -- every failure class, from a real file: ConfigError naming the file and the exact path --


def write(tmp_path, name, text):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def one_stage_yaml(extra=""):
    return "name: t\nstages:\n  - id: a\n    final_output: true\n" + extra


def config_error(path, where):
    """Load ``path``; assert a ConfigError naming the file and exactly ``where``."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert info.value.path == where
    assert str(info.value).startswith(f"{path}: {where}: ")
    return str(info.value)


def stage_error(tmp_path, lines, where):
    """Write a one-stage YAML file with ``lines`` added to the stage; return its error."""
    path = write(tmp_path, f"stage{len(list(tmp_path.iterdir()))}.yaml", one_stage_yaml(lines))
    return config_error(path, where)


def test_unknown_and_ill_typed_options(tmp_path):
    msg = stage_error(tmp_path, "    options: {outptus: 3}\n", "$.stages[0].options.outptus")
    assert "unknown scripted option 'outptus'" in msg and "outputs" in msg
    msg = stage_error(tmp_path, "    options: {outputs: '3'}\n", "$.stages[0].options.outputs")
    assert "Expected `int`, got str '3'" in msg
    msg = stage_error(tmp_path, "    options: {latency_s: -1}\n", "$.stages[0].options.latency_s")
    assert ">= 0.0" in msg


def test_bad_enum_value_lists_the_allowed_ones(tmp_path):
    msg = stage_error(tmp_path, "    lb_policy: rr\n", "$.stages[0].lb_policy")
    assert msg.endswith(
        ": Expected one of 'least_loaded', 'random', 'round_robin', got str 'rr'"
    ), msg
    path = write(tmp_path, "p.yaml", one_stage_yaml().replace("name: t", "admission: queue"))
    msg = config_error(path, "$.admission")
    assert msg.endswith(": Expected one of 'reject', 'wait', got str 'queue'"), msg


def test_explain_validation_error_finds_enums_through_containers():
    import enum
    from typing import Literal

    import msgspec

    from omni_trio._config_read import explain_validation_error

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Inner(msgspec.Struct):
        mode: Literal["a", "b"] | None = None

    class Outer(msgspec.Struct):
        inners: list[Inner] = []
        by_name: dict[str, Literal[1, 2]] = {}
        pair: tuple[int, Color] = (0, Color.RED)

    def explain(data):
        with pytest.raises(msgspec.ValidationError) as info:
            msgspec.convert(data, Outer)
        return explain_validation_error(info.value, data, Outer)

    assert explain({"inners": [{}, {"mode": "c"}]}) == (
        "Expected one of 'a', 'b', got str 'c'",
        "$.inners[1].mode",
    )
    # msgspec does not name the dict key: its reason keeps the value
    assert explain({"by_name": {"x": 3}}) == (
        "Invalid enum value 3; expected one of 1, 2",
        "$.by_name[...]",
    )
    assert explain({"pair": [0, "green"]}) == (
        "Expected one of 'red', 'blue', got str 'green'",
        "$.pair[1]",
    )
    # without the schema, msgspec's own reason (with the value) as before
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"pair": [0, "green"]}, Outer)
    assert explain_validation_error(info.value, {"pair": [0, "green"]}) == (
        "Invalid enum value 'green', got str 'green'",
        "$.pair[1]",
    )


def test_shutdown_timeout_is_a_stage_key(tmp_path):
    where = "$.stages[0].options.shutdown_timeout"
    assert "stage key" in stage_error(tmp_path, "    options: {shutdown_timeout: 5}\n", where)
    cfg = load_config(write(tmp_path, "ok.yaml", one_stage_yaml("    shutdown_timeout: 5\n")))
    assert cfg.stages[0].shutdown_timeout == 5.0
    assert load_config(linear("a")).stages[0].shutdown_timeout is None
    msg = stage_error(tmp_path, "    shutdown_timeout: 0\n", "$.stages[0].shutdown_timeout")
    assert "> 0.0" in msg


@pytest.mark.parametrize(
    ("lines", "where", "expected"),
    [
        (
            "backend: 'no_such_mod_xyz:F'",
            "backend",
            "cannot import backend module 'no_such_mod_xyz'",
        ),
        ("backend: 'json:no_such'", "backend", "has no 'no_such'"),
        ("backend: 'json.decoder:NaN'", "backend", "no callable 'NaN'"),
        ("input_processor: 'json:nope'", "input_processor", "input_processor 'json:nope'"),
        ("input_processor: '.local:f'", "input_processor", "relative module paths are not allowed"),
        ("input_processor: 'a b:f'", "input_processor", "must be 'package.module:function'"),
        ("prompt_transform: 'json:nope'", "prompt_transform", "prompt_transform 'json:nope'"),
        ("prompt_transform: 'nocolon'", "prompt_transform", "must be 'package.module:function'"),
        (
            "prompt_transform: 'no_such_mod_xyz:f'",
            "prompt_transform",
            "cannot import prompt_transform module",
        ),
        ("prompt_expand: 'json:nope'", "prompt_expand", "prompt_expand 'json:nope'"),
        ("prompt_expand: '.rel:f'", "prompt_expand", "relative module paths are not allowed"),
        (
            "backend: torch\n    options: {factory: 'no_such_mod_xyz:build'}",
            "options.factory",
            "cannot import torch factory module",
        ),
        ("backend: torch\n    options: {max_batch_size: 0}", "options.max_batch_size", ">= 1"),
    ],
)
def test_dotted_paths_and_torch_options_checked_at_load(tmp_path, lines, where, expected):
    assert expected in stage_error(tmp_path, f"    {lines}\n", f"$.stages[0].{where}")


@pytest.mark.parametrize("key", ["prompt_transform", "prompt_expand"])
def test_prompt_hooks_are_for_entry_stages_only(key):
    ok = linear("a", "b")
    ok["stages"][0][key] = "json:dumps"
    assert getattr(load_config(ok).stages[0], key) == "json:dumps"
    bad = linear("a", "b")
    bad["stages"][1][key] = "json:dumps"
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.path == f"$.stages[1].{key}"
    assert "for entry stages" in str(info.value) and "'b'" in str(info.value)


def test_torch_weights_file_must_exist(tmp_path):
    missing = tmp_path / "nowhere" / "w.pt"
    lines = f"    backend: torch\n    options: {{weights: '{missing}'}}\n"
    assert "does not exist" in stage_error(tmp_path, lines, "$.stages[0].options.weights")


@pytest.mark.parametrize(
    ("lines", "where", "expected"),
    [
        (
            "engine_args: {max_modle_len: 9}",
            "engine_args.max_modle_len",
            "did you mean 'max_model_len'",
        ),
        ("engine_args: {max_model_len: lots}", "engine_args.max_model_len", "got str 'lots'"),
        ("engine_args: {enforce_eager: 'yes'}", "engine_args.enforce_eager", "Expected `bool"),
        (
            "default_sampling_params: {max_tokens: lots}",
            "default_sampling_params.max_tokens",
            "got str 'lots'",
        ),
        (
            "default_sampling_params: {temprature: 0}",
            "default_sampling_params.temprature",
            "not a vllm SamplingParams field; did you mean 'temperature'",
        ),
        (
            "default_sampling_params: {temperature: -1.0}",
            "default_sampling_params.temperature",
            "non-negative",
        ),
        ("options: {output_buffer: 0}", "options.output_buffer", ">= 1"),
        ("options: {cpu_bnd: '0'}", "options.cpu_bnd", "unknown vllm option 'cpu_bnd'"),
    ],
)
def test_vllm_stage_checked_at_load(tmp_path, lines, where, expected):
    if not lines.startswith("options"):
        pytest.importorskip("vllm")  # engine_args / sampling params: checked when installed
    msg = stage_error(tmp_path, f"    backend: vllm\n    {lines}\n", f"$.stages[0].{where}")
    assert expected in msg


def test_shipped_vllm_pipeline_passes_the_vllm_checks():
    pytest.importorskip("vllm")
    cfg = load_config(Path(omni_trio.pipelines.__file__).parent / "tiny-omni.yaml")
    assert cfg.stage("thinker").engine_args["max_model_len"] == 256


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        (
            "nan.yaml",
            one_stage_yaml("    stage_init_timeout: .nan\n"),
            "$.stages[0].stage_init_timeout",
        ),
        (
            "inf.toml",
            'shutdown_timeout = inf\n[[stages]]\nid = "a"\nfinal_output = true\n',
            "$.shutdown_timeout",
        ),
        (
            "inf.json",
            '{"stages": [{"id": "a", "final_output": true}], "init_timeout": Infinity}',
            "$.init_timeout",
        ),
        (
            "opt.yaml",
            one_stage_yaml("    options: {latency_s: .inf}\n"),
            "$.stages[0].options.latency_s",
        ),
    ],
)
def test_non_finite_numbers_rejected(tmp_path, name, text, where):
    assert "numbers must be finite" in config_error(write(tmp_path, name, text), where)


def test_replicas_upper_bound(tmp_path):
    bad = write(tmp_path, "r.yaml", one_stage_yaml("    replicas: 1000000000\n"))
    msg = config_error(bad, "$.stages[0].replicas")
    assert "<= 256" in msg and "MAX_REPLICAS = 256" in msg
    assert (
        load_config(linear("a"), stage_overrides={"a": {"replicas": 256}}).stages[0].replicas == 256
    )


def test_non_utf8_file(tmp_path):
    bad = write(tmp_path, "latin1.yaml", "name: caf\u00e9\nstages: []\n".encode("latin-1"))
    msg = config_error(bad, "$")
    assert "not UTF-8" in msg and "line 1, column 10" in msg


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("deep.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("deep70.yaml", "a: " + "[" * 70 + "]" * 70 + "\n"),
        ("deep70.json", '{"a": ' + "[" * 70 + "]" * 70 + "}"),
    ],
)
def test_deep_nesting_is_a_config_error(tmp_path, name, text):
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert "nested" in str(info.value) or "nesting" in str(info.value)


def test_duplicate_keys(tmp_path):
    bad = write(tmp_path, "dup.yaml", one_stage_yaml("    replicas: 1\n    replicas: 2\n"))
    assert "duplicate key 'replicas' (line 6, column 5)" in config_error(
        bad, "$.stages[0].replicas"
    )
    bad = write(tmp_path, "dup.json", '{"name": "a", "name": "b", "stages": []}')
    assert "duplicate key 'name'" in config_error(bad, "$.name")
    # a YAML merge key is not a duplicate: the explicit key overrides the merged one
    ok = write(
        tmp_path,
        "merge.yaml",
        "base: &b {id: a, final_output: false}\nstages:\n  - <<: *b\n    final_output: true\n",
    )
    with pytest.raises(ConfigError, match=r"\$\.base: Object contains unknown field"):  # not a dup
        load_config(ok)


def test_yaml_alias_bomb_and_recursive_alias(tmp_path):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    lines.append("stages: [*i]")
    bomb = write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    with pytest.raises(
        ConfigError, match=r"bomb\.yaml: \$\.\w.*: expands to more than .*\(line \d+, column \d+\)"
    ):
        load_config(bomb)
    loop = write(tmp_path, "loop.yaml", "a: &a [*a]\nstages: []\n")
    assert "refers to a node that contains it" in config_error(loop, "$.a[0]")


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


def test_stage_overrides_merge_into_a_placement():
    data = linear("a")
    data["stages"][0]["placement"] = {"ray": {"num_gpus": 1, "resources": {"x": 1}}}
    for config in (data, load_config(data)):  # a dict, and a loaded config
        cfg = load_config(config, stage_overrides={"a": {"placement": {"ray": {"num_cpus": 2}}}})
        ray = cfg.stage("a").placement.ray
        assert (ray.num_cpus, ray.num_gpus, ray.resources) == (2.0, 1.0, {"x": 1.0})


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


@pytest.mark.parametrize(
    ("first", "second", "named"),
    [
        (
            "ray://a:10001",
            "ray://b:10001",
            "at 'ray://b:10001' but stage 'a' .* at 'ray://a:10001'",
        ),
        (None, "auto", "at 'auto' but stage 'a' .* at a local Ray \\(no address\\)"),
    ],
)
def test_ray_stages_must_share_one_address(first, second, named):
    data = linear("a", "b", "c")
    data["stages"][0]["placement"] = {"ray": {"address": first}}
    data["stages"][2]["placement"] = {"ray": {"address": second}}
    with pytest.raises(ConfigError, match=named + ".*one Ray cluster") as info:
        load_config(data)
    assert info.value.path == "$.stages[2].placement.ray.address"
    data["stages"][2]["placement"] = {"ray": {"address": first, "num_cpus": 2}}
    assert load_config(data).stage("c").placement.ray.address == first  # the same: fine


# -- omni-trio validate: exit 2 and one line naming the file and path -------------------


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("opt.yaml", one_stage_yaml("    options: {outptus: 3}\n"), "$.stages[0].options.outptus"),
        (
            "nan.yaml",
            one_stage_yaml("    stage_init_timeout: .nan\n"),
            "$.stages[0].stage_init_timeout",
        ),
        ("dup.json", '{"name": "a", "name": "b", "stages": []}', "$.name"),
        (
            "rel.yaml",
            one_stage_yaml("    input_processor: '.x:f'\n"),
            "$.stages[0].input_processor",
        ),
        ("bytes.yaml", b"name: \xff\n", "$"),
        ("deep.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "$"),
    ],
)
def test_cli_validate_exits_2_with_one_line(tmp_path, capsys, name, text, where):
    from omni_trio.cli import main

    path = write(tmp_path, name, text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"omni-trio: error: ConfigError: {path}: {where}: ")


def test_cli_validate_ok(tmp_path, capsys):
    from omni_trio.cli import main

    path = write(tmp_path, "ok.yaml", one_stage_yaml())
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {path}: pipeline 't', 1 stages")


def test_cli_validate_keeps_one_line_for_a_big_pipeline(tmp_path, capsys):
    from omni_trio.cli import main

    stages = [stage(f"s{i}", inputs=[f"s{i - 1}"] if i else []) for i in range(100)]
    stages[-1]["final_output"] = True
    path = write(tmp_path, "big.json", json.dumps({"name": "big", "stages": stages}))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.endswith("s11(scripted <- s10), ... (88 more)")
