"""The blocking facade, driven from a plain (non-async) test: real threads, real trio loop."""

import pytest

import omni_trio
import omni_trio.sync
from omni_trio.testing import scripted_pipeline


def test_sync_generate_abort_and_rpc():
    cfg = scripted_pipeline(["a", "b"], outputs=3)
    with omni_trio.sync.open_engine(cfg) as engine:
        outs = list(engine.generate([5, 6], request_id="r"))
        assert [o.token_ids[0] for o in outs] == [7, 8, 7]
        assert outs[-1].finished
        assert [r["stage"] for r in engine.collective_rpc("echo")] == ["a", "b"]
        assert engine.abort("unknown") == []
        assert engine.statistics().requests_finished == 1
    with pytest.raises(omni_trio.InvalidRequestError):
        with omni_trio.sync.open_engine(cfg) as engine:
            list(engine.generate(""))


def test_sync_early_break_aborts():
    cfg = scripted_pipeline(1, outputs=1000, latency_s=0.001)
    with omni_trio.sync.open_engine(cfg) as engine:
        it = engine.generate("x", request_id="r")
        next(it)
        it.close()
        stats = engine.statistics()
        assert stats.requests_in_flight == 0
        assert stats.requests_aborted == 1


def test_sync_membership_pause_and_health():
    cfg = scripted_pipeline(["a"], outputs=2)
    with omni_trio.sync.open_engine(cfg) as engine:
        assert engine.add_replica("a") == 1
        assert engine.check_health().stage("a").live_replicas == 2
        engine.remove_replica("a", 0, drain_timeout=1.0)
        assert [r.replica for r in engine.statistics().stage("a").replicas] == [1]
        engine.pause()
        assert engine.statistics().paused
        engine.resume()
        assert not engine.statistics().paused
        assert list(engine.generate("x"))[-1].finished
        assert engine.check_health().status == "ok"


def test_sync_interact_stops_a_request():
    cfg = scripted_pipeline(["a"], outputs=1000, latency_s=0.001)
    with omni_trio.sync.open_engine(cfg) as engine:
        it = engine.generate("x", request_id="r")
        next(it)
        assert engine.interact("r", {"stop": True})
        rest = list(it)
        assert rest[-1].finished and rest[-1].finish_reason == "stop"
        assert len(rest) < 999
        assert not engine.interact("r", {"stop": True})  # ended


def test_the_engine_runs_on_a_thread_of_its_own_that_closing_joins():
    # not a daemon: it ends by the engine's close (or, never closed, at the interpreter's
    # exit: tests/transport/test_loop_host.py shows that stop)
    import threading

    def engine_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "omni-trio-sync"]

    cfg = scripted_pipeline(["a"], outputs=1)
    with omni_trio.sync.open_engine(cfg) as engine:
        (thread,) = engine_threads()
        assert not thread.daemon
        assert engine.statistics().requests_in_flight == 0
    assert not thread.is_alive() and engine_threads() == []


def test_sync_session_turn_barge_in_detach_and_resume():
    cfg = scripted_pipeline(["a", "b"], outputs=3)
    with omni_trio.sync.open_engine(cfg) as engine:
        with engine.open_session("s") as session:
            receipt = session.append([5, 6], operation_id="op")
            assert session.append([5, 6], operation_id="op") == receipt
            assert session.commit() == "s/turn-0"
            events = []
            for event in session.events():
                events.append(event)
                if isinstance(event, omni_trio.ResponseDone):
                    break
            assert [e.token_ids[0] for e in events if isinstance(e, omni_trio.ResponseDelta)] == [
                7,
                8,
                7,
            ]
            assert events[-1].status == "completed"
            assert session.barge_in() == 0
            assert session.fence == omni_trio.Fence(1, 1)
            with pytest.raises(omni_trio.StaleFenceError):
                session.append([1], fence=(0, 1))
            token = session.detach()
        assert engine.statistics().sessions == 1
        with engine.resume_session("s", token, last_seq=events[-1].seq) as again:
            assert again.statistics().lease_state == "attached"
        assert engine.statistics().sessions == 0
        assert engine.statistics().requests_in_flight == 0
