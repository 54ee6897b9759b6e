"""The ``omni-trio`` command: each command's happy path, its errors and exit codes.

In-process through ``main(argv)`` where possible, as a subprocess (``python -m omni_trio``)
for what needs a real process: the entry module, and ``serve`` under SIGTERM/SIGINT."""

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
import wave
from pathlib import Path

import httpx
import psutil
import pytest

import omni_trio
from omni_trio.cli import build_parser, main
from omni_trio.testing import scripted_tokens

TWO_STAGES = """\
name: two
stages:
  - id: a
    backend: scripted
    options: {{outputs: 3{a}}}
  - id: b
    backend: scripted
    inputs: [a]
    final_output: true
    options: {{outputs: 4{b}}}
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def pipeline(tmp_path: Path, a: str = "", b: str = "") -> str:
    return write(tmp_path, TWO_STAGES.format(a=a, b=b))


LOG_NOTE = "omni-trio: vLLM, torch and transformers output goes to "


def one_line_error(err: str) -> str:
    # the log file's note and the start-up lines (commands that start engines) come first
    lines = [
        line for line in err.splitlines() if line.strip() and not line.startswith((LOG_NOTE, "✓ "))
    ]
    assert len(lines) == 1, err
    assert lines[0].startswith("omni-trio: error: ")
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", ["demo", "run", "serve", "validate", "bench"])
def test_help_of_every_command(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"omni-trio {command}" in out and "--debug" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"omni-trio {omni_trio.__version__}"


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert main(["run", "x.yaml"]) == 2  # --prompt is required
    assert "--prompt" in capsys.readouterr().err


def test_validate_ok_bad_and_missing(tmp_path, capsys):
    assert main(["validate", pipeline(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "pipeline 'two', 2 stages" in out

    bad = write(tmp_path, "name: bad\nstages:\n  - id: a\n    inputs: [zz]\n", "bad.yaml")
    assert main(["validate", bad]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "bad.yaml: $.stages[0].inputs[0]: unknown input stage 'zz'" in line

    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "nope.yaml" in line and "tiny-omni" in line  # names the shipped pipelines

    assert main(["validate", "tiny-omni-scripted"]) == 0  # a shipped pipeline by name
    assert "pipeline 'tiny-omni-scripted', 3 stages" in capsys.readouterr().out


def test_run_streams_text_and_logs_stats(tmp_path, capsys):
    rc = main(["run", pipeline(tmp_path), "--prompt", "hi", "--prompt", "yo", "--log-stats"])
    assert rc == 0
    out, err = capsys.readouterr()
    for prompt in ("hi", "yo"):
        tokens = scripted_tokens(scripted_tokens(list(prompt.encode()), 3), 4)
        assert "".join(f"b:{t} " for t in tokens) in out
    assert "start-up timeline" in out and "replica 0: start" in out
    assert "engine: 2 requests: 2 finished, 0 aborted, 0 failed, 0 in flight" in out
    assert "per-stage timing" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("omni-trio run: 2 prompt(s) through 'two' (a -> b); no audio")
    assert "a (scripted) ready in" in err and "b (scripted) ready in" in err  # the display
    log = Path(err.split(LOG_NOTE)[1].split()[0])
    assert not log.exists()  # scripted stages say nothing: no log file is left behind


def test_verbose_keeps_everything_on_the_terminal(tmp_path, capsys):
    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--verbose"]) == 0
    assert LOG_NOTE not in capsys.readouterr().err


def test_run_errors(tmp_path, capsys):
    failing = pipeline(tmp_path, b=", fail_at_output: 1")
    assert main(["run", failing, "--prompt", "hi"]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert "StageError" in line and "fail at output 1" in line

    assert main(["run", failing, "--prompt", "hi", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err

    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in one_line_error(capsys.readouterr().err)

    broken = write(tmp_path, "name: x\nstages: 3\n", "broken.yaml")
    assert main(["run", broken, "--prompt", "hi"]) == 2
    assert "broken.yaml: $.stages" in one_line_error(capsys.readouterr().err)


@pytest.mark.slow
def test_run_writes_a_wav_per_prompt_from_the_audio_stage(tmp_path, capsys):
    out_dir = tmp_path / "wavs"
    argv = ["run", "tiny-omni-scripted", "--prompt", "a b", "--prompt", "c"]
    assert main([*argv, "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "thinker:" in out
    for n in (1, 2):
        with wave.open(str(out_dir / f"prompt-{n}.wav")) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
            assert w.getnframes() == 64 * 160  # 64 talker codes x the vocoder's hop
        assert f"wrote {out_dir / f'prompt-{n}.wav'}" in out


def test_bench_runs_scripts_and_forwards_args(tmp_path, capfd):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "bench_echo.py").write_text(
        "import json, sys\nprint(json.dumps({'argv': sys.argv[1:]}))\n"
    )
    (bench / "bench_fail.py").write_text("import sys\nsys.exit(3)\n")
    assert main(["bench", "--dir", str(bench), "--only", "echo", "--", "--quick", "7"]) == 0
    out = capfd.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == {"argv": ["--quick", "7"]}
    assert main(["bench", "--dir", str(bench)]) == 1
    assert "bench_fail.py (exit 3)" in capfd.readouterr().err
    assert main(["bench", "--dir", str(bench), "--only", "nope"]) == 2
    assert "no such benchmark(s): bench_nope.py" in capfd.readouterr().err


def test_python_dash_m_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "omni_trio", "validate", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    one_line_error(proc.stderr)


def test_serve_on_a_taken_port_is_a_one_line_runtime_error(tmp_path, capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["serve", pipeline(tmp_path), "--port", str(port)]) == 1
    assert "Address already in use" in one_line_error(capsys.readouterr().err)
    assert main(["serve", pipeline(tmp_path), "--port", "70000"]) == 2


# -- serve under a signal ----------------------------------------------------------------------


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
        while True:
            line = self.lines.get(timeout=timeout)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                return int(m.group(1))

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
        client.join(60)
        rc = server.proc.wait(60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
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
    assert "server stopped" in out
    expect = "1 finished, 0 aborted" if finishes else "0 finished, 1 aborted"
    assert f"engine: 1 requests: {expect}, 0 failed, 0 in flight" in out
    assert not alive(kids)


def log_file(err: str) -> str:
    """The text of the log file that a command's stderr names."""
    line = next(line for line in err.splitlines() if line.startswith(LOG_NOTE))
    return Path(line.removeprefix(LOG_NOTE).split()[0]).read_text()


@pytest.mark.slow
def test_ctrl_c_during_run_is_one_line(tmp_path):
    text = TWO_STAGES.format(a="", b=", latency_s: 0.1").replace("outputs: 4,", "outputs: 300,")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_trio", "run", write(tmp_path, text), "--prompt", "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # a shell runs background jobs (a CI script's, say) with SIGINT ignored, and children
        # inherit that: Ctrl-C must mean what it means at a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None and proc.stderr is not None
    seen = ""
    while "b:" not in seen:  # the first outputs are streaming: the request is in flight
        seen += proc.stdout.read(1)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(60)
    err = proc.stderr.read()
    assert rc == 1, err
    assert "omni-trio: interrupted" in err and "Traceback" not in err and "error" not in err


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


# -- the embedded tiny-omni pipeline on real vLLM engines (slow: ~20-70 s of engine start) ----


@pytest.mark.vllm
def test_demo_end_to_end_streams_text_and_writes_wavs(tmp_path):
    out_dir = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_trio",
            "demo",
            "--output-dir",
            str(out_dir),
            "--prompt",
            "Hello there.",
            "--max-tokens",
            "8",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    assert "random weights" in out and "noise" in out
    text_line = next(line for line in out.splitlines() if line.startswith("[1] thinker: "))
    assert len(text_line) > len("[1] thinker: ")  # some (random) text was streamed
    assert "per-stage timing" in out and "code2wav" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith(
        "omni-trio demo: 1 prompt(s) through 'tiny-omni' (thinker -> talker -> code2wav); "
        f"1 WAV file(s) in {out_dir}/; "
    )
    # quiet by default: one line per stage once it is ready, vLLM's output in the log only
    for stage_line in ("thinker (vllm) ready in", "talker (vllm) ready in", "code2wav (torch)"):
        assert stage_line in err
    assert "warning" not in (out + err).lower() and "Traceback" not in err
    log = log_file(err)
    assert "EngineCore" in log and "leaked" not in log and "force killing" not in log
    with wave.open(str(out_dir / "prompt-1.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
        assert w.getnframes() > 0 and w.getnframes() % 160 == 0  # whole vocoder hops


@pytest.mark.vllm
def test_serve_tiny_omni_chat_and_speech_then_sigterm_leaves_no_engine_process():
    import openai

    server = Server(["tiny-omni", "--grace-period", "5"])
    try:
        port = server.wait_for_port(timeout=600)
        kids = server.children()
        assert kids  # vLLM's EngineCore processes
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
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
            timeout=120,
        )
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getframerate() == 16_000 and w.getnframes() > 0
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200
        kids = server.children()  # the EngineCores, their workers, the resource tracker
        assert any("resource_tracker" in " ".join(k.cmdline()) for k in kids)
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(120)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    err = server.proc.stderr.read() if server.proc.stderr else ""
    assert rc == 0, err[-3000:]
    assert not alive(kids)  # not even for a moment after the exit: no race to lose
    # vLLM stopped its engines cleanly: nothing killed, nothing left to the resource tracker
    assert "leaked" not in err and "Traceback" not in err
    assert "thinker (vllm) ready in" in err and "code2wav (torch) ready in" in err
    log = log_file(err)
    assert "[shutdown] MPClient: complete" in log
    assert "force killing" not in log and "leaked" not in log


def test_main_leaves_the_vllm_log_level_as_it_found_it(tmp_path, monkeypatch, capsys):
    # main() run in a longer-lived process (tests, an embedding program) must not change the
    # log level that later commands and their engine processes inherit
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert main(["validate", write(tmp_path, TWO_STAGES.format(a="", b=""))]) == 0
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    assert main(["validate", write(tmp_path, TWO_STAGES.format(a="", b=""))]) == 0
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
