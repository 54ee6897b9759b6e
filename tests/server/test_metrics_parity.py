"""The metrics operators expect (server/metrics.py): audio service levels with exact values
on the trio clock, per-replica series after a restart, transfer sizes and times, sessions,
and the one table in the README listing every metric /metrics exposes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import omni_trio
from omni_trio.server import EngineMetrics
from omni_trio.server.metrics import METRICS
from omni_trio.telemetry.audio_slo import AudioStream, audio_samples, real_time_factor
from omni_trio.testing import scripted_pipeline, wait_until_settled

from .test_metrics import scrape

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def on_trio_clock(engine: omni_trio.Engine) -> EngineMetrics:
    engine.orchestrator.observers.clock = trio.current_time
    return EngineMetrics(engine)


def audio_pipeline(latency_s: float) -> omni_trio.PipelineConfig:
    # a text stage streaming into a scripted vocoder whose every output is 0.1 s of audio
    # (800 samples at the 8 kHz its outputs report)
    cfg = scripted_pipeline(
        ["text", "voice"],
        outputs=4,
        latency_s=latency_s,
        stream_input=True,
        stage_options={"voice": {"audio_samples": 800, "sample_rate": 8000}},
    )
    cfg.stages[1].output_type = "audio"
    return cfg


@pytest.mark.parametrize(
    ("latency_s", "first_packet", "underruns", "rtf"),
    [
        # packets at 0.4, 0.6, 0.8, 1.0 s, each 0.1 s long: the player runs dry three times
        (0.2, 0.4, 3, 1.0 / 0.4),
        # packets at 0.1, 0.15, 0.2, 0.25 s: made faster than they play
        (0.05, 0.1, 0, 0.25 / 0.4),
    ],
)
async def test_audio_service_levels_of_a_scripted_vocoder(
    autojump_clock, latency_s, first_packet, underruns, rtf
):
    async with omni_trio.open_engine(audio_pipeline(latency_s)) as engine:
        m = on_trio_clock(engine)
        outs = await engine.generate([1, 2, 3, 4], request_id="a").collect()
        assert [audio_samples(o.data) for o in outs] == [800] * 4
        got = scrape(m)
    voice = (("stage", "voice"),)
    assert got[("omni_trio_audio_time_to_first_packet_seconds_count", voice)] == 1
    assert got[("omni_trio_audio_time_to_first_packet_seconds_sum", voice)] == pytest.approx(
        first_packet
    )
    assert got[("omni_trio_audio_seconds_total", voice)] == pytest.approx(0.4)
    assert got[("omni_trio_audio_packets_total", voice)] == 4
    assert got[("omni_trio_audio_underruns_total", voice)] == underruns
    assert got[("omni_trio_audio_real_time_factor_count", voice)] == 1
    assert got[("omni_trio_audio_real_time_factor_sum", voice)] == pytest.approx(rtf)
    # the text stage is not an audio stage
    assert ("omni_trio_audio_packets_total", (("stage", "text"),)) not in got
    assert m.tracked == 0


def test_audio_stream_rules():
    stream = AudioStream(admitted=1.0)
    assert stream.add(1.5, 0.0) is False and stream.packets == 0  # no samples, no packet
    assert stream.add(2.0, 0.5) is False  # the first packet cannot run dry
    assert stream.add(2.5, 0.5) is False  # a gap as long as the audio: just in time
    assert stream.add(3.1, 0.5) is True
    assert (stream.time_to_first_packet, stream.underruns, stream.audio_s) == (1.0, 1, 1.5)
    assert stream.real_time_factor == pytest.approx(2.1 / 1.5)
    assert real_time_factor(0.0, 1.0, 0.0) is None
    assert audio_samples(None) == 0 and audio_samples(b"\x00\x01") == 0
    assert audio_samples([[0.0, 0.1], [0.2]]) == 3 and audio_samples((0.5,) * 7) == 7


async def test_an_aborted_stream_has_no_real_time_factor(autojump_clock):
    async with omni_trio.open_engine(audio_pipeline(0.2)) as engine:
        m = on_trio_clock(engine)
        async with engine.generate([1, 2, 3, 4], request_id="a") as stream:
            await stream.receive()
        got = scrape(m)
        assert m.tracked == 0
    voice = (("stage", "voice"),)
    assert got[("omni_trio_audio_packets_total", voice)] == 1
    assert got[("omni_trio_audio_real_time_factor_count", voice)] == 0


async def test_per_replica_series_keep_their_labels_after_a_restart(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=2, latency_s=0.1, replicas={"b": 2})
    cfg.stages[1].restart = "on-failure"
    cfg.stages[1].max_restarts = 1
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        engine.pools["b"].replica(1).kill(RuntimeError("killed by the test"))
        with trio.fail_after(60):
            await wait_until_settled(engine)
        for i in range(4):
            await engine.generate("x", request_id=f"r{i}").collect()
        got = scrape(m)
    b0, b1 = ((("replica", "0"), ("stage", "b")), (("replica", "1"), ("stage", "b")))
    assert got[("omni_trio_replica_restarts_total", b1)] == 1
    assert got[("omni_trio_replica_failures_total", b1)] == 1
    assert got[("omni_trio_replica_restarts_total", b0)] == 0
    assert got[("omni_trio_replica_healthy", b1)] == 1
    # the replacement took requests under the same index: every run is counted by replica
    finished = [got[("omni_trio_replica_requests_finished_total", b)] for b in (b0, b1)]
    assert sum(finished) == 4 and finished[1] > 0
    for b in (b0, b1):
        assert got[("omni_trio_replica_requests_running", b)] == 0
        assert got[("omni_trio_replica_requests_waiting", b)] == 0


async def test_each_replicas_requests_waiting_and_running(autojump_clock):
    # one request per replica; each waits a second for its first output
    cfg = scripted_pipeline(["b"], outputs=100, latency_s=1.0, replicas=2)
    cfg.stages[0].max_in_flight_per_replica = 1
    b0, b1 = ((("replica", "0"), ("stage", "b")), (("replica", "1"), ("stage", "b")))

    def load(got: dict) -> list[tuple[float, float]]:
        return [
            (
                got[("omni_trio_replica_requests_waiting", b)],
                got[("omni_trio_replica_requests_running", b)],
            )
            for b in (b0, b1)
        ]

    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(engine.generate("x", request_id=f"r{i}").collect)
            await trio.sleep(0.5)
            assert load(scrape(m)) == [(1, 0), (1, 0)]
            await trio.sleep(1.0)
            assert load(scrape(m)) == [(0, 1), (0, 1)]
            nursery.cancel_scope.cancel()
        after = scrape(m)
    assert load(after) == [(0, 0), (0, 0)]
    assert [after[("omni_trio_replica_requests_aborted_total", b)] for b in (b0, b1)] == [1, 1]
    assert m.tracked == 0


async def test_transfer_sizes_and_times_by_source_and_target(autojump_clock):
    cfg = scripted_pipeline(["a", "b", "c"], outputs=3, stream_input=True)
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        await engine.generate([1, 2, 3], request_id="t").collect()
        got = scrape(m)
    for edge in ((("source", "a"), ("target", "b")), (("source", "b"), ("target", "c"))):
        # one chunk per streamed output (4 bytes per token id), then the closing one (empty)
        assert got[("omni_trio_transfer_size_bytes_count", edge)] == 4
        assert got[("omni_trio_transfer_size_bytes_sum", edge)] == 12
        assert got[("omni_trio_transfer_seconds_count", edge)] == 4
        assert got[("omni_trio_transfers_total", edge)] == 4


async def test_sessions_opened_and_detached(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(["a"], outputs=2)) as engine:
        m = EngineMetrics(engine)
        async with engine.open_session("s1") as session:
            got = scrape(m)
            assert got[("omni_trio_sessions", ())] == 1
            assert got[("omni_trio_sessions_detached", ())] == 0
            await session.detach()
            got = scrape(m)
        assert got[("omni_trio_sessions_detached", ())] == 1
        assert got[("omni_trio_sessions_opened_total", ())] == 1


def _readme_table() -> dict[str, tuple[str, str]]:
    section = README[README.index("### Metrics") :]
    rows = re.findall(r"^\| `omni_trio_(\w+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    return {name: (kind, labels.strip()) for name, kind, labels in rows}


async def test_every_metric_is_in_the_one_table(autojump_clock):
    # what /metrics exposes, METRICS and the README's table name the same metrics (with a
    # graph gate and a resource, whose metrics exist only then)
    cfg = audio_pipeline(0.0)
    cfg.max_requests_in_graph = 4
    cfg.capacities = {"slots": 2.0}
    cfg.stages[0].resources = {"slots": 1.0}
    async with omni_trio.open_engine(cfg) as engine:
        m = EngineMetrics(engine)
        await engine.generate([1, 2], request_id="x").collect()
        text = m.render().decode()
    exposed = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # the client library's creation times
            continue
        name = family.name.removeprefix("omni_trio_")
        exposed[name + ("_total" if family.type == "counter" else "")] = family.type
    declared = {name: kind for name, kind, _, _ in METRICS}
    assert sorted(exposed.items()) == sorted(declared.items())
    table = _readme_table()
    assert table == {name: (kind, labels) for name, kind, labels, _ in METRICS}
