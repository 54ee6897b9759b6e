"""Stage replicas as Ray actors, against a local Ray started by the engine (marked ``ray``).

Each test opens its own engine: a local Ray starts (a few seconds) and is shut down when the
engine closes, leaving no Ray process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import psutil
import pytest
import trio
import trio.testing

import omni_trio
from omni_trio import ReplicaDeadError, StageError, StageStartError
from omni_trio.backends.ray import backend as ray_stage
from omni_trio.backends.ray import link as ray_link
from omni_trio.backends.ray.backend import RayBackend, placement_problem
from omni_trio.backends.ray.link import RayLink, cluster_endpoint
from omni_trio.server.metrics import EngineMetrics
from omni_trio.testing import cancel_at_every_checkpoint, wait_until_settled

from ...conftest import bounded, engine_seconds, kill_tree

pytestmark = pytest.mark.ray

pytest.importorskip("ray")


def ray_processes() -> list[psutil.Process]:
    names = ("raylet", "gcs_server", "ray::", "default_worker", "dashboard", "log_monitor")
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if any(n in cmd for n in names):
            found.append(proc)
    return found


async def no_ray_left() -> list[str]:
    procs = ray_processes()
    await trio.to_thread.run_sync(lambda: psutil.wait_procs(procs, timeout=20))
    return [f"{p.pid} {p.name()}" for p in ray_processes()]


def pipeline(on_ray: bool, **stage_b: object) -> dict:
    b = {
        "id": "b",
        "inputs": ["a"],
        "final_output": True,
        "options": {"outputs": 4, "latency_s": 0.01},
        **stage_b,
    }
    if on_ray:
        b["placement"] = {"ray": {"num_cpus": 0.5}}
    return {"stages": [{"id": "a", "options": {"outputs": 3}}, b]}


def one_stage_on_ray(**options: object) -> dict:
    stage = {"id": "a", "final_output": True, "options": options}
    return {"stages": [{**stage, "placement": {"ray": {"num_cpus": 0.5}}}]}


async def run_all(engine, prompts):
    return [
        [(o.stage_id, o.token_ids, o.finished) for o in await engine.generate(p).collect()]
        for p in prompts
    ]


def test_placement_problem_names_what_was_asked_and_what_nodes_have():
    assert placement_problem({"CPU": 1.0}, [{"CPU": 2.0}]) is None
    assert placement_problem({"CPU": 0.0, "GPU": 0.0}, []) is None
    problem = placement_problem({"CPU": 64.0, "GPU": 0.0}, [{"CPU": 2.0, "memory": 1e9}])
    assert problem == "no Ray node has CPU=64 (the nodes have: CPU=2)"


async def test_a_stage_on_ray_gives_the_same_outputs_and_leaves_nothing():
    prompts = ["hello", [1, 2, 3], "again"]
    async with omni_trio.open_engine(pipeline(False)) as engine:
        local = await run_all(engine, prompts)
    async with omni_trio.open_engine(pipeline(True)) as engine:
        assert isinstance(engine.pools["b"].replicas[0], RayBackend)
        remote = await run_all(engine, prompts)
        assert engine.check_health().status == "ok"
        echo = await engine.collective_rpc("echo", args=(7,), stage_ids=["b"])
        assert echo == [{"stage": "b", "replica": 0, "args": [7]}]
        assert engine.statistics().stage_requests_in_flight == 0
    assert remote == local
    assert await no_ray_left() == []


async def test_a_slow_consumer_gets_every_output_of_each_batch_in_order():
    # a window of 2 and a consumer that lags: of a batch from the actor, emit's fast path
    # takes what fits and refuses the rest, which goes through the awaited emit, in order
    async def slowly(config: dict) -> list[tuple[str, list[int], bool]]:
        config["output_buffer"] = 2
        async with omni_trio.open_engine(config) as engine:
            got = []
            async with engine.generate("hello", output_stages=["b"]) as stream:
                async for out in stream:
                    got.append((out.stage_id, out.token_ids, out.finished))
                    await trio.sleep(0.002)
            assert engine.statistics().stage_requests_in_flight == 0
            return got

    options = {"outputs": 40, "latency_s": 0}
    local = await slowly(pipeline(False, options=options))
    remote = await slowly(pipeline(True, options=options))
    assert len(local) == 40 and local[-1][2]
    assert remote == local
    assert await no_ray_left() == []


async def test_cancellation_reaches_the_actor_before_async_with_returns():
    cfg = pipeline(True, options={"outputs": 1000, "latency_s": 0.01})
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hello", request_id="r") as stream:
            async for out in stream:
                if out.stage_id == "b":
                    break
        # the abort was recorded inside the actor, by its own scripted backend
        (stats,) = await engine.collective_rpc("stats", stage_ids=["b"])
        assert stats.requests_aborted == 1 and stats.requests_in_flight == 0
        assert engine.statistics().stage_requests_in_flight == 0
    assert await no_ray_left() == []


async def test_a_killed_actor_fails_only_its_requests_and_is_restarted():
    cfg = pipeline(
        True,
        replicas=2,
        restart="on-failure",
        restart_backoff_s=0.1,
        options={"outputs": 200, "latency_s": 0.01},
    )
    async with omni_trio.open_engine(cfg) as engine:
        pool = engine.pools["b"]
        results: dict[str, object] = {}
        seen: set[str] = set()
        all_seen = trio.Event()

        async def one(rid: str) -> None:
            try:
                async with engine.generate("hi", request_id=rid) as stream:
                    async for out in stream:
                        if out.stage_id == "b":
                            seen.add(rid)
                            if len(seen) == 4:
                                all_seen.set()
                results[rid] = "ok"
            except StageError as exc:
                results[rid] = exc

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, f"r{i}")
            with bounded("4 requests streaming from stage b", 60, engine):
                await all_seen.wait()
            victims = {r for r in seen if pool.replica_of(r).replica == 0}
            assert len(victims) == 2
            victim = pool.replica(0)
            assert isinstance(victim, RayBackend)
            os.kill(await victim.actor_pid(), signal.SIGKILL)
        failed = {rid for rid, r in results.items() if r != "ok"}
        assert failed == victims
        assert all(isinstance(results[r], ReplicaDeadError) for r in failed)
        with bounded("the killed actor's restart", 60, engine):
            await wait_until_settled(engine)
        stats = pool.statistics().replicas
        assert [r.state for r in stats] == ["ready", "ready"] and stats[0].restarts == 1
        # the remote replicas in the health report and the Prometheus metrics, as local ones
        health = engine.check_health()
        assert health.status == "ok"
        assert [(h.stage_id, h.live_replicas) for h in health.stages] == [("a", 1), ("b", 2)]
        text = EngineMetrics(engine, attach=False).render().decode()
        assert 'omni_trio_replica_restarts_total{replica="0",stage="b"} 1.0' in text
        assert 'omni_trio_replica_state{replica="1",stage="b",state="ready"} 1.0' in text
        later = await run_all(engine, ["x", "y", "z", "w"])
        assert all(r[-1][2] for r in later)
    assert await no_ray_left() == []


async def test_a_hung_actor_is_caught_by_the_health_call_and_replaced(monkeypatch):
    # a short health period so the test waits under a second, not the defaults' 15 s
    monkeypatch.setattr(ray_stage, "HEALTH_INTERVAL_S", 0.2)
    monkeypatch.setattr(ray_stage, "HEALTH_TIMEOUT_S", 0.5)
    cfg = pipeline(
        True,
        restart="on-failure",
        restart_backoff_s=0.1,
        options={"outputs": 1000, "latency_s": 0.01},
    )
    async with omni_trio.open_engine(cfg) as engine:
        pool = engine.pools["b"]
        hung = pool.replica(0)
        assert isinstance(hung, RayBackend)
        pid = await hung.actor_pid()
        with pytest.raises(ReplicaDeadError, match="did not answer a health call") as caught:
            async with engine.generate("hi", request_id="r") as stream:
                async for out in stream:
                    if out.stage_id == "b":
                        os.kill(pid, signal.SIGSTOP)  # the actor hangs: alive, answers nothing
        try:
            assert caught.value.stage_id == "b"
            with bounded("the hung actor's replacement", 60, engine):
                await wait_until_settled(engine)
            (replica,) = pool.statistics().replicas
            assert replica.state == "ready" and replica.restarts == 1
            assert await pool.replica(0).actor_pid() != pid
            (later,) = await run_all(engine, ["x"])
            assert later[-1][2]
            assert engine.statistics().stage_requests_in_flight == 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed by the stop, as it should
                os.kill(pid, signal.SIGCONT)
    assert await no_ray_left() == []


def processes_titled(title: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if title in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def forget_cluster(port: int) -> None:
    """Remove what `ray stop` would: the pointer to this cluster that `ray start` left."""
    current = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    with contextlib.suppress(OSError):
        with open(current) as f:
            ours = f.read().strip().endswith(f":{port}")
        if ours:
            os.remove(current)


FOREIGN_ACTOR = """
import sys, ray
ray.init(address=sys.argv[1])
@ray.remote(num_cpus=0)
class Foreign:
    def ping(self):
        return 1
a = Foreign.options(name="foreign", namespace="other", lifetime="detached").remote()
ray.get(a.ping.remote())
"""


async def test_against_an_existing_cluster_it_kills_only_its_own_actors(tmp_path):
    with socket.socket() as sock:  # a free port for the cluster's GCS
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"127.0.0.1:{port}"
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    before = {p.pid for p in psutil.process_iter()}
    with bounded("`ray start` (a subprocess)", 120):
        await trio.run_process(
            [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2"]
            + ["--include-dashboard=false", "--disable-usage-stats"],
            capture_stdout=True,
            capture_stderr=True,
            deliver_cancel=kill_tree,
        )
    cluster = [p for p in psutil.process_iter() if p.pid not in before]
    try:
        with bounded("the other job's actor (a subprocess)", 120):
            await trio.run_process(
                [sys.executable, "-c", FOREIGN_ACTOR, address], deliver_cancel=kill_tree
            )
        cfg = pipeline(True)
        cfg["stages"][1]["placement"] = {"ray": {"address": address, "num_cpus": 0.5}}
        async with omni_trio.open_engine(cfg) as engine:
            assert [r[-1][2] for r in await run_all(engine, ["hello"])] == [True]
            assert len(processes_titled("ray::ReplicaActor")) == 1
        mine = processes_titled("ray::ReplicaActor")
        await trio.to_thread.run_sync(lambda: psutil.wait_procs(mine, timeout=20))
        assert processes_titled("ray::ReplicaActor") == []
        # the cluster and the other job's actor are still there
        assert len(processes_titled("ray::Foreign")) == 1
        assert any("gcs_server" in " ".join(p.cmdline()) for p in cluster if p.is_running())
    finally:
        everything = cluster + [
            c for p in cluster if p.is_running() for c in p.children(recursive=True)
        ]
        for proc in everything:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(everything, timeout=20)
        forget_cluster(port)


async def test_an_unsatisfiable_placement_fails_fast_saying_what_was_asked():
    cfg = pipeline(True)
    cfg["stages"][1]["placement"] = {"ray": {"num_cpus": 64}}
    with bounded("the start's failure", 60):
        with pytest.raises(StageStartError, match=r"no Ray node has CPU=64"):
            async with omni_trio.open_engine(cfg):
                pass
    assert await no_ray_left() == []


def test_cluster_endpoint_is_the_host_and_port_a_cluster_must_accept():
    assert cluster_endpoint("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert cluster_endpoint("ray://head:10001") == ("head", 10001)
    assert cluster_endpoint("[::1]:6379") == ("::1", 6379)
    # nothing to probe: ray.init judges
    assert [cluster_endpoint(a) for a in (None, "auto", "head", "head:noport")] == [None] * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the chain of its ``__cause__``s."""
    chain = [exc]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


async def start_failure(address: str) -> StageStartError:
    """The error an engine whose stage b is placed on Ray at ``address`` fails to start with."""
    cfg = pipeline(True)
    cfg["stages"][1]["placement"] = {"ray": {"address": address, "num_cpus": 0.5}}
    with bounded(f"the start's failure at {address}", 60):
        with pytest.raises(StageStartError) as info:
            async with omni_trio.open_engine(cfg):
                pass
    return info.value


@pytest.mark.parametrize(
    ("where", "cause"),
    [("dead", ConnectionRefusedError), ("no port", ValueError)],
    ids=["no-cluster-listens", "ray-init-refuses"],
)
async def test_a_ray_address_that_cannot_be_joined_fails_the_start_naming_it(where, cause):
    # nothing listens on a free port (refused by the probe, before ray.init); a port Ray
    # cannot parse makes ray.init itself fail, on the link's thread
    address = f"127.0.0.1:{free_port()}" if where == "dead" else "127.0.0.1:noport"
    error = await start_failure(address)
    assert error.stage_id == "b"
    assert address in str(error) and "placement.ray.address" in str(error)
    assert isinstance(causes(error)[-1], cause)
    # nothing of ours is left: no link, no link thread, no Ray connection or process
    assert RayLink._current is None
    assert [t for t in threading.enumerate() if t.name == "omni-trio-ray-link"] == []
    assert not sys.modules["ray"].is_initialized()
    assert await no_ray_left() == []


async def _answers_http1(stream: trio.SocketStream) -> None:
    await stream.receive_some()
    await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


async def _silent(stream: trio.SocketStream) -> None:
    await trio.sleep_forever()


async def _hangs_up(stream: trio.SocketStream) -> None:
    await stream.aclose()


@pytest.mark.parametrize(
    ("server", "said"),
    [
        (_answers_http1, "it answered b'HTTP/1.1 '"),
        (_silent, "did not answer an HTTP/2 preface within 0.5s"),
        (_hangs_up, "it closed the connection"),
    ],
    ids=["http1-server", "silent-server", "hangs-up"],
)
async def test_an_address_where_a_server_that_is_not_ray_listens_fails_the_start_at_once(
    monkeypatch, server, said
):
    # ray.init against a server that is not Ray's hangs (an engine start that never ends):
    # the probe sees that no gRPC (HTTP/2) server answers, before ray.init is called
    monkeypatch.setattr(ray_link, "PROBE_TIMEOUT_S", 0.5)
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, server, 0, host="127.0.0.1"))
        address = f"127.0.0.1:{listener.socket.getsockname()[1]}"
        error = await start_failure(address)
        nursery.cancel_scope.cancel()
    message = str(error)
    assert error.stage_id == "b" and f"no Ray cluster answers at {address}" in message
    assert "accepted a TCP connection" in message and said in message
    assert RayLink._current is None and not sys.modules["ray"].is_initialized()


async def test_the_probe_takes_a_grpc_server_as_ray_does():
    # a real gRPC server (as Ray's GCS and Ray Client server are) passes the probe
    grpc = pytest.importorskip("grpc")
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        await trio.to_thread.run_sync(
            ray_link._probe, f"127.0.0.1:{port}", ("127.0.0.1", port), "b"
        )
    finally:
        server.stop(None)


async def test_a_local_ray_outlives_the_thread_that_connected():
    # Ray forks its GCS and raylet with PR_SET_PDEATHSIG, which fires when the forking
    # *thread* exits: connecting from a short-lived thread (as trio's worker threads are)
    # must not tie the local Ray's life to that thread.
    links: list[RayLink] = []
    caller = threading.Thread(target=lambda: links.append(RayLink.acquire(None, stage_id="b")))
    caller.start()
    caller.join()
    (link,) = links
    # the link's own thread, which started Ray, is not a daemon (it ends by release())
    (owner,) = [t for t in threading.enumerate() if t.name == ray_link.THREAD_NAME]
    assert not owner.daemon
    try:
        procs = ray_processes()
        assert any("gcs_server" in " ".join(p.cmdline()) for p in procs)
        # a PDEATHSIG kill lands as the thread exits: one second is ample to see it
        gone, _alive = await trio.to_thread.run_sync(lambda: psutil.wait_procs(procs, timeout=1))
        assert gone == []
        value = await link.call(link.ray.put(41))
        assert value == 41
    finally:
        await trio.to_thread.run_sync(link.release)
    assert await no_ray_left() == []


_HELD_AT_EXIT = """
import atexit, threading
import ray
from omni_trio.backends.ray.link import THREAD_NAME, RayLink

def after_threads_joined():  # atexit runs once the interpreter joined its threads
    alive = [t.name for t in threading.enumerate() if t.name == THREAD_NAME]
    print("after exit:", ray.is_initialized(), RayLink._current, alive, flush=True)

async def get(ref):
    return await ref

atexit.register(after_threads_joined)
link = RayLink.acquire(None, stage_id="b")
print("value", link.submit(get(ray.put(41))).result(60), flush=True)
"""


async def test_a_link_held_when_the_interpreter_exits_disconnects_in_order():
    # an owner that never released the link (an engine never closed): the interpreter's
    # exit disconnects it (the local Ray shut down) before joining the link's thread,
    # which is not a daemon and would otherwise hang the exit
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = partial(
        subprocess.run,
        [sys.executable, "-c", _HELD_AT_EXIT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard: the exit waiting for the link's thread
    )
    done = await trio.to_thread.run_sync(run)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["value 41", "after exit: False None []"]
    assert await no_ray_left() == []


@pytest.mark.vllm
async def test_a_vllm_stage_in_an_actor_gives_the_same_greedy_tokens() -> None:
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    stage = {
        "id": "thinker",
        "backend": "vllm",
        "engine_args": {"model": "tiny:thinker"},
        "final_output": True,
        "default_sampling_params": greedy,
    }
    prompts = ["hello tiny world", "the river and the moon"]

    async def tokens(config: dict) -> list[list[int]]:
        async with omni_trio.open_engine(config) as engine:
            got = []
            with bounded("the greedy outputs of each prompt", 120, engine):
                for p in prompts:
                    outs = await engine.generate(p).collect()
                    got.append([t for o in outs for t in o.token_ids])
            assert engine.statistics().stage_requests_in_flight == 0
            return got

    local = await tokens({"stages": [stage]})
    remote = await tokens({"stages": [{**stage, "placement": {"ray": {"num_cpus": 1}}}]})
    assert remote == local and all(len(t) == 12 for t in local)
    assert await no_ray_left() == []


async def test_a_stream_input_stage_on_ray_takes_its_input_as_it_comes():
    cfg = pipeline(True, stream_input=True)
    cfg["stages"][0]["options"] = {"outputs": 6, "latency_s": 0.05}
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate("hello", output_stages=["a", "b"]).collect()
        order = [(o.stage_id, o.finished) for o in outs]
        # b (in the actor) answered a's first deltas before a had finished
        assert order.index(("b", False)) < order.index(("a", True))
        assert ("b", True) in order
        (stats,) = await engine.collective_rpc("stats", stage_ids=["b"])
        assert stats.requests_finished == 1 and stats.requests_in_flight == 0
    assert await no_ray_left() == []


async def test_an_interaction_sent_at_once_reaches_the_request_in_the_actor():
    # sent right after the request is admitted, usually before the actor has it: it waits
    # for the actor's STARTED (before, it was refused there and lost, yet reported delivered)
    cfg = one_stage_on_ray(outputs=20, latency_s=0.05)
    async with omni_trio.open_engine(cfg) as engine:
        for i in range(5):
            async with engine.generate("hi", request_id=f"r{i}") as stream:
                assert await stream.interact({"stop": True}) is True
                outs = [o async for o in stream]
            assert outs[-1].finish_reason == "stop" and len(outs) < 20
        # a request that ended: nothing is delivered, and it says so
        assert await engine.interact("r0", {"stop": True}) is False
        assert engine.statistics().requests_in_flight == 0
    assert await no_ray_left() == []


async def test_an_interaction_the_actor_does_not_answer_fails_naming_the_limit(monkeypatch):
    # a hung actor (SIGSTOP): the interaction's shielded call is bounded, and the error
    # says so; once the actor runs again the request ends normally
    monkeypatch.setattr(ray_stage, "ABORT_TIMEOUT_S", 0.5)
    cfg = one_stage_on_ray(outputs=20, latency_s=0.02)
    async with omni_trio.open_engine(cfg) as engine:
        replica = engine.pools["a"].replica(0)
        assert isinstance(replica, RayBackend)
        pid = await replica.actor_pid()
        async with engine.generate("hi", request_id="r") as stream:
            first = await stream.receive()
            assert not first.finished
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(StageError, match=r"did not answer an interaction") as caught:
                    await stream.interact({"note": 1})
                assert "within 0.5s" in str(caught.value)
                assert caught.value.stage_id == "a" and caught.value.request_id == "r"
            finally:
                os.kill(pid, signal.SIGCONT)
            rest = [o async for o in stream]
        assert rest[-1].finished
        assert engine.statistics().requests_in_flight == 0
        assert engine.pools["a"].statistics().replicas[0].restarts == 0
    assert await no_ray_left() == []


async def test_an_actor_killed_during_an_interaction_fails_it_with_a_stage_error():
    # the actor dies while the interaction's remote call waits for it: a StageError naming
    # the replica, caused by Ray's error; the request fails as the replica's death
    cfg = one_stage_on_ray(outputs=20, latency_s=0.02)
    cfg["stages"][0].update(restart="on-failure", restart_backoff_s=0.1)
    async with omni_trio.open_engine(cfg) as engine:
        pool = engine.pools["a"]
        replica = pool.replica(0)
        assert isinstance(replica, RayBackend)
        pid = await replica.actor_pid()
        interaction: list[BaseException] = []

        async def interact(stream: omni_trio.RequestStream) -> None:
            try:
                await stream.interact({"note": 1})
            except StageError as exc:
                interaction.append(exc)

        # Ray fails the request's stream and the replica's sentinel call with the same
        # ActorDiedError; whichever of them trio sees first ends the request, so either
        # message is the replica's death
        dead = r"replica a\[0\]: its Ray actor (died|failed request 'r'): ActorDiedError"
        with pytest.raises(ReplicaDeadError, match=dead) as failed:
            async with engine.generate("hi", request_id="r") as stream:
                await stream.receive()
                os.kill(pid, signal.SIGSTOP)  # the call is sent and waits for an answer
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(interact, stream)
                    await trio.testing.wait_all_tasks_blocked()
                    os.kill(pid, signal.SIGKILL)
                async for _out in stream:
                    pass
        causes, cause = [], failed.value.__cause__
        while cause is not None:
            causes.append(type(cause).__name__)
            cause = cause.__cause__
        assert causes[-1] == "ActorDiedError", causes
        (error,) = interaction
        assert isinstance(error, StageError) and error.stage_id == "a"
        assert f"replica {replica.name}" in str(error) and "interaction" in str(error)
        assert error.__cause__ is not None
        with bounded("the killed actor's restart", 60, engine):
            await wait_until_settled(engine)
        assert pool.statistics().replicas[0].restarts == 1
        assert engine.statistics().requests_in_flight == 0
        (later,) = await run_all(engine, ["x"])
        assert later[-1][2]
    assert await no_ray_left() == []


async def test_an_interaction_cancelled_at_each_checkpoint_leaves_nothing_in_the_actor():
    # entering, interacting (waiting for the actor's STARTED, the shielded call), reading,
    # leaving: cancelled at each, no request is left here or in the actor. Outputs 0.1 s
    # apart: a run cancelled while the actor streams leaves it time to see the abort (the
    # assertion that it aborted one must not depend on a loaded machine's speed)
    cfg = one_stage_on_ray(outputs=4, latency_s=0.1)
    async with omni_trio.open_engine(cfg) as engine:

        async def consumer(engine: omni_trio.Engine) -> None:
            async with engine.generate("hi") as stream:
                await stream.interact({"note": 1})
                async for _out in stream:
                    pass

        report = await cancel_at_every_checkpoint(engine, consumer, run_timeout=engine_seconds(60))
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 8  # 11 when measured
        (stats,) = await engine.collective_rpc("stats", stage_ids=["a"])
        assert stats.requests_in_flight == 0 and stats.requests_aborted >= 1
    assert await no_ray_left() == []


async def test_a_consumer_cancelled_at_each_checkpoint_leaves_nothing_in_the_actor():
    # b on Ray takes a's output as it streams; a consumer cancelled at each of its
    # checkpoints (submitting, while the actor streams, leaving) must leave no request in
    # either stage, in this process or in the actor
    # b's outputs are 0.25 s apart: a consumer cancelled while b streams leaves b at least
    # that long to run, so the abort reaches the actor first (at 5 ms apart, a loaded machine
    # let b finish every request before its abort arrived)
    cfg = pipeline(True, stream_input=True, options={"outputs": 3, "latency_s": 0.25})
    async with omni_trio.open_engine(cfg) as engine:

        async def consumer(engine: omni_trio.Engine) -> None:
            async with engine.generate("hi", output_stages=["a", "b"]) as stream:
                async for _out in stream:
                    pass

        # a run that stalls (a lost chunk did, once) is reported within a minute
        report = await cancel_at_every_checkpoint(engine, consumer, run_timeout=engine_seconds(60))
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 6
        # the actor's own backend: every request it saw was finished or aborted
        (stats,) = await engine.collective_rpc("stats", stage_ids=["b"])
        assert stats.requests_in_flight == 0 and stats.requests_aborted >= 1
    assert await no_ray_left() == []
