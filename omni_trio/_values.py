"""Cheaper construction for the frozen value classes made per output or per request.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__(self,
name, value)``, a lookup by name per field: 1.3-1.5 us for a :class:`~omni_trio.outputs.
StageOutput` (six fields), made once per output a backend emits. :func:`direct_init` gives a
frozen, slotted dataclass an ``__init__`` with the same signature that sets each slot through
its descriptor instead (0.4-0.5 us); nothing else about the class changes (it stays frozen:
assigning a field still raises ``FrozenInstanceError``; equality, hashing, ``repr``,
``dataclasses.replace`` and pickling are the dataclass's own).
"""

from __future__ import annotations

import dataclasses
import types
from typing import TypeVar

__all__ = ["direct_init"]

T = TypeVar("T")


class _Factory:
    """The default, in the signature, of a field with a ``default_factory`` (as the
    dataclass's own ``__init__`` shows it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def direct_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of ``cls``, a ``@dataclass(frozen=True, slots=True)`` class,
    with one that sets its slots directly (see the module docstring). Apply it above the
    ``@dataclass`` decorator. Raises ``TypeError`` for a class it cannot serve that way
    (not frozen or not slotted, a ``__post_init__``, keyword-only or ``init=False`` fields)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"direct_init needs a frozen dataclass with slots, not {cls!r}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"direct_init does not call __post_init__ ({cls.__qualname__})")
    namespace: dict[str, object] = {"_FACTORY": _FACTORY}
    args: list[str] = []
    body: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.kw_only:
            raise TypeError(
                f"direct_init takes positional-or-keyword fields only ({cls.__qualname__}.{f.name})"
            )
        name = f.name
        namespace[f"_set_{name}"] = cls.__dict__[name].__set__
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = f.default
            args.append(f"{name}=_default_{name}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{name}"] = f.default_factory
            args.append(f"{name}=_FACTORY")
            body.append(f"    if {name} is _FACTORY:\n        {name} = _factory_{name}()")
        else:
            args.append(name)
        body.append(f"    _set_{name}(self, {name})")
    source = f"def __init__(self, {', '.join(args)}):\n" + "\n".join(body or ["    pass"])
    # the technique of the dataclasses module itself: the function is compiled once, here
    exec(source, namespace)
    init = namespace["__init__"]
    assert isinstance(init, types.FunctionType)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    type.__setattr__(cls, "__init__", init)
    return cls
