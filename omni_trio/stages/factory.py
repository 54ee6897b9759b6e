"""Building a stage's replica backends from its config: the built-in backends by name, user
backends by dotted path (``package.module:Factory``).

What a dotted ``backend:`` path may name (:func:`check_factory`, run when the config is
loaded, so ``omni-trio validate`` catches it): a :class:`~omni_trio.stages.StageBackend`
subclass that implements the abstract methods (the usual factory: the class builds itself),
or any other callable (a function, a classmethod, a ``functools.partial``) whose return
annotation is a StageBackend subclass. Either way it must accept
``factory(stage_config, stage_index=i, replica=r)``. Nothing is called at load: the factory
runs when the engine builds each replica (:func:`create_backend`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from collections.abc import Callable

from .._dotted import import_dotted
from ..config import StageConfig
from ..errors import BackendUnavailableError, ConfigError
from ._abc import StageBackend

__all__ = ["BackendFactory", "check_factory", "create_backend", "resolve_factory"]

#: builds one replica's backend: ``factory(config, stage_index=..., replica=...)``
BackendFactory = Callable[..., StageBackend]

_BUILTIN = {
    "scripted": ("omni_trio.stages.scripted", "ScriptedBackend"),
    "vllm": ("omni_trio.stages.vllm", "VllmBackend"),
    "torch": ("omni_trio.stages.torch", "TorchBackend"),
}
_CALL = "factory(stage_config, stage_index=i, replica=r)"


def resolve_factory(path: str, *, where: str, source: str | None = None) -> BackendFactory:
    """Import the backend factory a ``"package.module:Factory"`` path names and check it
    (:func:`check_factory`). Blocking (imports the module). Raises :class:`ConfigError`
    naming ``where``; a missing optional dependency of the module stays a
    :class:`BackendUnavailableError`."""
    factory = import_dotted(path, what="backend", where=where, source=source)
    check_factory(factory, path, where=where, source=source)
    return typing.cast(BackendFactory, factory)


def check_factory(factory: object, path: str, *, where: str, source: str | None = None) -> None:
    """Check that ``factory`` (what the backend path ``path`` names) builds a StageBackend:
    see the module docstring. Pure: inspects, calls nothing. Raises :class:`ConfigError`
    naming ``where`` and what the path names instead."""

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"backend {path!r} {reason}", path=where, source=source)

    target = factory
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, type):
        _check_class(target, fail)
    else:
        returned = _return_annotation(target, fail)
        if not (isinstance(returned, type) and issubclass(returned, StageBackend)):
            shown = getattr(returned, "__name__", None) or repr(returned)
            raise fail(
                f"names {_kind(target)} that returns {shown}, not a StageBackend: a backend "
                "factory is an omni_trio.StageBackend subclass, or a callable annotated to "
                "return one"
            )
    try:
        signature = inspect.signature(typing.cast(Callable[..., object], factory))
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the call at start-up will tell
    try:
        signature.bind(None, stage_index=0, replica=0)
    except TypeError as exc:
        raise fail(f"cannot be called as {_CALL}: {exc} (its signature is {signature})") from None


def _check_class(cls: type, fail: Callable[[str], ConfigError]) -> None:
    if not issubclass(cls, StageBackend):
        raise fail(
            f"names the class {cls.__module__}.{cls.__qualname__}, which is not an "
            "omni_trio.StageBackend subclass"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise fail(f"names the abstract class {cls.__qualname__}: it does not implement {missing}")


def _return_annotation(target: object, fail: Callable[[str], ConfigError]) -> object:
    # a callable object declares its return on __call__; a builtin declares none
    annotated = target
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        annotated = inspect.getattr_static(type(target), "__call__", None)
    if not (inspect.isfunction(annotated) or inspect.ismethod(annotated)):
        raise fail(
            f"names {_kind(target)}, not a backend factory: name an omni_trio.StageBackend "
            "subclass, or a function annotated to return one"
        )
    try:
        hints = typing.get_type_hints(annotated)
    except Exception as exc:
        raise fail(
            f"names {_kind(target)} whose annotations cannot be resolved "
            f"({type(exc).__name__}: {exc}); import the classes they name at run time"
        ) from exc
    if "return" not in hints:
        raise fail(
            f"names {_kind(target)} with no return annotation, so nothing says it builds a "
            "backend: annotate it to return its omni_trio.StageBackend subclass, or name "
            "the subclass itself"
        )
    return hints["return"]


def _kind(obj: object) -> str:
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return f"the function {getattr(obj, '__qualname__', obj)!s}"
    if inspect.ismethod(obj):
        return f"the method {obj.__qualname__}"
    return f"a {type(obj).__name__} object"


def create_backend(
    config: StageConfig, *, stage_index: int, replica: int, source: str | None = None
) -> StageBackend:
    """Build one replica of a stage from its config: a :class:`~.ray.RayBackend` (which
    builds the stage's backend inside a Ray actor) when the stage is placed on Ray.
    ``source`` (the config's file) is named in errors. Raises
    ConfigError/BackendUnavailableError."""
    placement = getattr(config, "placement", None)
    if placement is not None and placement.ray is not None:
        from .ray import RayBackend  # imports no ray: that happens when it starts

        return RayBackend(config, stage_index=stage_index, replica=replica)
    where = f"$.stages[{stage_index}].backend"
    builtin = _BUILTIN.get(config.backend)
    factory: BackendFactory
    if builtin is None:
        factory = resolve_factory(config.backend, where=where, source=source)
    else:
        module_name, attr = builtin
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"stage {config.id!r}: backend {config.backend!r} needs an optional dependency "
                f"({exc.name or exc}); install omni-trio[{config.backend}]"
            ) from exc
        factory = getattr(module, attr)
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
