"""The public surface: what each public namespace exports is what the README lists, every
name imports, and no test, example or benchmark reaches into another package's private
(``_x``) module."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_namespaces() -> dict[str, set[str]]:
    """Each namespace the README's Public API section lists, with the names it gives. Pure."""
    section = README[README.index("## Public API") : README.index("## Changes")]
    listed: dict[str, set[str]] = {}
    for item in re.split(r"\n- ", section)[1:]:
        namespace = re.match(r"`([\w.]+)`", item)
        assert namespace, item
        _, _, names = item.partition("):")
        listed[namespace.group(1)] = set(re.findall(r"`(\w+)`", names))
    return listed


LISTED = readme_namespaces()


def test_the_readme_lists_the_public_namespaces() -> None:
    assert set(LISTED) >= {
        "omni_trio",
        "omni_trio.stages",
        "omni_trio.testing",
        "omni_trio.sync",
        "omni_trio.server",
        "omni_trio.config",
    }


@pytest.mark.parametrize("namespace", sorted(LISTED))
def test_a_namespace_exports_what_the_readme_lists_and_each_name_imports(namespace: str) -> None:
    module = importlib.import_module(namespace)
    assert set(module.__all__) == LISTED[namespace]
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def test_the_stages_namespace_holds_the_whole_backend_contract() -> None:
    stages = importlib.import_module("omni_trio.stages")
    contract = {"StageBackend", "Emit", "Emitter", "InputStream", "StageAborted"}
    assert contract | {"collect_input", "merge_inputs"} <= set(stages.__all__)


def imported_modules(path: Path) -> Iterator[tuple[str, int]]:
    """Every absolute ``omni_trio`` module (or name) a file imports, lazy ones too. Pure."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def private_reaches(root: Path) -> list[str]:
    """Imports of another package's ``_x`` module (or ``_x`` name) by tests, examples and
    benchmarks. A test may reach into the package it mirrors (``tests/stages/`` into
    ``omni_trio.stages``). Pure (reads files)."""
    found: list[str] = []
    for top in ("tests", "examples", "benchmarks"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            home = ".".join(["omni_trio", *rel.parts[1:-1]]) if top == "tests" else None
            for module, line in sorted(set(imported_modules(path))):
                parts = module.split(".")
                private = [i for i, p in enumerate(parts) if p.startswith("_") and p[1:2] != "_"]
                if parts[0] != "omni_trio" or not private:
                    continue
                owner = ".".join(parts[: private[0]])
                if home is not None and (owner == home or owner.startswith(home + ".")):
                    continue
                found.append(f"{rel}:{line} imports {module}")
    return found


def test_no_test_example_or_benchmark_imports_another_packages_private_module() -> None:
    assert private_reaches(ROOT) == []


def test_a_reach_into_another_packages_private_module_is_caught(tmp_path: Path) -> None:
    (tmp_path / "tests" / "request").mkdir(parents=True)
    (tmp_path / "examples").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tests" / "request" / "test_x.py").write_text(
        "from omni_trio.request._own import x\n"  # its own package: allowed
        "def f():\n    from omni_trio.stages._running import RunningRequest\n"
    )
    (tmp_path / "examples" / "app.py").write_text("import omni_trio.transport._bridge_core\n")
    assert private_reaches(tmp_path) == [
        "tests/request/test_x.py:3 imports omni_trio.stages._running",
        "tests/request/test_x.py:3 imports omni_trio.stages._running.RunningRequest",
        "examples/app.py:1 imports omni_trio.transport._bridge_core",
    ]
