"""Building a stage's replica backends from its config: the built-in backends by name, user
backends by dotted path (``package.module:Factory``).

The built-in backends are listed once, in :data:`omni_trio.config.backends.BUILTIN_BACKENDS`
(their classes by dotted path, imported when a replica is built). What a dotted ``backend:``
path may name is checked when the config is loaded
(:func:`omni_trio.config.backends.check_factory`, so ``omni-trio validate`` catches it) and
again here; the factory runs when the engine builds each replica (:func:`create_backend`).
"""

from __future__ import annotations

import importlib
import typing
from collections.abc import Callable

from ..config.backends import BUILTIN_BACKENDS, check_factory
from ..config.dotted import import_dotted
from ..config.stage import StageConfig
from ..errors import BackendUnavailableError, ConfigError
from .backend import StageBackend

__all__ = ["RAY_BACKEND", "BackendFactory", "create_backend", "resolve_factory"]

#: builds one replica's backend: ``factory(config, stage_index=..., replica=...)``
BackendFactory = Callable[..., StageBackend]  # type: ignore[explicit-any]

#: the backend a stage placed on Ray gets (it builds the stage's own backend in an actor)
RAY_BACKEND = "omni_trio.backends.ray.backend:RayBackend"


def resolve_factory(path: str, *, where: str, source: str | None = None) -> BackendFactory:
    """Import the backend factory a ``"package.module:Factory"`` path names and check it
    (:func:`~omni_trio.config.backends.check_factory`). Blocking (imports the module). Raises
    :class:`ConfigError` naming ``where``; a missing optional dependency of the module stays a
    :class:`BackendUnavailableError`."""
    factory = import_dotted(path, what="backend", where=where, source=source)
    check_factory(factory, path, where=where, source=source)
    return typing.cast(BackendFactory, factory)


def create_backend(
    config: StageConfig, *, stage_index: int, replica: int, source: str | None = None
) -> StageBackend:
    """Build one replica of a stage from its config: a :class:`~.ray.RayBackend` (which
    builds the stage's backend inside a Ray actor) when the stage is placed on Ray.
    ``source`` (the config's file) is named in errors. Raises
    ConfigError/BackendUnavailableError."""
    where = f"$.stages[{stage_index}].backend"
    placement = getattr(config, "placement", None)
    builtin = BUILTIN_BACKENDS.get(config.backend)
    factory: BackendFactory
    if placement is not None and placement.ray is not None:
        # imports no ray: that happens when it starts
        factory = _builtin_factory(RAY_BACKEND, config, "ray")
    elif builtin is None:
        factory = resolve_factory(config.backend, where=where, source=source)
    else:
        factory = _builtin_factory(builtin.factory, config, builtin.extra)
    try:
        backend = factory(config, stage_index=stage_index, replica=replica)
    except (ConfigError, BackendUnavailableError):
        raise
    except Exception as exc:
        raise ConfigError(
            f"backend factory {config.backend!r} failed for stage {config.id!r}: "
            f"{type(exc).__name__}: {exc}",
            path=where,
            source=source,
        ) from exc
    if not isinstance(backend, StageBackend):
        raise ConfigError(
            f"backend {config.backend!r} returned {type(backend).__name__}, "
            f"not an omni_trio.stages.StageBackend",
            path=where,
            source=source,
        )
    return backend


def _builtin_factory(path: str, config: StageConfig, extra: str) -> BackendFactory:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"stage {config.id!r}: backend {config.backend!r} needs an optional dependency "
            f"({exc.name or exc}); install omni-trio[{extra or config.backend}]"
        ) from exc
    return typing.cast(BackendFactory, getattr(module, attr))
