"""Live sessions on scripted stages under MockClock: turns, full duplex, barge-in, fences,
dedupe, admission, leases, detach and resume, failure domains, engine close."""

import pytest
import trio
import trio.testing

from omni_trio import (
    EngineClosedError,
    InvalidRequestError,
    ReplicaDeadError,
    ResponseDelta,
    ResponseDone,
    ResponseStarted,
    SessionBackpressureError,
    SessionClosed,
    SessionClosedError,
    SessionExistsError,
    SessionLimitError,
    SessionResumeError,
    StageError,
    StaleFenceError,
    open_engine,
)
from omni_trio.observer import EngineObserver
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
    scripted_pipeline,
)


def pipeline(**options):
    engine_options = options.pop("engine_options", {})
    stage_options = options.pop("stage_options", None)
    replicas = options.pop("replicas", 1)
    return scripted_pipeline(
        ["a", "b"],
        stream_input=True,
        engine_options=engine_options,
        stage_options=stage_options,
        replicas=replicas,
        **options,
    )


class RequestInfos(EngineObserver):
    """The trace headers each request was admitted with."""

    def __init__(self):
        self.headers = {}

    def request_info(self, request_id, info, t):
        self.headers[request_id] = info.trace_headers


def sessions_config(**limits):
    return {"sessions": limits}


async def read_until(session, predicate):
    """Events up to and including the first one ``predicate`` accepts."""
    seen = []
    async for event in session.events():
        seen.append(event)
        if predicate(event):
            return seen
    raise AssertionError(f"the events ended before the one awaited: {seen}")


def done_of(response_id):
    return lambda e: isinstance(e, ResponseDone) and e.response_id == response_id


def assert_all_closed(engine):
    assert engine.statistics().sessions == 0
    assert_nothing_in_flight(engine)


# -- turns -------------------------------------------------------------------------------------


async def test_append_commit_streams_the_response_then_closed_last(autojump_clock):
    async with open_engine(pipeline(outputs=3, latency_s=0.1)) as engine:
        async with engine.open_session("s") as session:
            assert (session.session_id, session.epoch, session.turn_id) == ("s", 0, 0)
            receipt = await session.append([10, 20])
            assert (receipt.turn_id, receipt.epoch, receipt.index) == (0, 0, 0)
            assert session.statistics().pending_input_bytes == 8
            await session.append("a")  # a second chunk of the same turn
            assert await session.commit() == "s/turn-0"
            assert session.turn_id == 1
            events = await read_until(session, done_of("s/turn-0"))
        assert isinstance(events[0], ResponseStarted)
        assert (events[0].turn_id, events[0].epoch) == (0, 0)
        deltas = [e for e in events if isinstance(e, ResponseDelta)]
        # the last stage's outputs: the input's tokens, one hop per stage
        assert [d.token_ids for d in deltas] == [(12,), (22,), (99,)]
        assert events[-1].status == "completed" and events[-1].error is None
        seqs = [e.seq for e in events]
        assert seqs == sorted(set(seqs)) and seqs[0] == 1
        stats = session.statistics()
        assert stats.state == "closed" and stats.responses_completed == 1
        received = scripted_backends(engine, "a")[0].received["s/turn-0"]
        # both chunks, in order (its 3 outputs came before it needed the end of its input)
        assert [(c.token_ids, c.prompt) for c in received] == [((10, 20), None), ((), "a")]
        # the closed session's events end with SessionClosed
        rest = [e async for e in session.events()]
        assert isinstance(rest[-1], SessionClosed) and rest[-1].reason == "closed"
        assert_all_closed(engine)


async def test_a_commit_after_the_response_ended_on_its_own_ends_that_turn(autojump_clock):
    # two outputs: the stage answers as soon as two input tokens arrived, before any commit
    async with open_engine(pipeline(outputs=2)) as engine:
        async with engine.open_session("s") as session:
            await session.append([5, 6, 7])
            await read_until(session, done_of("s/turn-0"))
            assert session.turn_id == 1  # the ended turn let appends go to the next one
            # the commit that was on its way still names that turn's response, once
            assert await session.commit() == "s/turn-0"
            with pytest.raises(InvalidRequestError, match="nothing to commit, turn 1"):
                await session.commit()
            # the same with the ended turn's fence; the current turn's fence finds no input
            await session.append([1, 2])
            await read_until(session, done_of("s/turn-1"))
            with pytest.raises(InvalidRequestError, match="nothing to commit, turn 2"):
                await session.commit(fence=(0, 2))
            assert await session.commit(fence=(0, 1)) == "s/turn-1"
            with pytest.raises(StaleFenceError, match="carries turn 1"):
                await session.commit(fence=(0, 1))
            # a later turn with input is what a commit ends from then on
            await session.append([3, 4])
            await read_until(session, done_of("s/turn-2"))
            await session.append([9])
            assert await session.commit() == "s/turn-3"
            await read_until(session, done_of("s/turn-3"))
            stats = session.statistics()
            assert (stats.responses_completed, stats.responses_failed) == (4, 0)
        assert_all_closed(engine)


async def test_a_barge_in_forgets_a_turn_that_ended_before_its_commit(autojump_clock):
    async with open_engine(pipeline(outputs=2)) as engine:
        async with engine.open_session("s") as session:
            await session.append([5, 6])
            await read_until(session, done_of("s/turn-0"))
            assert await session.barge_in() == 0
            with pytest.raises(InvalidRequestError, match="nothing to commit"):
                await session.commit()
        assert_all_closed(engine)


async def test_open_and_close_are_idempotent_and_calls_after_close_are_refused(autojump_clock):
    async with open_engine(pipeline(outputs=2)) as engine:
        async with engine.open_session() as session:
            assert len(session.session_id) == 32  # generated
            await session.aclose()
            await session.aclose()
            assert engine.statistics().sessions == 0
            with pytest.raises(SessionClosedError, match=r"is closed \(closed\)"):
                await session.append("x")
            with pytest.raises(SessionClosedError):
                await session.commit()
            with pytest.raises(SessionClosedError):
                await session.barge_in()
            with pytest.raises(SessionClosedError):
                session.update(sampling_params={"max_tokens": 1})
            with pytest.raises(SessionClosedError):
                await session.detach()
        closed = [e for e in [e async for e in session.events()] if isinstance(e, SessionClosed)]
        assert len(closed) == 1
        # the same id opens again once the first is gone
        async with engine.open_session(session.session_id) as again:
            assert again.statistics().state == "open"
        assert engine.statistics().requests_total == 0
        assert_all_closed(engine)


async def test_the_next_turn_is_appended_while_a_response_streams(autojump_clock):
    async with open_engine(pipeline(outputs=4, latency_s=1.0)) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.commit()
            await read_until(session, lambda e: isinstance(e, ResponseDelta))
            # full duplex: turn 1 starts while turn 0 still streams
            receipt = await session.append([7])
            assert receipt.turn_id == 1
            assert session.statistics().responses_in_flight == 2
            await session.commit()
            events = await read_until(session, done_of("s/turn-1"))
        by_response = {}
        for e in events:
            if isinstance(e, ResponseDelta):
                by_response.setdefault(e.response_id, []).append(e.token_ids[0])
        assert set(by_response["s/turn-1"]) == {9}
        assert set(by_response["s/turn-0"]) == {3}
        assert session.statistics().responses_completed == 2
        assert_all_closed(engine)


async def test_bad_input_is_refused_and_changes_nothing(autojump_clock):
    async with open_engine(pipeline(outputs=2)) as engine:
        with pytest.raises(InvalidRequestError, match="unknown session setting"):
            async with engine.open_session(config={"temperature": 1}):
                pass
        with pytest.raises(InvalidRequestError, match="session_id must be"):
            async with engine.open_session(""):
                pass
        async with engine.open_session("s") as session:
            with pytest.raises(InvalidRequestError, match="empty string"):
                await session.append("")
            with pytest.raises(InvalidRequestError, match="nothing to commit"):
                await session.commit()
            with pytest.raises(InvalidRequestError, match="unknown session setting"):
                session.update(voice="x")
            with pytest.raises(InvalidRequestError, match="output_modalities"):
                session.update(output_modalities="text")
            with pytest.raises(InvalidRequestError, match="fence"):
                await session.append("x", fence=(0,))
            stats = session.statistics()
            assert (stats.turn_id, stats.responses_total, stats.last_seq) == (0, 0, 0)
            # and the session still works
            await session.append("x")
            await session.commit()
            await read_until(session, done_of("s/turn-0"))
        assert engine.statistics().requests_total == 1
        assert_all_closed(engine)


async def test_update_changes_later_turns_only(autojump_clock):
    async with open_engine(pipeline(outputs=6, latency_s=1.0)) as engine:
        async with engine.open_session("s", config={"sampling_params": {"max_tokens": 4}}) as s:
            await s.append([1])
            await s.commit()
            s.update(sampling_params={"max_tokens": 2})
            await s.append([2])
            await s.commit()
            events = await read_until(s, done_of("s/turn-1"))
            events += (
                await read_until(s, done_of("s/turn-0"))
                if s.statistics().responses_in_flight
                else []
            )
        count = {}
        for e in events:
            if isinstance(e, ResponseDelta):
                count[e.response_id] = count.get(e.response_id, 0) + 1
        assert count == {"s/turn-0": 4, "s/turn-1": 2}
        assert_all_closed(engine)


# -- barge-in ----------------------------------------------------------------------------------


async def test_barge_in_cancels_every_stage_at_once_and_nothing_old_reaches_the_new_turn(
    autojump_clock,
):
    async with open_engine(pipeline(outputs=50, latency_s=1.0, abort_delay_s=3.0)) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.commit()
            await read_until(session, lambda e: isinstance(e, ResponseDelta))
            # an open (uncommitted) turn is cancelled too
            await session.append([5])
            start = trio.current_time()
            assert await session.barge_in() == 2
            # it returned once every stage dropped both requests (their slow aborts included)
            assert trio.current_time() - start == pytest.approx(3.0)
            assert (session.epoch, session.turn_id) == (1, 2)
            for stage in ("a", "b"):
                aborted = scripted_backends(engine, stage)[0].aborted
                assert set(aborted) >= {"s/turn-0", "s/turn-1"}
            assert engine.statistics().requests_in_flight == 0
            await session.append([9])
            await session.commit()
            events = await read_until(session, done_of("s/turn-2"))
        dones = {e.response_id: e for e in events if isinstance(e, ResponseDone)}
        assert dones["s/turn-0"].status == dones["s/turn-1"].status == "cancelled"
        cancelled_at = max(dones["s/turn-0"].seq, dones["s/turn-1"].seq)
        late = [
            e
            for e in events
            if e.seq > cancelled_at and getattr(e, "response_id", "s/turn-2") != "s/turn-2"
        ]
        assert late == []
        started = [e for e in events if isinstance(e, ResponseStarted)]
        assert (started[-1].turn_id, started[-1].epoch) == (2, 1)
        assert session.statistics().responses_cancelled == 2
        assert_all_closed(engine)


async def test_barge_in_with_nothing_in_flight_advances_the_epoch(autojump_clock):
    async with open_engine(pipeline(outputs=2)) as engine:
        async with engine.open_session("s") as session:
            assert await session.cancel_response() == 0
            assert (session.epoch, session.turn_id) == (1, 0)
        assert_all_closed(engine)


async def test_cancel_at_every_checkpoint_of_turns_and_a_barge_in(autojump_clock):
    cfg = pipeline(outputs=4, latency_s=0.5)

    async def scenario(engine):
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.commit()
            await read_until(session, lambda e: isinstance(e, ResponseDelta))
            await session.barge_in()
            await session.append([2])
            await session.append([3])
            await session.commit()
            await read_until(session, done_of("s/turn-1"))

    def no_session_left(engine):
        assert engine.statistics().sessions == 0

    async with open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=no_session_left)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 10
        assert_all_closed(engine)


# -- fences and dedupe -------------------------------------------------------------------------


async def test_stale_fences_are_refused_with_no_effect(autojump_clock):
    async with open_engine(pipeline(outputs=20, latency_s=1.0)) as engine:
        async with engine.open_session("s") as session:
            fence = session.fence
            await session.append([1], fence=fence)
            await session.append([2], fence=(0, 0))
            await session.commit(fence=fence)
            before = session.statistics()
            with pytest.raises(StaleFenceError, match="turn 0, the session's current turn is 1"):
                await session.append([3], fence=fence)
            with pytest.raises(StaleFenceError):
                await session.commit(fence=fence)
            assert session.statistics() == before
            assert engine.statistics().requests_total == 1
            with pytest.raises(StaleFenceError, match="epoch 5"):
                await session.barge_in(fence=(5, 1))
            assert session.statistics() == before  # still streaming, same epoch
            await session.barge_in(fence=(0, 0))  # a cancel checks the epoch only
            assert session.epoch == 1
            with pytest.raises(StaleFenceError, match="barge-in moved it on"):
                await session.append([4], fence=(0, 1))
            with pytest.raises(StaleFenceError):
                await session.barge_in(fence=fence)
            assert session.epoch == 1
        assert engine.statistics().requests_total == 1
        assert_all_closed(engine)


async def test_a_retried_operation_is_applied_once_with_equal_replies(autojump_clock):
    async with open_engine(pipeline(outputs=8, latency_s=1.0)) as engine:
        async with engine.open_session("s") as session:
            first = await session.append([1], operation_id="op-1")
            again = await session.append([1], operation_id="op-1")
            assert first == again
            second = await session.append([2], operation_id="op-2")
            assert second.index == 1
            # a concurrent retry of an append in progress is also applied once
            async with trio.open_nursery() as nursery:
                replies = []

                async def send():
                    replies.append(await session.append([3], operation_id="op-3"))

                nursery.start_soon(send)
                nursery.start_soon(send)
            assert replies[0] == replies[1] and replies[0].index == 2
            assert session.statistics().pending_input_bytes == 12
            await session.commit()
            await read_until(session, done_of("s/turn-0"))
        received = scripted_backends(engine, "a")[0].received["s/turn-0"]
        assert [c.token_ids for c in received if c.token_ids] == [(1,), (2,), (3,)]
        assert_all_closed(engine)


# -- bounds ------------------------------------------------------------------------------------


async def test_pending_input_bytes_and_turns_raise(autojump_clock):
    limits = sessions_config(max_pending_input_bytes=10, max_pending_turns=1)
    async with open_engine(pipeline(outputs=20, latency_s=1.0, engine_options=limits)) as engine:
        async with engine.open_session("s") as session:
            await session.append([1, 2])
            with pytest.raises(SessionBackpressureError, match="max_pending_input_bytes"):
                await session.append([3])
            assert session.statistics().pending_input_bytes == 8
            await session.commit()
            with pytest.raises(SessionBackpressureError, match="max_pending_turns"):
                await session.append([4])
            assert engine.statistics().requests_total == 1
            await session.barge_in()
            await session.append([5])  # the cancelled response no longer counts
            await session.commit()
        assert_all_closed(engine)


async def test_a_reader_that_lags_holds_the_response_back(autojump_clock):
    limits = sessions_config(journal_events=4)
    async with open_engine(pipeline(outputs=30, engine_options=limits)) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.commit()
            await trio.sleep(100)
            stats = session.statistics()
            # ResponseStarted and the deltas let in: the journal bound, not the 30 outputs
            assert stats.last_seq <= 1 + 4 and stats.responses_in_flight == 1
            events = await read_until(session, done_of("s/turn-0"))
            assert len([e for e in events if isinstance(e, ResponseDelta)]) == 30
            assert session.statistics().journal_events <= 4 + 1
        assert_all_closed(engine)


async def test_a_client_that_never_reads_cannot_grow_the_journal_turn_after_turn(autojump_clock):
    limits = sessions_config(journal_events=6)
    async with open_engine(pipeline(outputs=1, engine_options=limits)) as engine:
        async with engine.open_session("s") as session:
            refused = None
            for turn in range(20):  # start a turn, cancel it, and never read an event
                try:
                    await session.append([turn])
                except SessionBackpressureError as exc:
                    refused = (turn, exc)
                    break
                await session.barge_in()
            assert refused is not None, "twenty unread turns were let in"
            turn, exc = refused
            assert "journal_events" in str(exc) and turn == 3  # 2 events a turn: 6 held
            stats = session.statistics()
            assert stats.journal_events <= 6 + 1 and stats.responses_in_flight == 0
            # reading makes room: the next turn goes in
            events = [e async for e in _take(session.events(), stats.last_seq)]
            assert len(events) == stats.last_seq
            await session.append([99])
            await session.commit()
            await read_until(session, done_of(f"s/turn-{turn}"))
        assert_all_closed(engine)


async def _take(events, n):
    async for event in events:
        yield event
        n -= 1
        if not n:
            return


# -- admission ---------------------------------------------------------------------------------


async def test_max_sessions_holds_under_a_thousand_concurrent_opens(autojump_clock):
    limits = sessions_config(max_sessions=50)
    async with open_engine(pipeline(outputs=1, engine_options=limits)) as engine:
        opened, refused, peak = [], [], [0]
        release = trio.Event()

        async def client(i):
            try:
                async with engine.open_session(f"c{i}") as session:
                    opened.append(session)
                    peak[0] = max(peak[0], engine.statistics().sessions)
                    await release.wait()
            except SessionLimitError as exc:
                assert exc.retryable
                refused.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(client, i)
            await trio.testing.wait_all_tasks_blocked()
            assert (len(opened), len(refused), peak[0]) == (50, 950, 50)
            release.set()
        assert engine.statistics().sessions == 0
        # the slots came back: a new one opens
        async with engine.open_session("late"):
            pass
        assert_all_closed(engine)


async def test_a_duplicate_id_is_refused_without_touching_the_first(autojump_clock):
    async with open_engine(pipeline(outputs=3, latency_s=1.0)) as engine:
        async with engine.open_session("s") as first:
            await first.append([1])
            with pytest.raises(SessionExistsError, match="'s' is already open"):
                async with engine.open_session("s"):
                    pass
            assert first.attached and first.statistics().responses_in_flight == 1
            await first.commit()
            events = await read_until(first, done_of("s/turn-0"))
            assert events[-1].status == "completed"
        assert_all_closed(engine)


async def test_a_slow_stage_cleanup_keeps_the_slot_and_blocks_no_other_session(autojump_clock):
    limits = sessions_config(max_sessions=2)
    cfg = pipeline(outputs=50, latency_s=1.0, abort_delay_s=20.0, engine_options=limits)
    async with open_engine(cfg) as engine:
        async with trio.open_nursery() as nursery:
            slow = None

            async def close_slow(task_status=trio.TASK_STATUS_IGNORED):
                nonlocal slow
                async with engine.open_session("slow") as slow:
                    await slow.append([1])
                    task_status.started()
                # the block's exit waits for the stages' slow abort

            await nursery.start(close_slow)
            await trio.sleep(1)
            # the slow session's stages are still dropping its request: it holds its slot
            assert slow is not None and slow.statistics().state == "closing"
            config = {"sampling_params": {"max_tokens": 3}}
            async with engine.open_session("other", config=config) as other:
                await other.append([2])
                await other.commit()
                await read_until(other, done_of("other/turn-0"))
                # done while the slow cleanup goes on: it waited for nothing of it
                assert slow.statistics().state == "closing"
                assert engine.statistics().sessions == 2
                with pytest.raises(SessionLimitError):
                    async with engine.open_session("third"):
                        pass
        assert engine.statistics().sessions == 0
        assert slow is not None and slow.statistics().state == "closed"
        assert_all_closed(engine)


# -- leases ------------------------------------------------------------------------------------


async def test_an_idle_session_expires_and_activity_renews_it(autojump_clock):
    limits = sessions_config(idle_timeout_s=10.0)
    async with open_engine(pipeline(outputs=2, engine_options=limits)) as engine:
        async with engine.open_session("s") as session:
            await trio.sleep(8)
            session.touch()
            await trio.sleep(8)
            assert session.attached  # 16 s in, 8 since the touch
            events = [e async for e in session.events()]
            assert trio.current_time() == pytest.approx(18.0)
            assert isinstance(events[-1], SessionClosed)
            assert events[-1].reason == "idle_timeout"
            assert engine.statistics().sessions == 0
            with pytest.raises(SessionClosedError, match="idle_timeout"):
                await session.append("x")
        assert_all_closed(engine)


async def test_detach_then_resume_replays_and_a_stale_token_loses(autojump_clock):
    limits = sessions_config(detach_grace_s=5.0)
    async with open_engine(pipeline(outputs=3, engine_options=limits)) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.commit()
            seen = await read_until(session, lambda e: isinstance(e, ResponseDelta))
            token = await session.detach()
            assert not session.attached
            with pytest.raises(SessionClosedError, match="was detached"):
                await session.append([2])
        # leaving the detached handle's block did not close the session
        assert engine.statistics().sessions == 1
        with pytest.raises(SessionResumeError, match="stale"):
            async with engine.resume_session("s", "1.wrong", last_seq=seen[-1].seq):
                pass
        with pytest.raises(SessionResumeError, match="not open"):
            async with engine.resume_session("nope", token):
                pass
        await trio.sleep(4)  # within the grace
        async with engine.resume_session("s", token, last_seq=seen[-1].seq) as resumed:
            assert resumed.statistics().lease_state == "attached"
            # the same token again: used, so stale
            with pytest.raises(SessionResumeError, match="not detached"):
                async with engine.resume_session("s", token):
                    pass
            replayed = await read_until(resumed, done_of("s/turn-0"))
            assert replayed[0].seq == seen[-1].seq + 1
            assert [type(e) for e in replayed] == [ResponseDelta, ResponseDelta, ResponseDone]
            # a second detach: the first token is stale now
            token2 = await resumed.detach()
        with pytest.raises(SessionResumeError, match="stale"):
            async with engine.resume_session("s", token):
                pass
        async with engine.resume_session("s", token2, last_seq=replayed[-1].seq) as again:
            await again.append([4])
        assert_all_closed(engine)


async def test_turns_continue_the_trace_of_who_opened_or_last_resumed_the_session(
    autojump_clock,
):
    opener = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    resumer = {"traceparent": "00-5bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01"}
    limits = sessions_config(detach_grace_s=5.0)
    async with open_engine(pipeline(outputs=2, engine_options=limits)) as engine:
        infos = RequestInfos()
        engine.add_observer(infos)
        async with engine.open_session("s", trace_headers=opener) as session:
            await session.append([1])
            await session.commit()
            events = await read_until(session, done_of("s/turn-0"))
            token = await session.detach()
        async with engine.resume_session(
            "s", token, last_seq=events[-1].seq, trace_headers=resumer
        ) as resumed:
            await resumed.append([2])
            await resumed.commit()
            await read_until(resumed, done_of("s/turn-1"))
        assert infos.headers == {"s/turn-0": opener, "s/turn-1": resumer}
        assert_all_closed(engine)


async def test_two_resumers_with_one_token_one_wins(autojump_clock):
    async with open_engine(pipeline(outputs=2)) as engine:
        async with engine.open_session("s") as session:
            token = await session.detach()
        outcomes = []

        async def resume():
            try:
                async with engine.resume_session("s", token) as handle:
                    outcomes.append("won")
                    await handle.detach()
            except SessionResumeError:
                outcomes.append("lost")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(resume)
            nursery.start_soon(resume)
        assert sorted(outcomes) == ["lost", "won"]
        await trio.sleep(60)  # the winner detached again: its grace ends
        assert engine.statistics().sessions == 0


async def test_a_detached_session_closes_after_its_grace(autojump_clock):
    limits = sessions_config(detach_grace_s=5.0)
    async with open_engine(pipeline(outputs=50, latency_s=1.0, engine_options=limits)) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            token = await session.detach()
        detached_at = trio.current_time()
        await trio.sleep(4.9)
        assert engine.statistics().sessions == 1
        await trio.sleep(0.1)
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == detached_at + 5
        assert engine.statistics().sessions == 0
        # once the session ended, even a detached handle sees how
        events = [e async for e in session.events()]
        assert events[-2].status == "cancelled"
        assert events[-1] == SessionClosed(seq=events[-1].seq, reason="detach_expired")
        with pytest.raises(SessionResumeError, match="not open"):
            async with engine.resume_session("s", token):
                pass
        assert scripted_backends(engine, "a")[0].aborted == ["s/turn-0"]
        assert_all_closed(engine)


async def test_close_racing_expiry_ends_the_session_once(autojump_clock):
    limits = sessions_config(idle_timeout_s=10.0)
    async with open_engine(pipeline(outputs=2, engine_options=limits)) as engine:
        for settle in (False, True):
            async with engine.open_session("s") as session:
                await trio.sleep_until(session._core.last_activity + 10.0)
                if settle:  # the lease timer went first
                    await trio.testing.wait_all_tasks_blocked()
                # else the close lands in the very tick the lease timer fires
                await session.aclose()
            events = [e async for e in session.events()]
            closed = [e for e in events if isinstance(e, SessionClosed)]
            assert len(closed) == 1 and events[-1] is closed[0]
            # in one tick trio runs the two in either order: one of them ends it, once
            assert closed[0].reason in (("idle_timeout",) if settle else ("idle_timeout", "closed"))
            assert engine.statistics().sessions == 0
        assert_all_closed(engine)


async def test_an_append_waiting_on_a_barged_in_turn_is_refused(autojump_clock):
    cfg = pipeline(outputs=10, latency_s=10.0, engine_options={"output_buffer": 1})
    async with open_engine(cfg) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.append([2])
            refused = []

            async def blocked_append():
                with pytest.raises(StaleFenceError, match="ended \\(cancelled\\)") as caught:
                    await session.append([3])
                refused.append(caught.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocked_append)
                await trio.testing.wait_all_tasks_blocked()
                assert session.statistics().pending_input_bytes == 8  # [3] not in yet
                await session.barge_in()
            assert len(refused) == 1
            assert session.statistics().pending_input_bytes == 0
        received = scripted_backends(engine, "a")[0].received["s/turn-0"]
        assert (3,) not in [c.token_ids for c in received]
        assert_all_closed(engine)


# -- failure domains ---------------------------------------------------------------------------


async def test_a_failing_turn_fails_that_response_only(autojump_clock):
    cfg = pipeline(outputs=4, stage_options={"a": {"fail_at_output": 2}})
    async with open_engine(cfg) as engine:
        async with engine.open_session("s") as session:
            await session.append([1])
            await session.commit()
            done = (await read_until(session, done_of("s/turn-0")))[-1]
            assert done.status == "failed" and isinstance(done.error, StageError)
            assert session.attached
            session.update(sampling_params={"max_tokens": 2})  # stops before output 2
            await session.append([2])
            await session.commit()
            assert (await read_until(session, done_of("s/turn-1")))[-1].status == "completed"
            assert session.statistics().responses_failed == 1
        assert_all_closed(engine)


async def test_a_dead_replica_closes_only_its_session(autojump_clock):
    cfg = pipeline(
        outputs=5,
        latency_s=1.0,
        replicas={"a": 2, "b": 1},
        stage_options={"a": {"crash_at_request": 1, "crash_replica": 1}},
    )
    async with open_engine(cfg) as engine:
        async with engine.open_session("ok") as ok, engine.open_session("doomed") as doomed:
            await ok.append([1])  # replica 0 of stage a
            await doomed.append([2])  # replica 1: it dies
            events = [e async for e in doomed.events()]
            assert isinstance(events[-2], ResponseDone) and events[-2].status == "failed"
            assert isinstance(events[-2].error, ReplicaDeadError)
            assert events[-1].reason == "replica_dead"
            assert isinstance(events[-1].error, ReplicaDeadError)
            assert engine.statistics().sessions == 1
            await ok.commit()
            assert (await read_until(ok, done_of("ok/turn-0")))[-1].status == "completed"
        assert_all_closed(engine)


async def test_engine_close_with_200_live_sessions_leaves_nothing(autojump_clock):
    cfg = pipeline(outputs=1000, latency_s=1.0)
    engine = open_engine(cfg)
    closed = []
    async with engine:
        async with trio.open_nursery() as nursery:

            async def client(i, task_status=trio.TASK_STATUS_IGNORED):
                async with engine.open_session(f"c{i}") as session:
                    await session.append([i % 250 + 1])
                    if i % 2:
                        await session.commit()
                    task_status.started()
                    events = [e async for e in session.events()]
                    closed.append(events[-1])

            for i in range(200):
                await nursery.start(client, i)
            assert engine.statistics().sessions == 200
            assert engine.statistics().requests_in_flight == 200
            with trio.fail_after(60):
                await engine.aclose()
            assert engine.statistics().sessions == 0
    assert len(closed) == 200
    assert {e.reason for e in closed} == {"engine_closed"}
    assert_all_closed(engine)
    with pytest.raises(EngineClosedError):
        async with engine.open_session("late"):
            pass


async def test_session_calls_always_checkpoint(autojump_clock):
    async with open_engine(pipeline(outputs=3)) as engine:
        async with engine.open_session("s") as session:
            for call in (
                lambda: session.append([1]),
                lambda: session.append([2], operation_id="x"),
                lambda: session.append([2], operation_id="x"),
                session.commit,
                session.barge_in,
            ):
                with trio.testing.assert_checkpoints():
                    await call()
            with trio.testing.assert_checkpoints(), pytest.raises(StaleFenceError):
                await session.append([1], fence=(9, 9))
            with trio.testing.assert_checkpoints():
                await session.detach()
        assert "this handle detached" in repr(session)
