"""Every script in examples/ runs as a user runs it (a subprocess of this interpreter, from an
empty directory) and prints what it promises. Scripted stages, but for the realtime client:
it talks to a real ``omni-trio serve tiny-omni`` (marked ``vllm``)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
import pytest

from omni_trio import ConfigError, StageConfig, load_config

from .cli.test_serve import Server
from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: a bound for a hung example, not a speed requirement (each one takes about a second)
TIMEOUT_S = 120

#: the runnable examples, each with a test below, and the modules they import
RUNNABLE = {
    "readme_example.py",
    "custom_backend.py",
    "anyio_app.py",
    "test_my_app.py",
    "realtime_client.py",
}
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


def run_example(name: str, tmp_path: Path, *args: str) -> list[str]:
    return run([str(EXAMPLES / name), *args], cwd=tmp_path).splitlines()


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


@pytest.mark.vllm  # a real tiny-omni server: two vLLM engines and the vocoder
def test_realtime_client(tmp_path: Path) -> None:
    server = Server(["tiny-omni"])
    try:
        port = server.wait_for_port(timeout=600)  # printed once every stage is ready
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        lines = run_example("realtime_client.py", tmp_path, url)
    finally:
        server.kill()
    said = dict(ln.split(": ", 1) for ln in lines)

    def parse(key: str, pattern: str) -> tuple[str, ...]:
        m = re.fullmatch(pattern, said[key])
        assert m is not None, f"{key}: {said[key]!r}"
        return m.groups()

    (session_id,) = parse("session", r"(\w+), audio out PCM16 at 16000 Hz")
    # a text turn: text (gibberish: random weights) and audio, then completed
    assert said["turn 1 text"] not in ("''", '""')
    nbytes, samples = map(int, parse("turn 1 audio", r"(\d+) bytes \((\d+) samples\)"))
    assert nbytes == 2 * samples > 0
    assert said["turn 1 response"] == "completed"
    assert said["turn 2 barge-in"] == "response cancelled"
    # the socket dropped mid-response; the resume replayed what came after the last seq
    (last,) = parse("turn 3 socket closed", r"after server event (\d+)")
    replay = r"session (\w+), (\d+) events replayed \(server events (\d+) to (\d+)\)"
    resumed, n, first, final = parse("turn 3 resumed", replay)
    assert resumed == session_id and int(n) > 0
    assert int(last) < int(first) <= int(final)
    # all the response's audio (the talker makes as many codes each turn): nothing lost
    assert said["turn 3 audio"] == said["turn 1 audio"]
    assert said["turn 3 response"] == "completed"
    assert said["session closed"] == "closed"  # ended, not left detached
    assert list(tmp_path.iterdir()) == []  # it writes nothing
