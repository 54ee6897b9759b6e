"""EngineMetrics against a scripted engine under the MockClock (no network, no real sleeps)."""

from __future__ import annotations

import pytest
import trio
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import omni_trio
from omni_trio.server import EngineMetrics
from omni_trio.testing import scripted_pipeline


def scrape(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def test_latencies_are_observed_on_the_trio_clock(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=4, latency_s=0.5)
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        async with engine.generate("xy") as stream:
            await stream.collect()
        got = scrape(m)
    assert got[("omni_trio_requests_finished_total", ())] == 1
    assert got[("omni_trio_request_latency_seconds_count", (("status", "finished"),))] == 1
    # wall-clock perf_counter timestamps: latency is tiny under MockClock but observed
    assert got[("omni_trio_time_to_first_output_seconds_count", ())] == 1
    for stage in ("a", "b"):
        assert got[("omni_trio_stage_queue_wait_seconds_count", (("stage", stage),))] == 1
        key = ("omni_trio_stage_latency_seconds_count", (("stage", stage), ("status", "finished")))
        assert got[key] == 1
    # a -> b: one transfer per finished upstream hand-over, 4 bytes per token id at least
    assert got[("omni_trio_transfers_total", (("source", "a"), ("target", "b")))] >= 1
    assert got[("omni_trio_transfer_bytes_total", (("source", "a"), ("target", "b")))] >= 16
    assert m.tracked == 0 and m.waiting == 0  # nothing kept per request after it ended


async def test_running_waiting_and_abort_counts(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=100, latency_s=1.0, start_delay_s=0)
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        async with trio.open_nursery() as nursery:
            first_output = trio.Event()

            async def consume() -> None:
                async with engine.generate("x", request_id="r1") as s:
                    await s.receive()
                    first_output.set()
                    await trio.sleep_forever()

            nursery.start_soon(consume)
            await first_output.wait()
            # a second request that has produced nothing yet is "waiting"
            async with engine.generate("y", request_id="r2"):
                # let r2's task bind to the stage; checkpoints never advance the MockClock
                for _ in range(1000):
                    if engine.statistics().stage_requests_in_flight == 2:
                        break
                    await trio.lowlevel.checkpoint()
                got = scrape(m)
                assert got[("omni_trio_requests_running", ())] == 1
                assert got[("omni_trio_requests_waiting", ())] == 1
                assert got[("omni_trio_stage_requests_in_flight", (("stage", "a"),))] == 2
            nursery.cancel_scope.cancel()
        got = scrape(m)
        assert got[("omni_trio_requests_aborted_total", ())] == 2
        assert got[("omni_trio_requests_running", ())] == 0
        assert got[("omni_trio_requests_waiting", ())] == 0
        assert got[("omni_trio_request_latency_seconds_count", (("status", "aborted"),))] == 2
        assert m.tracked == 0


async def test_failures_and_replica_health(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b"],
        outputs=2,
        replicas={"b": 2},
        stage_options={"b": {"crash_at_request": 1, "crash_replica": 0}},
    )
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        with pytest.raises(omni_trio.ReplicaDeadError):
            async with engine.generate("x") as s:
                await s.collect()
        got = scrape(m)
        assert got[("omni_trio_requests_failed_total", ())] == 1
        assert got[("omni_trio_replica_healthy", (("replica", "0"), ("stage", "b")))] == 0
        assert got[("omni_trio_replica_healthy", (("replica", "1"), ("stage", "b")))] == 1
        assert got[("omni_trio_stage_live_replicas", (("stage", "b"),))] == 1
        key = ("omni_trio_stage_latency_seconds_count", (("stage", "b"), ("status", "failed")))
        assert got[key] == 1
        # the engine keeps serving on the live replica
        async with engine.generate("x") as s:
            await s.collect()
        assert scrape(m)[("omni_trio_requests_finished_total", ())] == 1


async def test_each_engine_has_its_own_registry(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=1)
    async with omni_trio.open_engine(cfg) as e1, omni_trio.open_engine(cfg) as e2:
        m1, m2 = EngineMetrics(e1), EngineMetrics(e2)
        async with e1.generate("x") as s:
            await s.collect()
        assert scrape(m1)[("omni_trio_requests_finished_total", ())] == 1
        assert scrape(m2)[("omni_trio_requests_finished_total", ())] == 0
    assert "omni_trio_requests_finished_total" not in {
        s.name for fam in REGISTRY.collect() for s in fam.samples
    }
    assert "tracking=0" in repr(m1)


async def test_the_graph_tickets_and_the_resource_ledger_are_gauges(autojump_clock):
    cfg = omni_trio.load_config(
        scripted_pipeline(["a"], outputs=2, engine_options={"max_requests_in_graph": 2}),
        capacities={"gpu_slots": 4},
        stage_overrides={"a": {"resources": {"gpu_slots": 1.5}, "replicas": 2}},
    )
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        async with engine.generate("x") as stream:
            got = scrape(m)
            assert got[("omni_trio_requests_in_graph", ())] == 1
            await stream.collect()
        got = scrape(m)
        assert got[("omni_trio_requests_in_graph", ())] == 0
        assert got[("omni_trio_resource_capacity", (("resource", "gpu_slots"),))] == 4
        assert got[("omni_trio_resource_reserved", (("resource", "gpu_slots"),))] == 3
    # without the keys, neither family is there
    async with omni_trio.open_engine(scripted_pipeline(["a"])) as engine:
        names = {name for name, _ in scrape(EngineMetrics(engine))}
    assert not {"omni_trio_requests_in_graph", "omni_trio_resource_capacity"} & names
