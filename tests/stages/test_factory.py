"""What a stage's ``backend: "package.module:Factory"`` may name, checked when the config is
loaded (``omni-trio validate`` included), and the errors of building a replica naming the
config's file."""

from __future__ import annotations

import json

import pytest

import omni_trio
from omni_trio import ConfigError, StageBackend, load_config
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.cli.main import main
from omni_trio.config import StageConfig
from omni_trio.config.backends import check_factory
from omni_trio.stages import create_backend

FACTORIES = """
    import functools
    from typing import TYPE_CHECKING
    from omni_trio import StageBackend
    from omni_trio.backends.scripted import ScriptedBackend
    if TYPE_CHECKING:
        from omni_trio.backends.scripted import ScriptedBackend as Hidden

    def build(config, *, stage_index, replica=0) -> ScriptedBackend:
        return ScriptedBackend(config, stage_index=stage_index, replica=replica)

    def build_base(config, **keys) -> StageBackend:
        return ScriptedBackend(config, **keys)

    class Maker:
        def __call__(self, config, *, stage_index, replica=0) -> ScriptedBackend:
            return ScriptedBackend(config, stage_index=stage_index, replica=replica)

    class Built(ScriptedBackend):
        @classmethod
        def make(cls, config, *, stage_index, replica=0) -> "Built":
            return cls(config, stage_index=stage_index, replica=replica)

    maker = Maker()
    partly = functools.partial(ScriptedBackend)

    def unannotated(config, *, stage_index, replica=0):
        return ScriptedBackend(config, stage_index=stage_index, replica=replica)

    def returns_dict(config, *, stage_index, replica=0) -> dict:
        return {}

    def hidden(config, *, stage_index, replica=0) -> "Hidden":
        return ScriptedBackend(config, stage_index=stage_index, replica=replica)

    def one_argument(config) -> ScriptedBackend:
        return ScriptedBackend(config, stage_index=0)

    class NoKeywords(ScriptedBackend):
        def __init__(self, config):
            super().__init__(config, stage_index=0)

    class Abstract(StageBackend):
        async def _start(self):
            pass

    def fails(config, *, stage_index, replica=0) -> ScriptedBackend:
        raise ValueError("no accelerator here")

    def lies(config, *, stage_index, replica=0) -> ScriptedBackend:
        return "not a backend"

    NOT_CALLABLE = 3
"""


@pytest.fixture
def factories(user_module):
    return user_module(FACTORIES)


def pipeline(backend: str) -> dict[str, object]:
    # the user backend is the second stage: errors must name $.stages[1]
    return {
        "name": "p",
        "stages": [
            {"id": "a"},
            {"id": "b", "backend": backend, "inputs": ["a"], "final_output": True},
        ],
    }


@pytest.mark.parametrize(
    "name", ["build", "build_base", "maker", "Built.make", "partly", "Built"], ids=str
)
async def test_every_kind_of_factory_loads_and_serves(autojump_clock, factories, name):
    cfg = load_config(pipeline(f"{factories}:{name}"))
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate([1], request_id="r").collect()
        assert isinstance(engine.pools["b"].replica(0), ScriptedBackend)
    assert outs[-1].stage_id == "b" and outs[-1].finished
    assert {o.token_ids for o in outs} == {(3,)}  # two hops of +1 on the prompt's token


BAD = [
    ("json:dumps", "names the function dumps with no return annotation"),
    ("json:JSONEncoder", "names the class json.encoder.JSONEncoder, which is not an"),
    ("omni_trio:StageBackend", "names the abstract class StageBackend: it does not implement"),
    ("{m}:Abstract", "names the abstract class Abstract: it does not implement _run"),
    ("{m}:unannotated", "with no return annotation, so nothing says it builds a backend"),
    ("{m}:returns_dict", "names the function returns_dict that returns dict, not a StageBackend"),
    ("{m}:hidden", "whose annotations cannot be resolved (NameError: name 'Hidden'"),
    ("{m}:one_argument", "cannot be called as factory(stage_config, stage_index=i, replica=r)"),
    ("{m}:NoKeywords", "cannot be called as factory(stage_config, stage_index=i, replica=r)"),
    ("{m}:no_such_name", "has no 'no_such_name'"),
    ("{m}:NOT_CALLABLE", "has no callable 'NOT_CALLABLE' (it is a int)"),
    ("builtins:len", "names the function len, not a backend factory"),
    ("no_such_module_xyz:Backend", "cannot import backend module 'no_such_module_xyz'"),
]


@pytest.mark.parametrize(("backend", "reason"), BAD, ids=[b for b, _ in BAD])
def test_a_backend_path_that_names_no_factory_fails_at_load(tmp_path, factories, backend, reason):
    backend = backend.format(m=factories)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(pipeline(backend)))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    err = caught.value
    assert (err.source, err.path) == (str(path), "$.stages[1].backend")
    assert reason in err.reason
    assert str(err).startswith(f"{path}: $.stages[1].backend: ")


@pytest.mark.parametrize("backend", ["json:dumps", "json:JSONEncoder", "{m}:no_such_name"])
def test_validate_exits_2_naming_the_file_and_the_backend(tmp_path, capsys, factories, backend):
    backend = backend.format(m=factories)
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: p\nstages:\n  - id: a\n  - id: b\n"
        f"    backend: '{backend}'\n    inputs: [a]\n    final_output: true\n"
    )
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out, captured
    assert lines[0].startswith(
        f"omni-trio: error: ConfigError: {path}: $.stages[1].backend: backend {backend!r}"
    )


def test_check_factory_calls_nothing():
    called = []

    def build(config, *, stage_index, replica=0) -> ScriptedBackend:
        called.append(config)
        raise AssertionError("a factory is not called at load")

    check_factory(build, "m:build", where="$.stages[0].backend")
    check_factory(ScriptedBackend, "m:S", where="$.stages[0].backend")
    assert called == []


async def test_a_factory_failing_at_start_names_the_file(autojump_clock, tmp_path, factories):
    # the factory is legal at load; what it raises when the engine builds the replica is a
    # ConfigError naming the file and the stage's backend, caused by it
    for name, reason in [
        ("fails", "backend factory '{b}' failed for stage 'b': ValueError: no accelerator here"),
        ("lies", "backend '{b}' returned str, not an omni_trio.stages.StageBackend"),
    ]:
        backend = f"{factories}:{name}"
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(pipeline(backend)))
        cfg = load_config(path)
        with pytest.raises(ConfigError) as caught:
            async with omni_trio.open_engine(cfg):
                pytest.fail("the engine opened")
        err = caught.value
        assert (err.source, err.path) == (str(path), "$.stages[1].backend")
        assert err.reason == reason.format(b=backend)
        assert name != "fails" or isinstance(err.__cause__, ValueError)


def test_create_backend_checks_a_config_built_in_python(factories):
    # a StageConfig that never went through load_config gets the same check and message
    stage = StageConfig(id="b", backend="json:dumps")
    with pytest.raises(ConfigError, match=r"^<dict>: \$.stages\[4\].backend: backend 'json:du"):
        create_backend(stage, stage_index=4, replica=0)
    stage = StageConfig(id="b", backend=f"{factories}:build")
    backend = create_backend(stage, stage_index=4, replica=1, source="mine.yaml")
    assert isinstance(backend, StageBackend) and (backend.stage_index, backend.replica) == (4, 1)
