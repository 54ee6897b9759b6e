"""The built-in backends, listed once, and what a backend factory named by path must be.

:data:`BUILTIN_BACKENDS` maps each built-in backend's config name (``backend: vllm``) to
where its class lives (a dotted path, imported only when a replica is built), the msgspec
Struct its stage ``options`` are checked with at load, and the package extra that installs
what it needs. A stage with any other ``backend`` names a factory by dotted path
(``"package.module:Factory"``); :func:`check_factory` says whether what that path names
builds a backend, without calling it.

The backend contract (:class:`omni_trio.stages.backend.StageBackend`) lives above the
config: a factory is recognised by the contract class's dotted name in its class's method
resolution order (:data:`BACKEND_CONTRACT`), so that checking a config imports no stage code.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import msgspec

from ..errors import ConfigError
from .options import (
    DiffusionOptions,
    ScriptedOptions,
    TalkerOptions,
    TorchOptions,
    VllmOptions,
)

__all__ = [
    "BACKEND_CONTRACT",
    "BUILTIN_BACKENDS",
    "BuiltinBackend",
    "check_factory",
    "is_backend_class",
]

#: the class every backend derives from, as ``"module:qualname"``
BACKEND_CONTRACT = "omni_trio.stages.backend:StageBackend"
_CALL = "factory(stage_config, stage_index=i, replica=r)"


@dataclass(frozen=True, slots=True)
class BuiltinBackend:
    """One built-in backend: its config name, its class's dotted path, its options' Struct,
    and the extra (``pip install 'omni-trio[<extra>]'``) that installs what it needs."""

    name: str
    factory: str
    options: type[msgspec.Struct]
    extra: str


#: every built-in backend by config name (read-only)
BUILTIN_BACKENDS: Mapping[str, BuiltinBackend] = MappingProxyType(
    {
        b.name: b
        for b in (
            BuiltinBackend(
                "scripted", "omni_trio.backends.scripted:ScriptedBackend", ScriptedOptions, ""
            ),
            BuiltinBackend(
                "vllm", "omni_trio.backends.vllm.backend:VllmBackend", VllmOptions, "vllm"
            ),
            BuiltinBackend(
                "torch", "omni_trio.backends.torch.backend:TorchBackend", TorchOptions, "torch"
            ),
            BuiltinBackend(
                "talker", "omni_trio.backends.talker.backend:TalkerBackend", TalkerOptions, "torch"
            ),
            BuiltinBackend(
                "diffusion",
                "omni_trio.backends.diffusion.backend:DiffusionBackend",
                DiffusionOptions,
                "diffusion",
            ),
        )
    }
)


def is_backend_class(cls: object) -> bool:
    """Whether ``cls`` is a class deriving from the backend contract. Pure."""
    if not isinstance(cls, type):
        return False
    module, _, qualname = BACKEND_CONTRACT.partition(":")
    return any(c.__module__ == module and c.__qualname__ == qualname for c in cls.__mro__)


def check_factory(factory: object, path: str, *, where: str, source: str | None = None) -> None:
    """Check that ``factory`` (what the backend path ``path`` names) builds a backend: a
    class deriving from the backend contract that implements its abstract methods, or any
    other callable (a function, a classmethod, a ``functools.partial``) annotated to return
    such a class. Either way it must accept ``factory(stage_config, stage_index=i,
    replica=r)``. Pure: inspects, calls nothing. Raises :class:`ConfigError` naming
    ``where`` and what the path names instead."""

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"backend {path!r} {reason}", path=where, source=source)

    target = factory
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, type):
        _check_class(target, fail)
    else:
        returned = _return_annotation(target, fail)
        if not is_backend_class(returned):
            shown = getattr(returned, "__name__", None) or repr(returned)
            raise fail(
                f"names {_kind(target)} that returns {shown}, not a StageBackend: a backend "
                "factory is an omni_trio.StageBackend subclass, or a callable annotated to "
                "return one"
            )
    try:
        signature = inspect.signature(typing.cast(Callable[..., object], factory))  # type: ignore[explicit-any]
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the call at start-up will tell
    try:
        signature.bind(None, stage_index=0, replica=0)
    except TypeError as exc:
        raise fail(f"cannot be called as {_CALL}: {exc} (its signature is {signature})") from None


def _check_class(cls: type, fail: Callable[[str], ConfigError]) -> None:
    if not is_backend_class(cls):
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
