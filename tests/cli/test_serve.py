"""``omni-trio serve``: a taken port, SIGTERM/SIGINT with a request in flight (the grace
period), and the tiny-omni pipeline on real vLLM engines leaving no process behind.

As a subprocess (``python -m omni_trio serve``) where a signal is sent; see also
``tests/server/test_serve_cli.py`` (listening before the stages start, stop bounds)."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import wave
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest

from omni_trio.cli.main import main

from ..conftest import EngineWaitTimeout, engine_seconds, kill_processes, process_tree
from .test_main import TWO_STAGES, log_file, one_line_error, pipeline, write

if TYPE_CHECKING:
    import openai


def test_serve_on_a_taken_port_is_a_one_line_runtime_error(tmp_path, capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["serve", pipeline(tmp_path), "--port", str(port)]) == 1
    assert "Address already in use" in one_line_error(capsys.readouterr().err)
    assert main(["serve", pipeline(tmp_path), "--port", "70000"]) == 2


class Server:
    """``omni-trio serve`` in a subprocess; its stdout lines go to a queue."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_LOGGING_LEVEL", None)  # serve's own default (INFO into its log file)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_trio", "serve", *argv, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for_port(self, timeout: float) -> int:
        """The port the server says it serves on, within ``engine_seconds(timeout)``; fails
        at once, with its stderr, if it exits before that."""
        deadline = time.monotonic() + engine_seconds(timeout)
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    err = self.proc.stderr.read() if self.proc.stderr else ""
                    raise AssertionError(
                        f"the server exited ({self.proc.returncode}) before serving\n{err[-3000:]}"
                    ) from None
                continue
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                return int(m.group(1))
        raise EngineWaitTimeout(f"waited {engine_seconds(timeout):g} s for the server's port")

    def kill(self) -> None:
        """SIGKILL the server and everything below it (its EngineCores would outlive it)."""
        if self.proc.poll() is None:
            kill_processes(process_tree(self.proc.pid))
        self.proc.wait()

    def leftovers(self, kids: list[psutil.Process]) -> tuple[str, list[psutil.Process]]:
        """Once the server is gone: its stderr, and which of ``kids`` outlived it (killed now,
        so that a failing stop's processes die with the test)."""
        err = self.proc.stderr.read() if self.proc.stderr else ""
        left = alive(kids)
        kill_processes(left)
        return err, left

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


def stream_chat(port: int, results: dict) -> None:
    body = {"model": "two", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = []
    try:
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    results["started"].set()
    except httpx.HTTPError as exc:
        results["error"] = exc
    results["events"] = events


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "grace", "finishes"),
    [(signal.SIGTERM, "30", True), (signal.SIGINT, "0.2", False)],
    ids=["sigterm-grace-lets-it-finish", "sigint-short-grace-aborts"],
)
def test_serve_stops_on_a_signal_with_a_request_in_flight(tmp_path, sig, grace, finishes):
    # b: 20 outputs x 0.1 s, so the request is in flight when the signal arrives
    text = TWO_STAGES.format(a="", b=", latency_s: 0.1").replace("outputs: 4,", "outputs: 20,")
    config = write(tmp_path, text)
    server = Server([config, "--grace-period", grace, "--log-stats"])
    try:
        port = server.wait_for_port(timeout=60)
        results: dict = {"started": threading.Event()}
        client = threading.Thread(target=stream_chat, args=(port, results))
        client.start()
        assert results["started"].wait(30)
        kids = server.children()
        server.proc.send_signal(sig)
        client.join(engine_seconds(60))
        rc = server.proc.wait(engine_seconds(60))
    finally:
        server.kill()
    stderr = server.proc.stderr.read() if server.proc.stderr else ""
    assert rc == 0, stderr
    assert "Traceback" not in stderr
    assert f"{signal.Signals(sig).name}: stopping" in stderr
    events = results["events"]
    if finishes:
        assert events[-1] == "[DONE]"
        text = "".join(
            c["choices"][0]["delta"].get("content", "")
            for c in map(json.loads, events[:-1])
            if c["choices"]
        )
        assert text.count("b:") == 20  # the whole answer arrived during the grace period
    else:
        # cut off: aborted, and the stream says so before its end
        assert events[-1] == "[DONE]" and len(events) < 22
        assert json.loads(events[-2])["error"]["code"] == "server_shutdown"
    out = "".join(iter_queue(server.lines))
    left = alive(kids)
    kill_processes(left)
    assert "server stopped" in out
    expect = "1 finished, 0 aborted" if finishes else "0 finished, 1 aborted"
    assert f"engine: 1 requests: {expect}, 0 failed, 0 in flight" in out
    assert not left


def openai_client(port: int, timeout: float) -> openai.OpenAI:
    """An OpenAI client of the server on ``port``: no retries, each call bounded by
    ``engine_seconds(timeout)``."""
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="x",
        max_retries=0,
        timeout=engine_seconds(timeout),
    )


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``procs`` still running (zombies count as gone: they hold nothing)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def iter_queue(q: queue.Queue[str]):
    while True:
        try:
            yield q.get(timeout=5)
        except queue.Empty:
            return


@pytest.mark.vllm
def test_serve_tiny_omni_chat_and_speech_then_sigterm_leaves_no_engine_process():

    server = Server(["tiny-omni", "--grace-period", "5"])
    try:
        port = server.wait_for_port(timeout=600)
        kids = server.children()
        assert kids  # vLLM's EngineCore processes
        client = openai_client(port, 120)
        resp = client.chat.completions.create(
            model="tiny-omni", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8
        )
        assert isinstance(resp.choices[0].message.content, str)
        assert resp.usage is not None and 1 <= resp.usage.completion_tokens <= 8
        assert resp.usage.prompt_tokens > 0  # from vLLM's prompt token ids
        chunks = list(
            client.chat.completions.create(
                model="tiny-omni",
                messages=[{"role": "user", "content": "Hi!"}],
                max_tokens=8,
                stream=True,
            )
        )
        assert all(isinstance(c.choices[0].delta.content or "", str) for c in chunks if c.choices)
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/audio/speech",
            json={"model": "tiny-omni", "input": "Say something.", "max_tokens": 4},
            timeout=engine_seconds(120),
        )
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getframerate() == 16_000 and w.getnframes() > 0
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200
        kids = server.children()  # the EngineCores, their workers, the resource tracker
        assert any("resource_tracker" in " ".join(k.cmdline()) for k in kids)
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(engine_seconds(120))
    finally:
        server.kill()
    err, left = server.leftovers(kids)
    assert rc == 0, err[-3000:]
    assert not left  # not even for a moment after the exit: no race to lose
    # vLLM stopped its engines cleanly: nothing killed, nothing left to the resource tracker
    assert "leaked" not in err and "Traceback" not in err
    assert "thinker (vllm) ready in" in err and "code2wav (torch) ready in" in err
    log = log_file(err)
    assert "[shutdown] MPClient: complete" in log
    assert "force killing" not in log and "leaked" not in log
