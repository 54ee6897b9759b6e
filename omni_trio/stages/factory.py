"""Building a stage's replica backends from its config: the built-in backends by name, user
backends by dotted path (``package.module:Factory``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..config import StageConfig
from ..errors import BackendUnavailableError, ConfigError
from ._abc import StageBackend

__all__ = ["BackendFactory", "create_backend"]

#: builds one replica's backend: ``factory(config, stage_index=..., replica=...)``
BackendFactory = Callable[..., StageBackend]

_BUILTIN = {
    "scripted": ("omni_trio.stages.scripted", "ScriptedBackend"),
    "vllm": ("omni_trio.stages.vllm", "VllmBackend"),
    "torch": ("omni_trio.stages.torch", "TorchBackend"),
}


def create_backend(config: StageConfig, *, stage_index: int, replica: int) -> StageBackend:
    """Build one replica of a stage from its config: a :class:`~.ray.RayBackend` (which
    builds the stage's backend inside a Ray actor) when the stage is placed on Ray. Raises
    ConfigError/BackendUnavailableError."""
    placement = getattr(config, "placement", None)
    if placement is not None and placement.ray is not None:
        from .ray import RayBackend  # imports no ray: that happens when it starts

        return RayBackend(config, stage_index=stage_index, replica=replica)
    where = f"$.stages[{stage_index}].backend"
    module_name, attr = _BUILTIN.get(config.backend, (None, None))
    if module_name is None:
        module_name, _, attr = config.backend.partition(":")
    assert attr is not None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if config.backend in _BUILTIN:
            raise BackendUnavailableError(
                f"stage {config.id!r}: backend {config.backend!r} needs an optional dependency "
                f"({exc.name or exc}); install omni-trio[{config.backend}]"
            ) from exc
        raise ConfigError(
            f"cannot import backend module {module_name!r}: {exc}", path=where
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"backend module {module_name!r} has no {attr!r}", path=where)
    try:
        backend = factory(config, stage_index=stage_index, replica=replica)
    except (ConfigError, BackendUnavailableError):
        raise
    except Exception as exc:
        raise ConfigError(
            f"backend factory {config.backend!r} failed for stage {config.id!r}: "
            f"{type(exc).__name__}: {exc}",
            path=where,
        ) from exc
    if not isinstance(backend, StageBackend):
        raise ConfigError(
            f"backend {config.backend!r} returned {type(backend).__name__}, "
            f"not a omni_trio.stages.StageBackend",
            path=where,
        )
    return backend
