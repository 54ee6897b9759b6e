"""The backends' option Structs and the load-time stage checks (omni_trio.config.options)."""

import sys
import textwrap

import msgspec
import pytest

from omni_trio import ConfigError, load_config
from omni_trio.config.options import (
    DEFAULT_TORCH_FACTORY,
    DiffusionOptions,
    ScriptedOptions,
    TorchOptions,
    VllmOptions,
    check_diffusion_options,
    options_type_of,
    parse_options,
    parse_torch_options,
    split_torch_options,
)
from omni_trio.stages.factory import create_backend


def test_parse_options_defaults_types_and_paths():
    opts = parse_options(
        ScriptedOptions, {"outputs": 3, "latency_s": 1}, where="$.stages[4].options"
    )
    assert opts.outputs == 3 and opts.latency_s == 1.0 and opts.hang is False
    assert opts.record_limit == 10_000
    assert parse_options(ScriptedOptions, {"record": False}, where="$").record_limit == 0
    assert parse_options(ScriptedOptions, {"record": True}, where="$").record_limit == 10_000
    with pytest.raises(ConfigError) as info:
        parse_options(
            ScriptedOptions, {"hang": "yes"}, where="$.stages[4].options", source="p.yaml"
        )
    assert info.value.path == "$.stages[4].options.hang" and info.value.source == "p.yaml"
    assert "Expected `bool`, got str 'yes'" in str(info.value)
    with pytest.raises(ConfigError, match=r"options\.latency_s: must be a finite number"):
        parse_options(ScriptedOptions, {"latency_s": float("inf")}, where="$.stages[0].options")
    known = "unknown scripted option 'x'; known: abort_delay_s, audio_samples, crash_at_request"
    with pytest.raises(ConfigError, match=known):
        parse_options(ScriptedOptions, {"x": 1}, where="$", backend="scripted")


def test_vllm_options():
    opts = parse_options(VllmOptions, {"cpu_bind": [0, "1"], "output_buffer": 8}, where="$")
    assert opts.cpu_bind == [0, "1"] and opts.output_buffer == 8 and opts.abort_timeout_s == 10.0
    assert msgspec.structs.asdict(opts)["cpu_bind"] == [0, "1"]  # what the worker reads
    for bad in ({"abort_timeout_s": 0}, {"output_buffer": 0}, {"cpu_bind": 1.5}, {"x": 1}):
        with pytest.raises(ConfigError, match=r"\$\.options\."):
            parse_options(VllmOptions, bad, where="$.options", backend="vllm")


def test_torch_options_split_factory_keys_and_callables():
    own, rest, given = split_torch_options({"max_batch_size": 2, "weights": "w.pt"})
    assert own == {"max_batch_size": 2} and rest == {"weights": "w.pt"} and given is None

    def factory(options):
        return options

    own, rest, given = split_torch_options({"factory": factory, "seed": 1})
    assert own == {} and rest == {"seed": 1} and given is factory
    opts, rest = parse_torch_options({"factory": factory, "chunk_size": 4})
    assert opts.factory == DEFAULT_TORCH_FACTORY and opts.chunk_size == 4
    assert isinstance(opts, TorchOptions)
    with pytest.raises(ConfigError, match=r"stages\[3\]\.options\.torch_threads"):
        parse_torch_options({"torch_threads": 0}, stage_index=3)


def test_options_type_of_a_user_factory():
    class Opts(msgspec.Struct):
        n: int = 1

    class Factory:
        Options = Opts

    assert options_type_of(Factory) is Opts
    assert options_type_of(object()) is None
    assert options_type_of(type("NotStruct", (), {"Options": dict})) is None


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A real importable package with a user backend that declares Options, a torch factory
    that declares Options, and a processor."""
    pkg = tmp_path / "userpkg_options"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "backends.py").write_text(
        textwrap.dedent(
            """
            import msgspec
            from omni_trio.backends.scripted import ScriptedBackend

            class MyOptions(msgspec.Struct, forbid_unknown_fields=True):
                greeting: str = "hi"
                repeat: int = 1

            class MyBackend(ScriptedBackend):
                Options = MyOptions

                def __init__(self, config, *, stage_index, replica=0):
                    from omni_trio.config.options import parse_options
                    self.mine = parse_options(
                        MyOptions, config.options, where=f"$.stages[{stage_index}].options"
                    )
                    config = type(config)(id=config.id, final_output=config.final_output)
                    super().__init__(config, stage_index=stage_index, replica=replica)

            class FactoryOptions(msgspec.Struct, forbid_unknown_fields=True):
                seed: int = 0

            def build(options):
                raise AssertionError("not called at load")

            build.Options = FactoryOptions
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg_options.backends"
    for name in [m for m in sys.modules if m.startswith("userpkg_options")]:
        del sys.modules[name]


def one_stage(**kw):
    return {"stages": [{"id": "a", "final_output": True, **kw}]}


def test_user_backend_options_checked_at_load(user_modules):
    backend = f"{user_modules}:MyBackend"
    cfg = load_config(one_stage(backend=backend, options={"greeting": "yo", "repeat": 2}))
    made = create_backend(cfg.stages[0], stage_index=0, replica=0)
    assert made.mine.greeting == "yo" and made.mine.repeat == 2
    with pytest.raises(ConfigError) as info:
        load_config(one_stage(backend=backend, options={"greting": "yo"}))
    assert info.value.path == "$.stages[0].options.greting"
    assert "unknown option 'greting'; known: greeting, repeat" in str(info.value)
    with pytest.raises(ConfigError, match=r"\$\.stages\[0\]\.options\.repeat: Expected `int`"):
        load_config(one_stage(backend=backend, options={"repeat": "2"}))
    with pytest.raises(
        ConfigError, match=r"\$\.stages\[0\]\.backend: .*no callable 'NOT_CALLABLE'"
    ):
        load_config(one_stage(backend=f"{user_modules}:NOT_CALLABLE"))


def test_user_backend_without_options_struct_is_passed_through():
    cfg = load_config(
        one_stage(backend="omni_trio.backends.scripted:ScriptedBackend", options={"outputs": 2})
    )
    assert cfg.stages[0].options == {"outputs": 2}


def test_torch_factory_options_struct_checked_at_load(user_modules):
    pytest.importorskip("torch")
    factory = f"{user_modules}:build"
    cfg = load_config(one_stage(backend="torch", options={"factory": factory, "seed": 3}))
    assert cfg.stages[0].options == {"factory": factory, "seed": 3}
    with pytest.raises(ConfigError) as info:
        load_config(one_stage(backend="torch", options={"factory": factory, "sed": 3}))
    assert info.value.path == "$.stages[0].options.sed"


def test_torch_weights_path_must_exist(tmp_path):
    weights = tmp_path / "w.pt"
    opts = {"weights": str(weights)}
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(one_stage(backend="torch", options=opts))
    assert info.value.path == "$.stages[0].options.weights"
    weights.write_bytes(b"")
    assert load_config(one_stage(backend="torch", options=opts)).stages[0].backend == "torch"
    # a tiny: reference is the factory's to resolve, not a path
    load_config(one_stage(backend="torch", options={"weights": "tiny:code2wav"}))


def test_scripted_pipeline_helper_still_takes_a_dict():
    from omni_trio.testing import scripted_pipeline

    cfg = scripted_pipeline(["a", "b"], outputs=3, stage_options={"b": {"latency_s": 0.5}})
    assert cfg.stage("b").options == {"outputs": 3, "latency_s": 0.5}
    with pytest.raises(ConfigError, match=r"\.options\.outptus"):
        scripted_pipeline(["a"], outptus=3)


def test_scripted_max_tokens_checked_at_load():
    assert load_config(one_stage(default_sampling_params={"max_tokens": 4, "temperature": 0}))
    for bad in ("lots", 0, True, 2.5):
        with pytest.raises(ConfigError) as info:
            load_config(one_stage(default_sampling_params={"max_tokens": bad}))
        assert info.value.path == "$.stages[0].default_sampling_params.max_tokens"
        assert "max_tokens must be an integer >= 1" in str(info.value)


# -- the diffusion backend's options, checked at load (no model) -------------------------------

WHERE = "$.stages[1].options"


def test_offload_on_cpu_is_named_at_its_path() -> None:
    options = DiffusionOptions(model="tiny:diffusion", enable_model_cpu_offload=True)
    with pytest.raises(ConfigError, match="needs an accelerator device") as info:
        check_diffusion_options(options, WHERE)
    assert info.value.path == "$.stages[1].options.enable_model_cpu_offload"
    options = DiffusionOptions(model="x", enable_sequential_cpu_offload=True, device="cpu:0")
    with pytest.raises(ConfigError, match="accelerator device .*not device 'cpu:0'") as info:
        check_diffusion_options(options, WHERE)
    assert info.value.path == "$.stages[1].options.enable_sequential_cpu_offload"


def test_both_offloads_exclude_each_other() -> None:
    options = DiffusionOptions(
        model="x", device="cuda", enable_model_cpu_offload=True, enable_sequential_cpu_offload=True
    )
    with pytest.raises(ConfigError, match="exclude each other") as info:
        check_diffusion_options(options, WHERE)
    assert info.value.path == "$.stages[1].options.enable_sequential_cpu_offload"


def test_options_without_offload_pass_on_cpu() -> None:
    flags = {"enable_attention_slicing": True, "enable_vae_slicing": True}
    check_diffusion_options(DiffusionOptions(model="x", enable_vae_tiling=True, **flags), WHERE)


def test_scripted_options_belong_to_the_scripted_model() -> None:
    given = {"model": "tiny:diffusion", "scripted_step_s": 1.0}
    options = DiffusionOptions(model="tiny:diffusion", scripted_step_s=1.0)
    with pytest.raises(ConfigError, match="applies to model scripted only") as info:
        check_diffusion_options(options, WHERE, given)
    assert info.value.path == "$.stages[1].options.scripted_step_s"
    check_diffusion_options(DiffusionOptions(model="scripted", scripted_step_s=1.0), WHERE, given)


def test_a_config_with_a_cpu_offload_is_refused_at_load() -> None:
    stage = {"id": "image", "backend": "diffusion", "output_type": "image", "final_output": True}
    cfg = {
        "name": "i",
        "stages": [{**stage, "options": {"model": "x", "enable_model_cpu_offload": True}}],
    }
    with pytest.raises(ConfigError, match="needs an accelerator device") as info:
        load_config(cfg)
    assert info.value.path == "$.stages[0].options.enable_model_cpu_offload"
