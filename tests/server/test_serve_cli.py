"""``omni-trio serve`` as a real process: it listens before its stages start (a taken port
fails at once, ``/health`` says ``starting``), and stops on SIGTERM within the grace period
plus a small bound even while a client never reads; a second signal stops it at once."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from omni_trio.cli.main import main

STREAMING = """\
name: one
stages:
  - id: a
    backend: scripted
    final_output: true
    options: {{outputs: 100000000{a}}}
"""
BOUND_S = 20.0  # what "a small bound" may take on a loaded 2-core machine, engine stop included


def pipeline(tmp_path: Path, a: str = "") -> str:
    path = tmp_path / "one.yaml"
    path.write_text(STREAMING.format(a=a))
    return str(path)


class Serve:
    """``omni-trio serve`` in a subprocess; stdout and stderr lines go to queues."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_trio", "serve", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        for pipe, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(pipe, q), daemon=True).start()

    @staticmethod
    def _pump(pipe, q: queue.Queue[str]) -> None:
        for line in pipe:
            q.put(line)

    def wait_line(self, q: queue.Queue[str], pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            line = q.get(timeout=max(0.01, deadline - time.monotonic()))
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m

    def rest(self, q: queue.Queue[str]) -> str:
        lines = []
        while True:
            try:
                lines.append(q.get(timeout=2))
            except queue.Empty:
                return "".join(self.seen + lines)

    def assert_stopped_now(self, rc: int) -> None:
        """The process exited 0 on a signal that said "stopping now", without a traceback."""
        err = self.rest(self.err)
        assert rc == 0, err
        assert "SIGTERM: stopping now" in err
        assert "Traceback" not in err

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def never_reading_stream(port: int) -> socket.socket:
    """Start a streamed completion whose first event (the echoed 8 MiB prompt) is larger
    than the kernel buffers can ever hold (4 MiB at most here), read its first byte, then
    never read again: the server's write of that event blocks for good."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.settimeout(30)
    client.connect(("127.0.0.1", port))
    request = {"model": "one", "prompt": "x" * 2**23, "stream": True, "echo": True}
    body = json.dumps(request).encode()
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert client.recv(1) == b"H"  # the status line: admitted and streaming
    return client


@pytest.mark.slow
def test_sigterm_stops_within_grace_plus_a_bound_while_a_client_never_reads(tmp_path):
    grace = 2.0
    server = Serve([pipeline(tmp_path), "--port", "0", "--grace-period", str(grace)])
    try:
        port = int(server.wait_line(server.out, r"serving .* on http://127\.0\.0\.1:(\d+)")[1])
        client = never_reading_stream(port)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(grace + BOUND_S)
        elapsed = time.monotonic() - t0
        client.close()
    finally:
        server.stop()
    err = server.rest(server.err)
    assert rc == 0, err
    assert "Traceback" not in err
    # the write was blocked when the grace period ended; its connection was abandoned
    assert "closed 1 connection(s) still open" in err, err
    assert elapsed >= grace
    assert "server stopped" in server.rest(server.out)


@pytest.mark.slow
def test_a_second_signal_stops_at_once_despite_a_long_grace_period(tmp_path):
    server = Serve([pipeline(tmp_path), "--port", "0", "--grace-period", "600"])
    try:
        port = int(server.wait_line(server.out, r"serving .* on http://127\.0\.0\.1:(\d+)")[1])
        client = never_reading_stream(port)
        server.proc.send_signal(signal.SIGTERM)
        server.wait_line(server.err, r"SIGTERM: stopping; in-flight requests get 600")
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(BOUND_S)
        client.close()
    finally:
        server.stop()
    server.assert_stopped_now(rc)


@pytest.mark.slow
def test_a_taken_port_fails_at_once_naming_the_address(tmp_path):
    # the stage would take an hour to start: only binding first can fail fast
    config = pipeline(tmp_path, a=", start_delay_s: 3600")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "omni_trio", "serve", config, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("omni-trio: error: ServerBindError: ")
    assert "Traceback" not in proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0]
    assert "Address already in use" in lines[0]
    assert "listening at" not in proc.stdout


@pytest.mark.slow
def test_health_says_starting_while_stages_start_and_a_signal_then_stops_at_once(tmp_path):
    server = Serve([pipeline(tmp_path, a=", start_delay_s: 3600"), "--port", "0"])
    try:
        m = server.wait_line(server.out, r"listening at http://127\.0\.0\.1:(\d+); starting 1")
        base = f"http://127.0.0.1:{m[1]}"
        r = httpx.get(base + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "starting"
        body = {"model": "one", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "starting"
        # one access line per request on stderr, at INFO, by default
        line = server.wait_line(server.err, r"GET /health 503 request_id=(\w+) [\d.]+ms")
        assert line[0].startswith("GET")
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(BOUND_S)
    finally:
        server.stop()
    server.assert_stopped_now(rc)


def test_max_body_bytes_must_be_positive(tmp_path, capsys):
    assert main(["serve", pipeline(tmp_path), "--max-body-bytes", "0"]) == 2
    assert "--max-body-bytes must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_stop_that_overruns_is_reported_and_a_signal_still_exits_0(tmp_path):
    path = tmp_path / "slow-stop.yaml"
    path.write_text(
        "name: one\nshutdown_timeout: 0.5\nstages:\n  - id: a\n    final_output: true\n"
        "    options: {stop_delay_s: 3600}\n"
    )
    server = Serve([str(path), "--port", "0", "--grace-period", "0"])
    try:
        server.wait_line(server.out, r"serving .* on http://127\.0\.0\.1:(\d+)")
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(BOUND_S)
    finally:
        server.stop()
    err = server.rest(server.err)
    assert rc == 0, err
    assert "warning: 1 replica(s) did not stop cleanly: a[0]: TooSlowError" in err
    assert "Traceback" not in err
