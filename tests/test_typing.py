"""The package's core states its types: few explicit ``Any`` outside its edges, counted here.

mypy (``disallow_any_explicit`` in pyproject.toml, run by ``make lint``) refuses an explicit
``Any`` in the core unless its line is marked ``# type: ignore[explicit-any]``; this test caps
how many there are. The edges (server, CLI, models, testing, pipelines, the backends) meet
untyped worlds and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import omni_trio

PACKAGE = Path(omni_trio.__file__).parent
EDGES = frozenset({"server", "cli", "models", "testing", "pipelines", "backends"})
MAX_EXPLICIT_ANY = 15


def explicit_any_lines(source: str) -> list[int]:
    """The lines of ``source`` that spell out ``Any``, as mypy's ``explicit-any`` means it:
    the name ``Any`` (or ``typing.Any``) outside imports, and ``Callable[..., R]`` (its
    arguments are Any). Pure."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "Any":
            lines.add(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            lines.add(node.lineno)
        elif isinstance(node, ast.Subscript) and _names(node.value, "Callable"):
            params = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else None
            if isinstance(params, ast.Constant) and params.value is Ellipsis:
                lines.add(node.lineno)
    return sorted(lines)


def _names(node: ast.expr, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (
        isinstance(node, ast.Attribute) and node.attr == name
    )


def core_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in EDGES
    ]


def test_the_core_has_at_most_15_explicit_any() -> None:
    found = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path in core_modules()
        if (lines := explicit_any_lines(path.read_text(encoding="utf-8")))
    }
    total = sum(len(lines) for lines in found.values())
    assert total <= MAX_EXPLICIT_ANY, f"{total} explicit Any in the core: {found}"


def test_an_added_explicit_any_is_counted() -> None:
    source = "from typing import Any\nimport typing\n\nx: int = 1\n"
    assert explicit_any_lines(source) == []  # the import alone is not a use
    assert explicit_any_lines(source + "def f(a: Any) -> None: ...\n") == [5]
    assert explicit_any_lines(source + "y: list[typing.Any] = []\n") == [5]
    assert explicit_any_lines(source + "F = Callable[..., int]\n") == [5]
    assert explicit_any_lines(source + "G = Callable[[int], int]\n") == []
    assert explicit_any_lines(source + "z: dict[str, Any] = {}  # Any again: one line\n") == [5]


def test_the_counted_tree_is_the_core() -> None:
    counted = {path.relative_to(PACKAGE).as_posix() for path in core_modules()}
    assert "outputs.py" in counted and "transport/codec.py" in counted
    assert "sync.py" in counted and "transport/loop_host.py" in counted
    assert not any(path.split("/")[0] in EDGES for path in counted)
