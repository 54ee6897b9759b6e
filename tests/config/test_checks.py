"""The checks beyond types (``omni_trio.config.checks``): stage ids, backends, inputs, an
entry stage, no cycle, a final output, the entry-only prompt hooks, every backend's
``options`` and dotted paths (imported at load), vllm stages against vLLM's own fields, and
one Ray cluster for every Ray stage."""

from pathlib import Path

import pytest

import omni_trio.pipelines
from omni_trio import ConfigError, load_config

from .test_loading import linear, stage
from .test_reading import stage_error


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


def test_unknown_backend_and_no_stages():
    data = linear("a")
    data["stages"][0]["backend"] = "not a backend"
    with pytest.raises(ConfigError, match="unknown backend"):
        load_config(data)
    with pytest.raises(ConfigError, match="at least one stage"):
        load_config({"stages": []})


def test_unknown_and_ill_typed_options(tmp_path):
    msg = stage_error(tmp_path, "    options: {outptus: 3}\n", "$.stages[0].options.outptus")
    assert "unknown scripted option 'outptus'" in msg and "outputs" in msg
    msg = stage_error(tmp_path, "    options: {outputs: '3'}\n", "$.stages[0].options.outputs")
    assert "Expected `int`, got str '3'" in msg
    msg = stage_error(tmp_path, "    options: {latency_s: -1}\n", "$.stages[0].options.latency_s")
    assert ">= 0.0" in msg


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
        (
            "engine_args: {kv_transfer_config: {kv_connector: NixlConnector, "
            "kv_role: kv_both, kv_buffer_size: 1000}}",
            "engine_args.kv_transfer_config.kv_buffer_size",
            "'kv_buffer_size' is not a vllm KVTransferConfig field",
        ),
        (
            "engine_args: {kv_transfer_config: NixlConnector}",
            "engine_args.kv_transfer_config",
            "must be a mapping of vLLM KVTransferConfig fields, not str",
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
