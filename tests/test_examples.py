"""Every script in examples/ runs as a user runs it (a subprocess of this interpreter, from an
empty directory) and prints what it promises. Scripted stages only: no model is built."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from omni_trio import ConfigError, StageConfig, load_config

from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: a bound for a hung example, not a speed requirement (each one takes about a second)
TIMEOUT_S = 120

#: the runnable examples, each with a test below, and the modules they import
RUNNABLE = {"readme_example.py", "custom_backend.py", "anyio_app.py", "test_my_app.py"}
HELPERS = {"shout_backend.py"}

pytestmark = pytest.mark.slow


def run(args: list[str], cwd: Path) -> str:
    """Run ``python *args`` from ``cwd``; assert exit 0 and return stdout."""
    env = dict(os.environ)
    # the examples run against this checkout, wherever omni-trio is installed from
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = run_bounded([sys.executable, *args], TIMEOUT_S, f"{args} to end", cwd=cwd, env=env)
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


def run_example(name: str, tmp_path: Path) -> list[str]:
    return run([str(EXAMPLES / name)], cwd=tmp_path).splitlines()


def test_every_example_is_run_here() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == RUNNABLE | HELPERS


def test_readme_example(tmp_path: Path) -> None:
    lines = run_example("readme_example.py", tmp_path)
    # "Hello" is bytes 72 101 108 108 111; each scripted stage adds 1 to the token it got
    assert lines[:4] == [
        "talker (74,) 'talker:74 ' False",
        "talker (103,) 'talker:103 ' False",
        "talker (110,) 'talker:110 ' False",
        "talker (110,) 'talker:110 ' True",
    ]
    assert lines[4].startswith("first output of an abandoned request: talker talker:")
    assert "requests in flight: 0" in lines
    assert lines[-1] == (
        "[{'stage': 'thinker', 'replica': 0, 'args': [1]}, "
        "{'stage': 'talker', 'replica': 0, 'args': [1]}]"
    )
    assert list(tmp_path.iterdir()) == []  # it writes nothing


def test_custom_backend(tmp_path: Path) -> None:
    lines = run_example("custom_backend.py", tmp_path)
    shout = [ln for ln in lines if ln.lstrip().startswith("shout:")]
    reverse = [ln for ln in lines if ln.lstrip().startswith("reverse:")]
    assert [ln.split(": ", 1)[1] for ln in shout] == [
        "'STRUCTURED ' finished=False",
        "'CONCURRENCY ' finished=False",
        "'FOR ' finished=False",
        "'INFERENCE' finished=True",
    ]
    # the input processor reversed the words and put its processor_options prefix first
    texts = [re.search(r"'(.*)'", ln).group(1) for ln in reverse]  # type: ignore[union-attr]
    assert "".join(texts) == "ECHO: INFERENCE FOR CONCURRENCY STRUCTURED"
    assert reverse[-1].endswith("finished=True")
    assert "reverse, shout capped at 2 words: 'ECHO: TWO ONE'" in lines
    # 4 + 2 words shouted by the first stage, 5 + 3 by the second
    assert "words shouted per replica: [6, 8]" in lines
    assert lines[-1] == "requests in flight: 0"


def test_custom_backend_rejects_bad_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from shout_backend import ShoutBackend

    backend = "shout_backend:ShoutBackend"
    stage = {"id": "shout", "backend": backend, "final_output": True}
    # the loader checks the Options the backend declares, naming the key
    with pytest.raises(ConfigError, match=r"\$\.stages\[0\]\.options\.delay_s"):
        load_config({"stages": [{**stage, "options": {"delay_s": -1}}]})
    with pytest.raises(ConfigError, match=r"unknown option 'dealy_s'"):
        load_config({"stages": [{**stage, "options": {"dealy_s": 1}}]})
    # and the backend, built from a config that skipped the loader, checks them too
    unchecked = StageConfig(id="shout", backend=backend, options={"delay_s": -1})
    with pytest.raises(ConfigError, match=r"\$\.stages\[3\]\.options\.delay_s"):
        ShoutBackend(unchecked, stage_index=3)


def test_anyio_app(tmp_path: Path) -> None:
    lines = run_example("anyio_app.py", tmp_path)
    assert lines[0] == "async library: trio"
    answers = [ln for ln in lines if ln.startswith("worker-")]
    prompts = sorted(re.match(r"worker-\d: '([^']*)' -> 'talker:", ln).group(1) for ln in answers)  # type: ignore[union-attr]
    assert prompts == sorted(["first question", "second question", "third", "fourth", "fifth"])
    assert {ln.split(":")[0] for ln in answers} <= {"worker-0", "worker-1", "worker-2"}
    assert any(ln.startswith("deadline hit: True") for ln in lines)
    assert lines[-1] == "requests finished: 5, aborted: 1, in flight: 0"


def test_my_app_tests(tmp_path: Path) -> None:
    # a user's own pytest file; -p no:cacheprovider: write nothing into the checkout
    out = run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "test_my_app.py")],
        cwd=ROOT,
    )
    assert re.search(r"\b4 passed\b", out), out
    assert "failed" not in out and "error" not in out.lower(), out
