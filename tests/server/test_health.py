"""``GET /health`` and the replica metrics end to end (real Hypercorn on a free port, a real
httpx client), and the pure ``health_report`` over constructed statistics."""

from __future__ import annotations

from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from omni_trio.config import PipelineConfig
from omni_trio.engine.health import assess_health
from omni_trio.outputs import EngineStatistics, ReplicaStatistics, StageStatistics
from omni_trio.server.app import health_report
from omni_trio.server.lifecycle import ServerPhase
from omni_trio.server.metrics import state_metrics
from omni_trio.testing import scripted_pipeline

from .conftest import client_for, running_server

STATES = ("starting", "ready", "draining", "dead", "restarting", "stopped")
CRASH = "StageError: scripted crash at request 1"  # a scripted replica's last_error


async def samples(http, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric family from ``/metrics``, by its sorted labels."""
    r = await http.get("/metrics")
    assert r.status_code == 200
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
        if s.name == name
    }


def replica_key(stage: str, replica: int, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"stage": stage, "replica": str(replica), **extra}.items()))


def crashing_talker() -> PipelineConfig:
    """thinker -> talker, whose one replica crashes at its first request."""
    return scripted_pipeline(
        ["thinker", "talker"],
        name="scripted",
        outputs=2,
        stage_options={"talker": {"crash_at_request": 1}},
    )


async def crash_the_talker(http: httpx.AsyncClient) -> dict[str, Any]:
    """Send the request that crashes the talker (a 500); return the 503 /health body."""
    r = await http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "x"})
    assert r.status_code == 500
    r = await http.get("/health")
    assert r.status_code == 503
    body: dict[str, Any] = r.json()
    return body


async def test_a_stage_whose_only_replica_crashed_makes_health_503_naming_it():
    async with running_server(crashing_talker()) as (engine, base), client_for(base) as http:
        body = await crash_the_talker(http)
        assert body["status"] == "unhealthy" and body["dead_stages"] == ["talker"]
        assert body["message"].startswith("stage(s) talker have no ready replica: talker[0] dead")
        talker, thinker = body["stages"]["talker"], body["stages"]["thinker"]
        assert (talker["live_replicas"], talker["total_replicas"]) == (0, 1)
        assert (thinker["live_replicas"], thinker["total_replicas"]) == (1, 1)
        (dead,) = talker["replicas"]
        assert dead["replica"] == 0 and dead["state"] == "dead"
        assert dead["requests_in_flight"] == 0
        assert (dead["failures"], dead["restarts"], dead["last_error"]) == (1, 0, CRASH)
        assert thinker["replicas"][0]["state"] == "ready"
        assert (body["requests_in_flight"], body["requests_waiting"], body["paused"]) == (
            0,
            0,
            False,
        )

        state = await samples(http, "omni_trio_replica_state")
        for stage, current in (("talker", "dead"), ("thinker", "ready")):
            got = {s: state[replica_key(stage, 0, state=s)] for s in STATES}
            assert got == {s: 1.0 if s == current else 0.0 for s in STATES}, stage
        assert len(state) == 2 * len(STATES)  # one sample per state per replica, no more
        healthy = await samples(http, "omni_trio_replica_healthy")
        assert healthy == {replica_key("thinker", 0): 1, replica_key("talker", 0): 0}
        failures = await samples(http, "omni_trio_replica_failures_total")
        assert failures == {replica_key("thinker", 0): 0, replica_key("talker", 0): 1}
        assert (await samples(http, "omni_trio_stage_live_replicas"))[(("stage", "talker"),)] == 0


async def test_a_replica_waiting_for_its_restart_is_named_in_health_and_metrics():
    # the restart is a minute away: the replica stays "restarting" for the whole test
    overrides = {"talker": {"restart": "on-failure", "restart_backoff_s": 60.0}}
    async with (
        running_server(crashing_talker(), stage_overrides=overrides) as (engine, base),
        client_for(base) as http,
    ):
        body = await crash_the_talker(http)
        assert body["status"] == "unhealthy" and body["dead_stages"] == ["talker"]
        assert body["message"].endswith(f"talker[0] restarting ({CRASH})")
        (talker,) = body["stages"]["talker"]["replicas"]
        assert (talker["state"], talker["failures"], talker["restarts"]) == ("restarting", 1, 0)
        state = await samples(http, "omni_trio_replica_state")
        assert state[replica_key("talker", 0, state="restarting")] == 1
        assert state[replica_key("talker", 0, state="dead")] == 0
        assert (await samples(http, "omni_trio_replica_restarts_total")) == {
            replica_key("thinker", 0): 0,
            replica_key("talker", 0): 0,
        }


async def test_a_paused_engine_is_healthy_and_shows_its_waiting_admissions():
    cfg = scripted_pipeline(["thinker", "talker"], name="scripted", outputs=2)
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        await engine.pause()
        answers: list[httpx.Response] = []

        async def complete() -> None:
            body = {"model": "scripted", "prompt": "x"}
            answers.append(await http.post("/v1/completions", json=body))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete)
            with trio.fail_after(10):
                # the server runs in this trio run: checkpoints let it take the request
                while not engine.statistics().requests_waiting:
                    await trio.lowlevel.checkpoint()
            r = await http.get("/health")
            assert r.status_code == 200
            body = r.json()
            assert body["status"] == "ok" and body["paused"] is True
            assert (body["requests_waiting"], body["requests_in_flight"]) == (1, 0)
            assert (await samples(http, "omni_trio_engine_paused")) == {(): 1}
            assert (await samples(http, "omni_trio_admission_waiting")) == {(): 1}
            engine.resume()
        assert [a.status_code for a in answers] == [200]
        assert (await samples(http, "omni_trio_engine_paused")) == {(): 0}
        assert (await samples(http, "omni_trio_admission_waiting")) == {(): 0}


async def test_one_dead_replica_of_two_is_degraded_but_healthy_and_still_serves():
    cfg = scripted_pipeline(
        ["thinker", "talker"],
        name="scripted",
        outputs=2,
        replicas={"talker": 2},
        stage_options={"talker": {"crash_at_request": 1, "crash_replica": 0}},
    )
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "x"})
        assert r.status_code == 500
        r = await http.get("/health")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "degraded" and "talker[0] dead" in body["message"]
        talker = body["stages"]["talker"]
        assert (talker["live_replicas"], talker["total_replicas"]) == (1, 2)
        assert [rep["state"] for rep in talker["replicas"]] == ["dead", "ready"]
        r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "x"})
        assert r.status_code == 200
        healthy = await samples(http, "omni_trio_replica_healthy")
        assert healthy[replica_key("talker", 0)] == 0 and healthy[replica_key("talker", 1)] == 1


async def test_health_and_metrics_show_a_request_in_flight_on_its_replicas():
    cfg = scripted_pipeline(
        ["thinker", "talker"], name="scripted", outputs=10_000, latency_s=0.02, stream_input=True
    )
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        body = {"model": "scripted", "prompt": "x", "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # kept referenced: a dropped iterator is finalized, which closes the response
            lines = r.aiter_lines()
            seen = 0
            async for line in lines:
                seen += line.startswith("data: ")
                if seen >= 3:  # the opening event, then two talker outputs
                    break
            health = (await http.get("/health")).json()
            assert health["requests_in_flight"] == 1
            for sid in ("thinker", "talker"):
                stage = health["stages"][sid]
                assert stage["requests_in_flight"] == 1, sid
                assert stage["replicas"][0]["requests_in_flight"] == 1, sid
            in_flight = await samples(http, "omni_trio_replica_requests_in_flight")
            assert in_flight == {replica_key("thinker", 0): 1, replica_key("talker", 0): 1}
            assert (await samples(http, "omni_trio_admission_waiting")) == {(): 0}
            assert (await samples(http, "omni_trio_engine_paused")) == {(): 0}
            del lines


# -- the pure mapping from a report to status and body -----------------------------------------
def stats_with(
    *states: str,
    closed: bool = False,
    stage_waiting: int = 0,
    waiting: int = 0,
    paused: bool = False,
) -> EngineStatistics:
    """One stage ``a`` whose replicas are in ``states``; a dead one failed once with an
    error, a restarting one died twice and was restarted once."""
    replicas = tuple(
        ReplicaStatistics(
            replica=i,
            alive=state == "ready",
            requests_in_flight=1 if state in ("ready", "draining") else 0,
            requests_finished=0,
            requests_aborted=0,
            requests_failed=0,
            state=state,  # type: ignore[arg-type]
            restarts={"restarting": 1}.get(state, 0),
            failures={"dead": 1, "restarting": 2}.get(state, 0),
            last_error="StageError: boom" if state == "dead" else None,
        )
        for i, state in enumerate(states)
    )
    in_flight = sum(r.requests_in_flight for r in replicas)
    live = sum(r.alive for r in replicas)
    stage = StageStatistics("a", 0, "scripted", in_flight, live, replicas, stage_waiting)
    return EngineStatistics(
        in_flight, 0, 0, 0, in_flight, closed, (stage,), requests_waiting=waiting, paused=paused
    )


def test_health_report_status_by_replica_states_and_phase():
    code, body = health_report(stats_with("dead", "draining"))
    assert code == 503 and body["status"] == "unhealthy" and body["dead_stages"] == ["a"]
    assert body["message"] == (
        "stage(s) a have no ready replica: a[0] dead (StageError: boom), a[1] draining"
    )
    assert body["stages"]["a"]["replicas"][0]["last_error"] == "StageError: boom"
    assert body["stages"]["a"]["replicas"][0]["failures"] == 1
    code, body = health_report(stats_with("ready", "restarting"))
    assert code == 200 and body["status"] == "degraded"
    code, body = health_report(stats_with("ready", "stopped"))
    assert code == 200 and body["status"] == "ok"
    code, body = health_report(stats_with("stopped", closed=True))
    assert code == 503 and body["status"] == "closed" and "dead_stages" not in body
    # the server's phase comes first; the body still shows the replicas
    code, body = health_report(stats_with("starting"), ServerPhase.STARTING)
    assert code == 503 and body["status"] == "starting"
    assert body["stages"]["a"]["replicas"][0]["state"] == "starting"
    code, body = health_report(stats_with("ready"), ServerPhase.DRAINING)
    assert code == 503 and body["status"] == "stopping"
    # a report and the statistics it derives from answer the same
    stats = stats_with("dead", "ready")
    assert health_report(assess_health(stats)) == health_report(stats)


def test_replica_metrics_of_a_snapshot():
    stats = stats_with("ready", "draining", "restarting", stage_waiting=3, waiting=5, paused=True)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in state_metrics(stats, without_output=0)
        for s in fam.samples
    }
    for i, current in enumerate(("ready", "draining", "restarting")):
        for state in STATES:
            key = ("omni_trio_replica_state", replica_key("a", i, state=state))
            assert got[key] == (1 if state == current else 0), (i, state)
    assert [got["omni_trio_replica_healthy", replica_key("a", i)] for i in range(3)] == [1, 0, 0]
    assert got["omni_trio_replica_restarts_total", replica_key("a", 2)] == 1
    assert got["omni_trio_replica_failures_total", replica_key("a", 2)] == 2
    assert got["omni_trio_replica_failures_total", replica_key("a", 0)] == 0
    # the draining replica still serves its request
    in_flight = [got["omni_trio_replica_requests_in_flight", replica_key("a", i)] for i in range(3)]
    assert in_flight == [1, 1, 0]
    assert got["omni_trio_stage_live_replicas", (("stage", "a"),)] == 1
    assert got["omni_trio_stage_requests_waiting", (("stage", "a"),)] == 3
    assert got["omni_trio_stage_requests_in_flight", (("stage", "a"),)] == 2
    assert got["omni_trio_admission_waiting", ()] == 5
    assert got["omni_trio_engine_paused", ()] == 1
    # "requests waiting" keeps its meaning: admitted requests with no output yet
    assert got["omni_trio_requests_waiting", ()] == 0
    assert got["omni_trio_requests_running", ()] == 2
