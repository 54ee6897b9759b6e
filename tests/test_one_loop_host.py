"""One loop host: no module of the package makes an event loop, a thread that runs one, or a
daemon thread, outside ``omni_trio/transport/loop_host.py`` (README, "Layout").

What counts (calls, however imported or aliased): building or running an asyncio loop
(``asyncio.new_event_loop``, ``asyncio.run``, ``asyncio.Runner``, a loop class, a loop's
``run_forever`` / ``run_until_complete``), a portal's thread (anyio's
``start_blocking_portal``), a trio or anyio loop (``trio.run``, ``anyio.run``), and a daemon
thread (``threading.Thread(daemon=...)`` not ``False``, ``thread.daemon = ...``,
``setDaemon``). Exemptions, each with its reason, are :data:`EXEMPT`. The check is a pure
function of a module's source, so a test shows each wrong use caught
(:func:`test_a_wrong_use_is_caught`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "omni_trio"
HOST = "omni_trio/transport/loop_host.py"

#: calls that build or run a loop (or a portal's thread)
LOOPS = frozenset(
    {
        "asyncio.new_event_loop",
        "asyncio.run",
        "asyncio.Runner",
        "asyncio.SelectorEventLoop",
        "asyncio.EventLoop",
        "asyncio.events.new_event_loop",
        "anyio.from_thread.start_blocking_portal",
        "trio.run",
        "anyio.run",
    }
)
#: method names that run a loop whatever it is called
RUNS = frozenset({"run_forever", "run_until_complete"})
DAEMON = "daemon thread"

#: (module, what) -> why it may
EXEMPT: dict[tuple[str, str], str] = {
    ("omni_trio/backends/vllm/parent_watch.py", DAEMON): (
        "it runs in an EngineCore process and waits on its parent's pidfd for the life of "
        "that process: nothing stops it, it ends with the process (a non-daemon thread "
        "would keep a finished EngineCore alive)"
    ),
    ("omni_trio/cli/commands.py", "trio.run"): "the program's own loop, in the main thread",
    ("omni_trio/cli/serve.py", "trio.run"): "the server's own loop, in the main thread",
}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from the module's imports (any depth)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _not_false(value: ast.expr) -> bool:
    return not (isinstance(value, ast.Constant) and value.value is False)


def violations(source: str) -> list[tuple[int, str]]:
    """(line, what) of every loop or daemon thread ``source`` makes. Pure."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            if name in LOOPS:
                found.append((node.lineno, name))
            elif isinstance(node.func, ast.Attribute) and node.func.attr in RUNS:
                found.append((node.lineno, f"loop.{node.func.attr}"))
            elif name == "threading.Thread" and any(
                k.arg == "daemon" and _not_false(k.value) for k in node.keywords
            ):
                found.append((node.lineno, DAEMON))
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "setDaemon":
                found.append((node.lineno, DAEMON))
        elif isinstance(node, ast.Assign):
            if _not_false(node.value) and any(
                isinstance(t, ast.Attribute) and t.attr == "daemon" for t in node.targets
            ):
                found.append((node.lineno, DAEMON))
    return found


def wrong_uses(sources: dict[str, str]) -> list[str]:
    """``module:line: what`` of every use the rule forbids in ``sources`` (module path ->
    source). Pure."""
    wrong = []
    for module, source in sorted(sources.items()):
        if module == HOST:
            continue
        for line, what in violations(source):
            if (module, what) not in EXEMPT:
                wrong.append(f"{module}:{line}: {what}")
    return wrong


def package_sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in PKG.rglob("*.py")}


def test_no_module_hosts_a_loop_or_a_daemon_thread_outside_the_loop_host() -> None:
    assert wrong_uses(package_sources()) == []


def test_every_exemption_is_still_needed() -> None:
    # an exemption whose use went away is removed, not left to cover a new one
    for module, what in EXEMPT:
        assert what in [w for _, w in violations((ROOT / module).read_text())], (module, what)


WRONG = {
    "new_event_loop": "import asyncio\nloop = asyncio.new_event_loop()\n",
    "aliased run": "import asyncio as aio\naio.run(main())\n",
    "imported run": "from asyncio import run as go\ngo(main())\n",
    "runner": "import asyncio\nwith asyncio.Runner() as r:\n    pass\n",
    "loop class": "import asyncio\nloop = asyncio.SelectorEventLoop()\n",
    "run_forever": "def f(loop):\n    loop.run_forever()\n",
    "run_until_complete": "def f(loop):\n    loop.run_until_complete(g())\n",
    "portal": (
        "def f():\n    from anyio.from_thread import start_blocking_portal\n"
        "    with start_blocking_portal('trio') as p:\n        pass\n"
    ),
    "trio.run": "import trio\ntrio.run(main)\n",
    "daemon keyword": "import threading\nthreading.Thread(target=f, daemon=True).start()\n",
    "daemon from import": "from threading import Thread\nThread(target=f, daemon=flag)\n",
    "daemon attribute": "import threading\nt = threading.Thread(target=f)\nt.daemon = True\n",
    "setDaemon": "import threading\nt = threading.Thread(target=f)\nt.setDaemon(True)\n",
}


@pytest.mark.parametrize("source", WRONG.values(), ids=WRONG.keys())
def test_a_wrong_use_is_caught(source: str) -> None:
    assert len(violations(source)) == 1


def test_what_is_not_a_loop_or_a_daemon_passes() -> None:
    fine = (
        "import threading, asyncio\n"
        "threading.Thread(target=f, name='x').start()\n"
        "threading.Thread(target=f, daemon=False)\n"
        "asyncio.get_running_loop().call_soon(f)\n"
        "runner.run(x)\n"
    )
    assert violations(fine) == []


def test_an_exemption_is_for_its_module_and_its_use_only() -> None:
    # parent_watch may make a daemon thread, not a loop; no other module may make either;
    # the loop host itself may
    sources = package_sources()
    watch = "omni_trio/backends/vllm/parent_watch.py"
    sources[watch] += "\nimport asyncio\nasyncio.new_event_loop()\n"
    sources["omni_trio/sync.py"] += "\nimport threading\nthreading.Thread(daemon=True)\n"
    sources[HOST] += "\nimport threading\nthreading.Thread(daemon=True)\n"
    wrong = wrong_uses(sources)
    assert [w.split(":")[0] + ": " + w.split(": ")[-1] for w in wrong] == [
        f"{watch}: asyncio.new_event_loop",
        f"omni_trio/sync.py: {DAEMON}",
    ]
