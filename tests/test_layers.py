"""The package's floors, enforced: every import (type-only and lazy ones too) goes down.

The rules (README, "Layout"):

- floor 0, the top-level value modules (``errors``, ``outputs``, ``context``...), import only
  floor 0;
- ``config/``, ``models/`` and ``pipelines/`` import only floor 0 (and themselves);
- ``transport/`` knows no stage, request or config: floor 0 only;
- ``stages/`` (the backend contract, pools) never imports a backend, ``request/`` or
  ``engine/``;
- each backend (``backends/<name>``) never imports another backend, ``request/`` or
  ``engine/``;
- ``request/`` never imports ``engine/`` or a backend; ``engine/`` never imports a backend;
- only ``cli/`` imports ``server/``; nothing in the package imports ``benchmarks``;
- ``vllm``, ``torch``, ``ray`` and ``diffusers`` are imported only by their backend
  (``config/vllm_fields`` reads vLLM's field list; ``models/`` are torch modules and
  diffusers pipelines); ``opentelemetry`` only by ``telemetry/`` (below ``engine/``,
  above floor 0 and ``config/``);
- across packages, only public modules: never another package's ``_x`` module.

Each rule is a pure function of the import graph, so a test can show that a wrong import is
caught (:func:`test_a_wrong_import_is_caught`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "omni_trio"

#: the floors, lowest first: a module may import its own room and the rooms listed below it
#: in ``ALLOWED``
FLOOR0 = "floor0"
ALLOWED: dict[str, frozenset[str]] = {
    FLOOR0: frozenset(),
    "config": frozenset({FLOOR0}),
    "models": frozenset({FLOOR0}),
    "pipelines": frozenset({FLOOR0}),
    "transport": frozenset({FLOOR0}),
    "stages": frozenset({FLOOR0, "config", "transport"}),
    "telemetry": frozenset({FLOOR0, "config"}),
    "backends.scripted": frozenset({FLOOR0, "config", "transport", "stages"}),
    "backends.torch": frozenset({FLOOR0, "config", "transport", "stages", "models"}),
    "backends.vllm": frozenset({FLOOR0, "config", "transport", "stages", "models"}),
    "backends.ray": frozenset({FLOOR0, "config", "transport", "stages"}),
    "backends.talker": frozenset({FLOOR0, "config", "transport", "stages", "models"}),
    "backends.diffusion": frozenset({FLOOR0, "config", "transport", "stages", "models"}),
    "backends": frozenset(),
    "request": frozenset({FLOOR0, "config", "transport", "stages"}),
    "engine": frozenset({FLOOR0, "config", "transport", "stages", "request", "telemetry"}),
    "server": frozenset(
        {FLOOR0, "config", "transport", "stages", "request", "engine", "telemetry"}
    ),
    "testing": frozenset(
        {FLOOR0, "config", "transport", "stages", "request", "engine", "backends.scripted"}
    ),
    "sync": frozenset({FLOOR0, "config", "transport", "engine"}),
    "cli": frozenset(
        {
            "top",
            FLOOR0,
            "config",
            "models",
            "pipelines",
            "transport",
            "stages",
            "request",
            "engine",
            "server",
            "telemetry",
        }
    ),
    "top": frozenset({FLOOR0, "config", "transport", "stages", "request", "engine", "cli", "sync"}),
}
#: third-party libraries only some rooms may import
HEAVY: dict[str, frozenset[str]] = {
    "vllm": frozenset({"backends.vllm", "config"}),
    "torch": frozenset({"backends.torch", "backends.talker", "backends.vllm", "models"}),
    "ray": frozenset({"backends.ray"}),
    "diffusers": frozenset({"models", "backends.diffusion"}),
    "opentelemetry": frozenset({"telemetry"}),
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module
    imported: str  # dotted module (inside the package) or a top-level library name
    line: int


def room_of(module: str) -> str:
    """The room a package module lives in. Pure."""
    parts = module.split(".")
    if parts == [PKG] or parts[1:] == ["__main__"]:
        return "top"
    if len(parts) == 2 and not (ROOT / PKG / parts[1] / "__init__.py").exists():
        return "sync" if parts[1] == "sync" else FLOOR0
    if parts[1] == "backends":
        return "backends" if len(parts) == 3 and parts[2] == "__init__" else ".".join(parts[1:3])
    return parts[1]


def package_of(module: str, is_pkg: bool) -> str:
    return module if is_pkg else module.rpartition(".")[0]


def imports_of(path: Path, module: str, is_pkg: bool) -> list[Import]:
    """Every import in a source file: top-level, lazy (inside functions) and type-only."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(module, is_pkg).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append(Import(module, sub if is_module(sub) else target, node.lineno))
    return found


def is_module(dotted: str) -> bool:
    base = ROOT / dotted.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def package_imports(root: Path = ROOT) -> list[Import]:
    found: list[Import] = []
    for path in sorted((root / PKG).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_pkg else parts)
        found += imports_of(path, module, is_pkg)
    return found


def violations(imports: Iterable[Import]) -> list[str]:
    """Every import that breaks a floor rule, as a readable line. Pure."""
    out: list[str] = []
    for imp in imports:
        room = room_of(imp.importer)
        where = f"{imp.importer}:{imp.line} imports {imp.imported}"
        top = imp.imported.split(".")[0]
        if top == "benchmarks":
            out.append(f"{where}: nothing in the package imports benchmarks")
            continue
        if top in HEAVY:
            if room not in HEAVY[top]:
                out.append(f"{where}: only {sorted(HEAVY[top])} may import {top}")
            continue
        if top != PKG:
            continue
        target_room = room_of(imp.imported)
        if target_room != room and target_room not in ALLOWED[room]:
            out.append(f"{where}: {room} may not import {target_room}")
        if target_room != room and any(
            part.startswith("_") and not part.startswith("__")
            for part in imp.imported.split(".")[1:]
        ):
            out.append(f"{where}: a private module of another room")
    return out


def cycles(imports: Iterable[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). Pure."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.imported.startswith(PKG + ".") or imp.imported == PKG:
            graph.setdefault(imp.importer, set()).add(imp.imported)
            graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles_without_package_inits(imports: Iterable[Import]) -> list[list[str]]:
    # a package's __init__ re-exports its own modules for users; the modules never import it
    return cycles(
        imp
        for imp in imports
        if not (room_of(imp.importer) == "top" and imp.imported.startswith(PKG + "."))
    )


IMPORTS = package_imports()


def test_the_package_has_no_upward_import() -> None:
    assert violations(IMPORTS) == []


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(IMPORTS) == []


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("omni_trio.errors", "omni_trio.config.stage", "floor0 may not import config"),
        ("omni_trio.config.stage", "omni_trio.stages.backend", "config may not import stages"),
        ("omni_trio.transport.codec", "omni_trio.stages.backend", "transport may not import"),
        ("omni_trio.stages.pool", "omni_trio.backends.vllm.backend", "stages may not import"),
        ("omni_trio.stages.pool", "omni_trio.request.state", "stages may not import request"),
        ("omni_trio.backends.ray.backend", "omni_trio.backends.vllm.backend", "may not import"),
        ("omni_trio.backends.vllm.backend", "omni_trio.engine.engine", "may not import engine"),
        ("omni_trio.request.run", "omni_trio.engine.orchestrator", "request may not import"),
        ("omni_trio.engine.engine", "omni_trio.server.app", "engine may not import server"),
        ("omni_trio.server.app", "omni_trio.cli.main", "server may not import cli"),
        ("omni_trio.engine.engine", "benchmarks", "nothing in the package imports benchmarks"),
        ("omni_trio.stages.pool", "vllm", "may import vllm"),
        ("omni_trio.request.run", "torch", "may import torch"),
        ("omni_trio.stages.pool", "ray", "may import ray"),
        ("omni_trio.engine.engine", "omni_trio.stages._request_table", "a private module"),
    ],
)
def test_a_wrong_import_is_caught(importer: str, imported: str, rule: str) -> None:
    wrong = Import(importer, imported, 1)
    assert violations(IMPORTS) == []
    found = violations([*IMPORTS, wrong])
    assert len(found) == 1 and rule in found[0], found


def test_a_cycle_is_caught() -> None:
    back = Import("omni_trio.errors", "omni_trio.outputs", 1)
    forward = Import("omni_trio.outputs", "omni_trio.errors", 1)
    assert [["omni_trio.errors", "omni_trio.outputs"]] in [cycles([back, forward])]


def test_every_room_has_a_rule() -> None:
    rooms = {room_of(imp.importer) for imp in IMPORTS}
    assert rooms <= set(ALLOWED), rooms - set(ALLOWED)
