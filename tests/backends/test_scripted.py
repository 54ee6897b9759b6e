import pytest
import trio
import trio.lowlevel
import trio.testing

from omni_trio import ConfigError, ReplicaDeadError, StageError, load_config
from omni_trio.backends.scripted import ScriptedBackend, scripted_tokens
from omni_trio.outputs import StageInput
from omni_trio.stages import StageAborted
from omni_trio.stages.input_stream import collect_input


def backend(**options):
    c = load_config({"stages": [{"id": "a", "final_output": True, "options": options}]})
    return ScriptedBackend(c.stages[0], stage_index=0)


def channel(*chunks):
    send, receive = trio.open_memory_channel(len(chunks) or 1)
    for c in chunks:
        send.send_nowait(c)
    send.close()
    return receive


def test_scripted_tokens_pure():
    assert scripted_tokens([10, 20], 3) == [11, 21, 11]
    assert scripted_tokens([], 2, offset=5) == [5, 6]


async def run(b, rid, *chunks, params=None, outs=None):
    """Run one request; its outputs (also appended to ``outs`` as they come)."""
    outs = [] if outs is None else outs

    async def emit(o):
        outs.append(o)

    await b.run_request(rid, channel(*chunks), params, emit)
    return outs


async def run_whole(b, rid, *chunks, outs=None):
    """Run a request nobody streams (``streamed=False``): [(trio time, output)], also
    appended to ``outs`` as they come."""
    outs = [] if outs is None else outs

    async def emit(o):
        outs.append((trio.current_time(), o))

    await b.run_request(rid, channel(*chunks), None, emit, streamed=False)
    return outs


async def test_outputs_latency_and_records(autojump_clock):
    b = backend(outputs=3, latency_s=2.0, token_offset=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        t0 = trio.current_time()
        outs = await run(b, "r", StageInput(token_ids=(1, 2)))
        assert trio.current_time() - t0 == pytest.approx(6.0)
        assert [o.token_ids for o in outs] == [(101,), (102,), (101,)]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        # metrics once per request, on the finished output only
        # (and the prompt's ids, as a vllm stage's finished output carries them)
        assert [o.metrics for o in outs] == [
            None,
            None,
            {"output_index": 2, "prompt_token_ids": (1, 2)},
        ]
        assert b.received["r"][0].token_ids == (1, 2)
        assert b.completed == ["r"]
        outs = await run(b, "r2", StageInput(token_ids=(1,)), params={"max_tokens": 1})
        assert len(outs) == 1 and outs[0].finished
        assert b.statistics().requests_finished == 2
        nursery.cancel_scope.cancel()
    assert not b.alive


async def test_outputs_nobody_streams_go_out_whole_at_the_last_outputs_time(autojump_clock):
    # as a vllm stage asks vLLM for FINAL_ONLY: one finished output, every token and the
    # whole text, when the streamed run's last output comes
    b = backend(outputs=3, latency_s=2.0, token_offset=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        t0 = trio.current_time()
        chunk = StageInput(token_ids=(1, 2))
        ((at, out),) = await run_whole(b, "r", chunk)
        assert at - t0 == pytest.approx(6.0)
        assert out.token_ids == (101, 102, 101) and out.text == "a:101 a:102 a:101 "
        assert out.finished and out.finish_reason == "length"
        assert out.metrics == {"output_index": 2, "prompt_token_ids": (1, 2)}
        streamed = await run(b, "s", chunk)
        assert tuple(t for o in streamed for t in o.token_ids) == out.token_ids
        assert "".join(o.text for o in streamed) == out.text
        assert b.statistics().requests_finished == 2
        nursery.cancel_scope.cancel()


async def test_a_stop_ends_a_whole_output_request_with_its_tokens_so_far(autojump_clock):
    b = backend(outputs=10, latency_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)

        async def stop_later():
            await trio.sleep(3.5)
            assert await b.interact("r", {"stop": True})

        nursery.start_soon(stop_later)
        ((_, out),) = await run_whole(b, "r", StageInput(token_ids=(5,)))
        assert out.token_ids == (6, 6, 6) and out.finish_reason == "stop" and out.finished
        nursery.cancel_scope.cancel()


async def test_a_whole_output_request_that_fails_emits_nothing(autojump_clock):
    b = backend(outputs=5, latency_s=1.0, fail_at_output=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        outs = []
        with pytest.raises(StageError, match="fail at output 3"):
            await run_whole(b, "r", StageInput(token_ids=(1,)), outs=outs)
        assert outs == [] and b.statistics().requests_failed == 1
        assert b.statistics().requests_in_flight == 0
        nursery.cancel_scope.cancel()


async def test_fail_at_output_is_request_scoped(autojump_clock):
    b = backend(outputs=5, fail_at_output=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        with pytest.raises(StageError, match="fail at output 1"):
            await run(b, "r", StageInput(prompt="x"))
        assert b.alive and b.statistics().requests_failed == 1
        assert b.requests_in_flight == 0
        nursery.cancel_scope.cancel()


async def test_abort_stops_the_outputs_where_they_are(autojump_clock):
    b = backend(outputs=10, latency_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        errors = []
        emitted = []

        async def runner():
            try:
                await run(b, "r", StageInput(prompt="abcdef"), outs=emitted)
            except StageAborted as exc:
                errors.append(exc)

        nursery.start_soon(runner)
        await trio.sleep(3.5)
        await b.abort("r")
        assert [o.token_ids[0] for o in emitted] == [ord(c) + 1 for c in "abc"]
        assert b.requests_in_flight == 0
        assert b.aborted == ["r"]
        await trio.lowlevel.checkpoint()
        assert len(errors) == 1
        await b.abort("unknown")  # a no-op
        nursery.cancel_scope.cancel()


async def test_crash_kills_every_bound_request(autojump_clock):
    b = backend(outputs=10, latency_s=1.0, crash_at_request=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        failures = []

        async def runner(rid):
            try:
                await run(b, rid, StageInput(prompt="x"))
            except ReplicaDeadError as exc:
                failures.append(exc.request_id)

        nursery.start_soon(runner, "r1")
        nursery.start_soon(runner, "r2")
        await trio.sleep(1.5)
        nursery.start_soon(runner, "r3")
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(failures) == ["r1", "r2", "r3"]
        assert not b.alive
        with pytest.raises(ReplicaDeadError, match="is dead"):
            await run(b, "r4", StageInput(prompt="x"))
        assert "dead" in repr(b)
        nursery.cancel_scope.cancel()


async def test_start_faults(autojump_clock):
    b = backend(fail_start=True)
    async with trio.open_nursery() as nursery:
        with pytest.raises(StageError, match="fail_start"):
            await nursery.start(b.serve)
    b = backend(start_delay_s=7.0, stop_delay_s=2.0)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        await nursery.start(b.serve)
        assert trio.current_time() - t0 == pytest.approx(7.0)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - t0 == pytest.approx(9.0)


def test_bad_options():
    with pytest.raises(ConfigError, match=r"options\.outputs: Expected `int` >= 1, got int 0"):
        backend(outputs=0)
    with pytest.raises(ConfigError, match=r"options\.shutdown_timeout: .* stage key"):
        backend(shutdown_timeout=3)
    with pytest.raises(ConfigError, match=r"options\.record: Expected `int` >= 0, got int -1"):
        backend(record=-1)


async def test_records_keep_the_last_entries(autojump_clock):
    assert backend().options.record_limit == 10_000
    b = backend(outputs=1, latency_s=1.0, record=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        for i in range(5):
            await run(b, f"r{i}", StageInput(token_ids=(i,)))
        assert b.completed == ["r2", "r3", "r4"] and len(b.completed) == 3
        assert list(b.received) == ["r2", "r3", "r4"]
        assert b.received["r4"][0].token_ids == (4,)
        for i in range(4):
            with trio.move_on_after(0.5):
                await run(b, f"x{i}", StageInput(token_ids=(1,)))
        assert b.aborted == ["x1", "x2", "x3"]
        assert b.completed == ["r2", "r3", "r4"]
        nursery.cancel_scope.cancel()


async def test_record_false_keeps_nothing(autojump_clock):
    b = backend(outputs=2, latency_s=1.0, record=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        outs = await run(b, "r", StageInput(token_ids=(7,)))
        assert [o.token_ids for o in outs] == [(8,), (8,)]  # still runs normally
        with trio.move_on_after(0.5):
            await run(b, "x", StageInput(token_ids=(1,)))
        assert not b.completed and not b.aborted and not b.received
        assert b.statistics().requests_finished == 1
        nursery.cancel_scope.cancel()


async def test_collect_input_merges_chunks():
    merged = await collect_input(
        channel(
            StageInput(token_ids=(1,), final=False),
            StageInput(token_ids=(2, 3), data="x", final=False),
            StageInput(final=True),
        )
    )
    assert merged.token_ids == (1, 2, 3) and merged.data == "x" and merged.final


async def test_a_hang_ends_with_a_stop_or_an_abort_and_never_both(autojump_clock):
    b = backend(outputs=3, hang=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        # a stop ends the hang: the finished output comes at once, empty
        nursery.start_soon(run, b, "stopped", StageInput(token_ids=(1,)))
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        assert await b.interact("stopped", {"stop": True})
        await trio.testing.wait_all_tasks_blocked()
        assert b.completed == ["stopped"] and trio.current_time() == t0
        # an abort, then a stop before the aborted task ran again: the abort wins and the
        # stop finds nothing to wake (waking the cancelled task again would crash the run)
        caller = trio.CancelScope()

        async def runner():
            with caller:  # cancelling the caller aborts the request
                await run(b, "aborted", StageInput(token_ids=(1,)))

        nursery.start_soon(runner)
        await trio.testing.wait_all_tasks_blocked()
        caller.cancel()  # delivered at once to the parked hang: no checkpoint in between
        await b.interact("aborted", {"stop": True})  # reaches the stop before it yields
        await trio.testing.wait_all_tasks_blocked()
        assert caller.cancelled_caught and b.aborted == ["aborted"]
        assert b.completed == ["stopped"] and b.requests_in_flight == 0
        assert b.statistics().requests_aborted == 1
        nursery.cancel_scope.cancel()


async def test_abort_delay_makes_a_cancelled_requests_cleanup_take_that_long(autojump_clock):
    b = backend(latency_s=1.0, abort_delay_s=30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        t0 = trio.current_time()
        with trio.move_on_after(2.5) as scope:
            await run(b, "r", StageInput(token_ids=(1,)))
        # the cancellation reached it at 2.5 s; its cleanup, shielded, took 30 s more
        assert scope.cancelled_caught
        assert trio.current_time() - t0 == pytest.approx(32.5)
        assert b.aborted == ["r"] and b.requests_in_flight == 0
        assert (await run(b, "s", StageInput(token_ids=(1,))))[-1].finished  # still serving
        nursery.cancel_scope.cancel()
    with pytest.raises(ConfigError, match=r"options\.abort_delay_s: Expected `float` >= 0"):
        backend(abort_delay_s=-1.0)


async def test_a_prefill_request_returns_kv_params_and_a_decode_may_require_them(autojump_clock):
    # standing in for a vLLM engine with a KV connector (omni_trio.config.pd): a request
    # asking for a remote decode finishes with kv_transfer_params naming replica and request
    asked = {
        "max_tokens": 1,
        "extra_args": {"kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"}},
    }
    b = backend(outputs=3, omit_kv_params_at_request=2, malformed_kv_params_at_request=3)
    strict = backend(require_kv_params=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        await nursery.start(strict.serve)
        chunk = StageInput(token_ids=(1, 2))
        (out,) = await run(b, "r1", chunk, params=asked)
        assert out.finished and out.metrics == {
            "output_index": 0,
            "prompt_token_ids": (1, 2),
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "scripted:a:0",
                "remote_request_id": "r1",
                "transfer_id": "t",
            },
        }
        (missing,) = await run(b, "r2", chunk, params=asked)  # its 2nd request: none
        assert "kv_transfer_params" not in missing.metrics
        (bad,) = await run(b, "r3", chunk, params=asked)  # its 3rd: not a mapping
        assert bad.metrics["kv_transfer_params"] == "not a mapping"
        plain = await run(b, "r4", chunk)  # no remote decode asked: nothing returned
        assert "kv_transfer_params" not in plain[-1].metrics
        with pytest.raises(StageError, match="requires kv_transfer_params with do_remote_prefill"):
            await run(strict, "d1", chunk, params={"max_tokens": 2})
        decode = {"extra_args": {"kv_transfer_params": {"do_remote_prefill": True}}}
        assert (await run(strict, "d2", chunk, params=decode))[-1].finished
        assert strict.sampling["d2"] == [decode]  # what it was given, recorded
        nursery.cancel_scope.cancel()
