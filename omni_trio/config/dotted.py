"""Resolving ``"package.module:attribute"`` paths from a config (backends, processors, factories).

One place for the rules, so every dotted path fails the same way: a :class:`ConfigError` that
names the config path and says what is wrong (malformed, relative, cannot be imported, no such
attribute, not callable), never a ``TypeError`` or ``ImportError`` from importlib.
"""

from __future__ import annotations

import importlib
import re

from ..errors import BackendUnavailableError, ConfigError

__all__ = ["DOTTED_PATTERN", "import_dotted", "is_dotted"]

#: an absolute module path, a colon, an attribute path (``pkg.mod:Class.factory``)
DOTTED_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"
_DOTTED_RE = re.compile(DOTTED_PATTERN)


def is_dotted(path: str) -> bool:
    """Whether ``path`` has the ``package.module:attribute`` form (absolute). Pure."""
    return _DOTTED_RE.match(path) is not None


def import_dotted(path: str, *, what: str, where: str, source: str | None = None) -> object:
    """Import ``"package.module:attribute"`` and return the attribute, which must be callable.

    Blocking (imports the module). Raises :class:`ConfigError` naming ``where``;
    :class:`BackendUnavailableError` raised by the imported module (a missing optional
    dependency) passes through unchanged.
    """
    if not is_dotted(path):
        hint = " (relative module paths are not allowed)" if path.startswith(".") else ""
        raise ConfigError(
            f"{what} must be 'package.module:function' (an absolute module path), "
            f"got {path!r}{hint}",
            path=where,
            source=source,
        )
    module_name, _, attr = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except BackendUnavailableError:
        raise
    except ImportError as exc:
        raise ConfigError(
            f"cannot import {what} module {module_name!r}: {exc}", path=where, source=source
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"importing {what} module {module_name!r} raised {type(exc).__name__}: {exc}",
            path=where,
            source=source,
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{what} {path!r}: {module_name!r} has no {attr!r}", path=where, source=source
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"{what} {path!r}: {module_name!r} has no callable {attr!r} "
            f"(it is a {type(obj).__name__})",
            path=where,
            source=source,
        )
    return obj
