"""torchvision for vLLM's Qwen-VL family beside a CPU torch (torchvision_cpu.py).

The fast tests run what changes process-wide state (torch's operator registry,
``sys.meta_path``) in subprocesses, against fake torchvision packages. The slow and vllm
tests use the real one: installed as usual, or in the project's directory (``make venv``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio.backends.vllm import torchvision_cpu
from omni_trio.backends.vllm.backend import VllmBackend
from omni_trio.backends.vllm.torchvision_cpu import (
    DIR_ENV,
    PREPARE_ENV,
    TorchvisionSetup,
    ensure_torchvision,
    matching_requirement,
    model_config,
    needs_torchvision,
    torchvision_dir,
)
from omni_trio.config import StageConfig
from omni_trio.errors import BackendUnavailableError
from omni_trio.outputs import StageInput

from ...conftest import bounded, engine_seconds
from .test_backend import leftover_engine_processes, run, tokens

QWEN3_OMNI = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
    "model_type": "qwen3_omni_moe",
}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def run_python(
    tmp: Path, source: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
) -> str:
    """Run ``source`` as a script in a fresh interpreter (this checkout first on its path,
    no :data:`PREPARE_ENV` unless ``env`` sets it); its stdout."""
    script = tmp / "script.py"
    script.write_text(textwrap.dedent(source))
    paths = [str(Path(torchvision_cpu.__file__).parents[3]), os.environ.get("PYTHONPATH", "")]
    base = {k: v for k, v in os.environ.items() if k != PREPARE_ENV}
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=engine_seconds(120),
        env={**base, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def fake_torchvision(root: Path, compiled: str | None) -> Path:
    """A directory holding a package named torchvision (importing it records the two
    operators' schemas it finds) with distribution metadata; its ``_C`` is ``compiled``
    (``"loads"``: a library that loads; ``"broken"``: one that does not; None: none)."""
    package = root / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import torch\n"
        "__version__ = '0.0.1'\n"
        "schemas = [str(getattr(torch.ops.torchvision, op).default._schema)\n"
        "           for op in ('nms', 'qnms') if hasattr(torch.ops.torchvision, op)]\n"
    )
    (package / "sub.py").write_text("VALUE = 7\n")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if compiled == "loads":  # any shared library this interpreter can load
        shutil.copy(json_extension(), package / f"_C{suffix}")
    elif compiled == "broken":
        (package / f"_C{suffix}").write_bytes(b"\x7fELF not really")
    info = root / "torchvision-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.1\n")
    return root


def json_extension() -> str:
    import _json

    path = getattr(_json, "__file__", None)
    if path is None:
        pytest.skip("this interpreter has _json built in: no shared library to load")
    return path


# -- the decision (pure) -------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        QWEN3_OMNI,
        {"architectures": ["Qwen3OmniMoeThinkerForConditionalGeneration"]},
        {"model_type": "qwen3_omni_moe_thinker"},
        {"architectures": ["Qwen2_5OmniForConditionalGeneration"], "model_type": "qwen2_5_omni"},
        {"model_type": "something", "thinker_config": {"model_type": "qwen2_5_omni_thinker"}},
        {"architectures": ["Qwen2VLForConditionalGeneration"]},
        {"architectures": ["Qwen2_5_VLForConditionalGeneration"]},
        {"architectures": ["Qwen3VLMoeForConditionalGeneration"]},
        {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe"},
    ],
)
def test_the_qwen_vl_family_needs_torchvision(config: dict[str, Any]) -> None:
    assert needs_torchvision(config)


@pytest.mark.parametrize(
    "config",
    [
        LLAMA,
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
        {"architectures": "Qwen3OmniMoeForConditionalGeneration"},  # not a list: not read
        {"thinker_config": "qwen3_omni_moe_thinker"},
        {},
    ],
)
def test_other_models_do_not(config: dict[str, Any]) -> None:
    assert not needs_torchvision(config)


def test_the_requirement_matches_torch() -> None:
    assert matching_requirement("2.13.0+cpu") == "torchvision==0.28.*"
    assert matching_requirement("2.5.1") == "torchvision==0.20.*"
    for bad in ("1.13.0", "2", "2.x", "nonsense"):
        with pytest.raises(ValueError, match="expected 2.N"):
            matching_requirement(bad)


def test_the_directory_is_under_the_venv_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DIR_ENV, raising=False)
    assert torchvision_dir() == Path(sys.prefix) / "omni-trio-torchvision"
    monkeypatch.setenv(DIR_ENV, "/elsewhere/tv")
    assert torchvision_dir() == Path("/elsewhere/tv")


def test_model_config_reads_a_local_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_OMNI))
    assert model_config(str(tmp_path)) == QWEN3_OMNI
    assert model_config(str(tmp_path / "absent")) is None
    assert model_config("no-such-org/no-such-model") is None  # not in the hub cache
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        model_config(str(tmp_path))


# -- acting --------------------------------------------------------------------------------
def test_the_llama_path_imports_neither_torch_nor_torchvision(tmp_path: Path) -> None:
    # the tiny-omni demo's models: the backend's preparation and the plugin (without the
    # variable an engine of the family would set) leave every import alone
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    out = run_python(
        tmp_path,
        f"""
        import sys
        from omni_trio.backends.vllm import plugin, torchvision_cpu
        print(torchvision_cpu.prepare_for_model({str(tmp_path)!r}))
        plugin.register()
        print(sorted(m for m in ("torch", "torchvision", "transformers") if m in sys.modules))
        print([f for f in sys.meta_path if "torchvision" in repr(f)])
        """,
    )
    assert out.split() == ["{}", "[]", "[]"]


def test_a_missing_torchvision_names_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torchvision_cpu, "_installed_torchvision", lambda: None)
    monkeypatch.setattr(torchvision_cpu, "_setup", None)
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    finders = list(sys.meta_path)
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "absent", tmp_path / "empty"):
        with pytest.raises(BackendUnavailableError) as caught:
            ensure_torchvision(directory)
        message = str(caught.value)
        assert "Qwen-VL family" in message and str(directory) in message
        assert "pip install --no-deps --target" in message and "torchvision==0." in message
        assert "make venv" in message and "omni-trio[qwen-omni]" in message
    assert sys.meta_path == finders and torchvision_cpu._setup is None  # a later try may work
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_OMNI))
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "absent"))
    with pytest.raises(BackendUnavailableError, match="absent"):
        torchvision_cpu.prepare_for_model(str(tmp_path))


ENSURE_FROM_THREADS = """
    import importlib.metadata, importlib.util, sys, threading
    from pathlib import Path
    from omni_trio.backends.vllm import torchvision_cpu as tv

    tv._installed_torchvision = lambda: None  # as in the CPU venv, whatever this machine has
    results = []
    directory = Path(sys.argv[-1])
    threads = [threading.Thread(target=lambda: results.append(tv.ensure_torchvision(directory)))
               for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert len(results) == 8 and all(r is results[0] for r in results), results
    print(results[0].schemas_defined, results[0].environment())
    import torchvision, torchvision.sub
    print(torchvision.__file__.startswith(sys.argv[-1]), torchvision.sub.VALUE, torchvision.schemas)
    print(tv.define_schemas())
    print(importlib.metadata.version("torchvision"), importlib.util.find_spec("json") is not None)
    print(sum("torchvision" in repr(f) for f in sys.meta_path))
"""


@pytest.mark.slow  # a subprocess that imports torch
@pytest.mark.parametrize("compiled", [None, "broken"])
def test_schemas_are_defined_once_where_the_compiled_ops_do_not_load(
    tmp_path: Path, compiled: str | None
) -> None:
    directory = fake_torchvision(tmp_path / "tv", compiled)
    lines = run_python(tmp_path, ENSURE_FROM_THREADS, args=(str(directory),)).splitlines()
    schema = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    assert lines == [
        f"True {{'{PREPARE_ENV}': '{directory}'}}",
        f"True 7 ['torchvision::nms{schema}', 'torchvision::qnms{schema}']",
        "[]",  # defined once: the 8 threads' first call did it, before the import
        "0.0.1 True",
        "1",
    ]


@pytest.mark.slow  # a subprocess that imports torch
def test_a_torchvision_whose_compiled_ops_load_is_left_alone(tmp_path: Path) -> None:
    directory = fake_torchvision(tmp_path / "tv", "loads")
    lines = run_python(tmp_path, ENSURE_FROM_THREADS, args=(str(directory),)).splitlines()
    # no schema defined (a real _C defines them itself); still served from the directory
    assert lines == [
        f"False {{'{PREPARE_ENV}': '{directory}'}}",
        "True 7 []",
        "['nms', 'qnms']",
        "0.0.1 True",
        "1",
    ]


@pytest.mark.slow  # a subprocess that imports torch
def test_the_plugin_prepares_a_spawned_process_the_environment_names(tmp_path: Path) -> None:
    directory = fake_torchvision(tmp_path / "tv", "broken")
    out = run_python(
        tmp_path,
        """
        import multiprocessing, sys

        def child():
            from omni_trio.backends.vllm import plugin
            plugin.register()
            import torchvision
            print(torchvision.__file__, len(torchvision.schemas), flush=True)

        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(target=child)
            p.start(); p.join()
            print("torchvision" in sys.modules, p.exitcode)
        """,
        env={PREPARE_ENV: str(directory)},
    )
    assert out.split() == [str(directory / "torchvision" / "__init__.py"), "2", "False", "0"]


def test_setup_environment() -> None:
    assert TorchvisionSetup(None, False).environment() == {}
    assert TorchvisionSetup(None, True).environment() == {PREPARE_ENV: ""}
    assert TorchvisionSetup("/d", False).environment() == {PREPARE_ENV: "/d"}


# -- the real torchvision ------------------------------------------------------------------
@pytest.mark.slow  # imports vllm's model modules in a subprocess
def test_vllm_qwen_omni_thinker_modules_import(tmp_path: Path) -> None:
    out = run_python(
        tmp_path,
        """
        import importlib.metadata, sys
        from omni_trio.backends.vllm import torchvision_cpu as tv
        setup = tv.ensure_torchvision()
        import vllm.model_executor.models.qwen2_5_omni_thinker
        import vllm.model_executor.models.qwen3_omni_moe_thinker
        import torch, torchvision
        print(setup.directory is None or torchvision.__file__.startswith(setup.directory))
        wanted = tv.matching_requirement(torch.__version__).removesuffix("*")
        print(f"torchvision=={torchvision.__version__}".startswith(wanted))
        print(importlib.metadata.version("torchvision") == torchvision.__version__.split("+")[0])
        """,
    )
    assert out.split() == ["True", "True", "True"]


def tiny_qwen3_omni(root: Path) -> Path:
    """A tiny Qwen3-Omni checkpoint without weights (vLLM's dummy load format): its config
    (thinker shrunk, with the fields vLLM reads) and the tiny thinker's tokenizer."""
    from transformers import Qwen3OmniMoeConfig

    from omni_trio.models.tiny import ensure_tiny_model

    tokenizer = ensure_tiny_model("thinker")
    root.mkdir(parents=True)
    for f in tokenizer.glob("tokenizer*"):
        shutil.copy(f, root / f.name)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [12, 10, 10]}
    rope |= {"interleaved": True, "mrope_interleaved": True}
    text = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        rope_parameters=rope, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    audio = dict(
        num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
        d_model=32, output_dim=128, downsample_hidden_size=32,
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128,
        num_position_embeddings=64, deepstack_visual_indexes=[0], image_size=128,
        apply_vit_abs_pos_embed=True,
    )  # fmt: skip
    ids = dict(
        audio_token_id=500, image_token_id=501, video_token_id=502, audio_start_token_id=503,
        audio_end_token_id=504, vision_start_token_id=505, vision_end_token_id=506,
        user_token_id=507,
    )  # fmt: skip
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, **ids)
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker, architectures=["Qwen3OmniMoeForConditionalGeneration"]
    )
    config.save_pretrained(root)
    return root


@pytest.mark.vllm
async def test_the_vllm_backend_serves_a_qwen3_omni_thinker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_qwen3_omni(tmp_path / "qwen3-omni")
    # an empty model-info cache: vLLM inspects the model class in a plain subprocess, which
    # only the environment prepares
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    engine_args = {
        "model": str(model),
        "language_model_only": True,
        "dtype": "float32",
        "load_format": "dummy",
        "max_model_len": 256,
    }
    backend = VllmBackend(
        StageConfig(id="thinker", backend="vllm", engine_args=engine_args), stage_index=0
    )
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    async with trio.open_nursery() as nursery:
        with bounded("the Qwen3-Omni thinker's start", 240, backend):
            await nursery.start(backend.serve)
        with bounded("the Qwen3-Omni thinker's outputs", 120, backend):
            by_ids = await run(backend, "ids", StageInput(token_ids=(10, 20, 30, 40)), greedy)
            again = await run(backend, "again", StageInput(token_ids=(10, 20, 30, 40)), greedy)
            by_text = await run(backend, "text", StageInput(prompt="hello tiny world"), greedy)
        assert len(tokens(by_ids)) == 8 and all(0 <= t < 512 for t in tokens(by_ids))
        assert tokens(again) == tokens(by_ids)  # greedy
        assert len(tokens(by_text)) == 8 and by_text[-1].finished
        assert backend.statistics().requests_in_flight == 0
        nursery.cancel_scope.cancel()
    assert leftover_engine_processes() == []
    # the variable was the engine's spawn's only; this process serves torchvision still
    assert PREPARE_ENV not in os.environ
    assert ensure_torchvision().directory in (None, str(torchvision_dir()))
