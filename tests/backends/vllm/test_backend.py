"""The vllm backend against real AsyncLLM engines (tiny local models, CPU).

Each test is one engine session doing several checks (an engine start costs ~20 s). Token
equality is checked against a hand-driven asyncio AsyncLLM program run in a subprocess
(``vllm_reference.py``), started in parallel with the engine under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

import omni_trio
from omni_trio.backends.vllm.backend import THREAD_PREFIX, VllmBackend
from omni_trio.backends.vllm.worker import EngineWorker
from omni_trio.config import StageConfig
from omni_trio.errors import InvalidRequestError, ReplicaDeadError, StageError, StageStopError
from omni_trio.observer import EngineObserver, Transfer
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.stages import StageAborted
from omni_trio.testing import cancel_at_every_checkpoint, wait_until_settled

from ...conftest import bounded, engine_seconds, kill_tree

pytestmark = pytest.mark.vllm

REFERENCE = Path(__file__).with_name("vllm_reference.py")
THINKER = {"model": "tiny:thinker"}
TALKER = {"model": "tiny:talker"}
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["hello tiny world", "the river and the moon sing a song"]


# -- helpers ------------------------------------------------------------------------------
async def reference(stages: list[dict[str, Any]], prompts: list[Any], max_tokens: int) -> Any:
    spec = {"stages": stages, "prompts": prompts, "max_tokens": max_tokens}
    with bounded("the hand-driven reference run (a subprocess)", 300):
        proc = await trio.run_process(
            [sys.executable, str(REFERENCE), json.dumps(spec)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            deliver_cancel=kill_tree,  # and the reference's own EngineCore
        )
    for line in proc.stdout.decode().splitlines():
        if line.startswith("REFERENCE "):
            return json.loads(line.removeprefix("REFERENCE "))["results"]
    raise AssertionError(f"reference run failed: {proc.stderr.decode()[-3000:]}")


def leftover_engine_processes() -> list[psutil.Process]:
    """EngineCore/worker processes (spawned children) or zombies still under this process."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or any("spawn_main" in c for c in p.cmdline()):
                left.append(p)
        except psutil.NoSuchProcess:
            continue
    return left


def shared_memory_of(procs: list[psutil.Process]) -> set[str]:
    """The /dev/shm files (POSIX shared memory and named semaphores) ``procs`` map."""
    return {m.path for p in procs for m in p.memory_maps() if m.path.startswith("/dev/shm/")}


def still_there(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if os.path.exists(p))


def our_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(THREAD_PREFIX) or t.name.endswith("-build")
    ]


def one_chunk(chunk: StageInput) -> trio.MemoryReceiveChannel[StageInput]:
    tx, rx = trio.open_memory_channel[StageInput](1)
    tx.send_nowait(chunk)
    tx.close()
    return rx


async def run(
    backend: VllmBackend,
    rid: str,
    chunk: StageInput,
    sp: Any = None,
    *,
    streamed: bool = True,
    text: bool = True,
    slow: bool = False,
) -> list[StageOutput]:
    outs: list[StageOutput] = []

    async def emit(o: StageOutput) -> None:
        outs.append(o)
        if slow and len(outs) == 1:
            # a consumer slower than the engine: it takes its first output only once a
            # second, same-length request started after it has finished, i.e. once the
            # engine has generated all of this one; meanwhile it runs out of credit and the
            # rest waits (merged) in vLLM's collector, whatever the machine's speed
            await run(backend, f"{rid}-companion", chunk, sp)

    sp = sp if sp is not None else GREEDY
    await backend.run_request(rid, one_chunk(chunk), sp, emit, streamed=streamed, text=text)
    return outs


def tokens(outs: list[StageOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def stage(sid: str, engine_args: dict[str, Any], **kw: Any) -> StageConfig:
    return StageConfig(id=sid, backend="vllm", engine_args=engine_args, **kw)


def test_params_whose_text_nobody_reads_skip_detokenizing() -> None:
    # vLLM's detokenize=False for dict params when the text is not read, unless stop strings
    # (matched on the text) or the caller's own choice need it; a SamplingParams is the
    # caller's as it is
    from omni_trio.backends.vllm.process import import_vllm
    from omni_trio.backends.vllm.prompts import sampling_params

    v = import_vllm()
    greedy = {"max_tokens": 4, "temperature": 0.0}
    assert [sampling_params(v, greedy, final, False).detokenize for final in (True, False)] == [
        False,
        False,
    ]
    assert sampling_params(v, greedy, True).detokenize is True
    assert sampling_params(v, greedy, True, False) is not sampling_params(v, greedy, True)
    assert sampling_params(v, {**greedy, "stop": ["."]}, True, False).detokenize is True
    assert sampling_params(v, {**greedy, "detokenize": True}, True, False).detokenize is True
    given = v.SamplingParams(max_tokens=4, output_kind=v.FINAL_ONLY)
    assert sampling_params(v, given, True, False) is given


def test_a_pairs_params_become_vllms_with_the_kv_transfer_params_in_extra_args() -> None:
    # the request core's rewrite (omni_trio.request.pd) as dicts: vLLM takes them as they
    # are, kv_transfer_params where its scheduler reads them (SamplingParams.extra_args)
    from omni_trio.backends.vllm.process import import_vllm
    from omni_trio.backends.vllm.prompts import sampling_params
    from omni_trio.request.pd import decode_sampling_params, prefill_sampling_params

    v = import_vllm()
    asked = {**GREEDY, "max_tokens": 8, "stop": ["."]}
    prefill = sampling_params(v, prefill_sampling_params(asked, "r"), True, False)
    assert (prefill.max_tokens, prefill.min_tokens, prefill.stop) == (1, 1, [])
    assert prefill.extra_args == {
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "xfer-r",
        }
    }
    returned = {"remote_block_ids": [3], "remote_engine_id": "e", "do_remote_prefill": True}
    decode = sampling_params(v, decode_sampling_params(asked, returned, "r"), False)
    assert (decode.max_tokens, decode.stop) == (8, ["."])
    assert decode.extra_args["kv_transfer_params"]["remote_block_ids"] == [3]
    assert decode.output_kind == v.DELTA


async def abort_mid_stream(engine: omni_trio.Engine, prompt: str) -> list[int]:
    """A long thinker request aborted after its third output: the consumer gets exactly what
    abort() returns, then an abort terminal, and no engine of the thinker -> talker pipeline
    holds anything of it. Returns the aborted request's tokens."""
    long = {"thinker": {**GREEDY, "max_tokens": 200}}
    async with engine.generate(
        prompt, request_id="cut", final_stage_id="thinker", sampling_params=long
    ) as stream:
        seen = [await stream.receive() for _ in range(3)]
        partial = await engine.abort("cut")
        rest = [out async for out in stream]
    assert rest[-1].aborted and len(partial) >= 3
    assert [o.token_ids for o in seen + rest[:-1]] == [o.token_ids for o in partial]
    assert await engine.collective_rpc("get_num_unfinished_requests") == [0, 0]
    return [t for o in partial for t in o.token_ids]


async def cancel_a_chain_consumer_at_every_checkpoint(
    engine: omni_trio.Engine, prompt: str
) -> None:
    """A consumer of the thinker -> talker pipeline cancelled at each of its checkpoints
    (while its request is being submitted to a worker, aborted before the worker ran it,
    streaming, or being left) leaves nothing behind in either engine."""
    short = {**GREEDY, "max_tokens": 4}

    async def consumer(engine: omni_trio.Engine) -> None:
        params = {"thinker": short, "talker": short}
        async with engine.generate(prompt, sampling_params=params) as stream:
            async for _out in stream:
                pass

    report = await cancel_at_every_checkpoint(engine, consumer, run_timeout=engine_seconds(60))
    report.raise_if_failed()
    assert report.runs == report.checkpoints + 1 >= 6
    assert await engine.collective_rpc("get_num_unfinished_requests") == [0, 0]


# -- backend-level ------------------------------------------------------------------------
async def test_backend_streams_greedy_tokens_aborts_and_cleans_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="omni_trio.backends.vllm.process")
    threads_before = {t.name for t in threading.enumerate()}
    # a window of 2 outputs: a consumer slower than the engine stalls its request
    backend = VllmBackend(stage("thinker", THINKER, options={"output_buffer": 2}), stage_index=0)
    ref: list[Any] = []
    ref_done = trio.Event()
    async with trio.open_nursery() as nursery:

        async def get_reference() -> None:
            ref.extend(await reference([THINKER], PROMPTS, GREEDY["max_tokens"]))
            ref_done.set()

        nursery.start_soon(get_reference)
        with bounded("the engine's start", 180, backend):
            await nursery.start(backend.serve)
        assert backend.alive and len(backend.core_pids) == 1
        assert "alive" in repr(backend) and str(backend.core_pids[0]) in repr(backend)
        core = psutil.Process(backend.core_pids[0])
        shared = shared_memory_of([core, *core.children()])
        assert shared  # vLLM's message queues and the executor's semaphore

        # text prompts: streamed deltas, last one finished with vLLM's reason and metrics
        with bounded("the text prompts' outputs", 120, backend):
            by_text = [
                await run(backend, f"t{i}", StageInput(prompt=p)) for i, p in enumerate(PROMPTS)
            ]
        for outs in by_text:
            assert len(outs) > 1 and all(len(o.token_ids) >= 1 for o in outs)
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert outs[-1].finish_reason == "length"
            assert len(tokens(outs)) == GREEDY["max_tokens"]
            assert outs[-1].metrics is not None and outs[-1].metrics["num_generation_tokens"] == 24
        first = tokens(by_text[0])
        # a slow consumer: the request stalls (its deltas merge in vLLM) and resumes, and
        # nothing is lost; a request nobody streams gets one output, the whole of it
        with bounded("the slow consumer's and the unstreamed requests' outputs", 120, backend):
            slow = await run(backend, "slow", StageInput(prompt=PROMPTS[0]), slow=True)
            whole = await run(backend, "whole", StageInput(prompt=PROMPTS[0]), streamed=False)
            # ... and one whose text nobody reads is not detokenized: the same tokens, no text
            untexted = await run(
                backend, "untexted", StageInput(prompt=PROMPTS[0]), streamed=False, text=False
            )
        assert tokens(slow) == first and max(len(o.token_ids) for o in slow) > 1
        assert [tokens(whole), len(whole), whole[0].finished] == [first, 1, True]
        assert whole[0].metrics is not None and whole[0].text
        assert [tokens(untexted), len(untexted), untexted[0].text] == [first, 1, ""]
        # token-id and prompt-dict inputs continue the same greedy sequence
        # a vllm SamplingParams object is used as is (and forced to DELTA)
        from vllm.sampling_params import SamplingParams

        with bounded("the token-id, prompt-dict and SamplingParams requests", 120, backend):
            by_ids = await run(backend, "ids", StageInput(token_ids=tuple(first[:8])))
            by_dict = await run(backend, "dict", StageInput(data={"prompt_token_ids": first[:8]}))
            params = SamplingParams(**GREEDY)
            by_obj = await run(backend, "obj", StageInput(prompt=PROMPTS[0]), params)
        assert tokens(by_ids) == tokens(by_dict)
        assert tokens(by_obj) == first and len(by_obj) > 1

        # bad sampling params fail that request only, typed, naming the key
        with bounded("the refusals of bad sampling params", 60, backend):
            with pytest.raises(InvalidRequestError, match="max_tokenz"):
                await run(backend, "bad", StageInput(prompt="x"), {"max_tokenz": 3})
            with pytest.raises(InvalidRequestError, match="temperature"):
                await run(backend, "bad2", StageInput(prompt="x"), {"temperature": -1.0})

        # cancelling the caller mid-stream aborts in the engine before run_request returns
        long = {**GREEDY, "max_tokens": 200}
        seen: list[StageOutput] = []
        with bounded("'cancel-me', cancelled at its third output", 120, backend):
            with trio.CancelScope() as cancel:

                async def emit_then_cancel(o: StageOutput) -> None:
                    seen.append(o)
                    if len(seen) == 3:
                        cancel.cancel()

                await backend.run_request(
                    "cancel-me", one_chunk(StageInput(prompt=PROMPTS[1])), long, emit_then_cancel
                )
            assert cancel.cancelled_caught and len(seen) >= 3
            assert await backend.collective_rpc("get_num_unfinished_requests") == 0
        assert backend.requests_in_flight == 0

        # abort() stops the request where it is: what it emitted is a prefix of the full
        # greedy stream
        got_some = trio.Event()
        aborted: list[BaseException] = []
        doomed_outs: list[StageOutput] = []

        async def doomed() -> None:
            async def emit(o: StageOutput) -> None:
                doomed_outs.append(o)
                if len(doomed_outs) >= 3:
                    got_some.set()

            try:
                await backend.run_request(
                    "doomed", one_chunk(StageInput(prompt=PROMPTS[0])), long, emit
                )
            except StageAborted as exc:
                aborted.append(exc)

        # a replica death fails doomed(), which fails the nursery: no wait outlives it
        nursery.start_soon(doomed)
        with bounded("3 outputs of 'doomed', then its abort", 120, backend):
            await got_some.wait()
            await backend.abort("doomed")
        partial = list(doomed_outs)
        assert aborted and len(partial) >= 3 and not partial[-1].finished
        assert tokens(partial) == first[: len(tokens(partial))]

        # collective_rpc passes through to the engine's workers; control calls answer too
        with bounded("the control calls and collective_rpc", 60, backend):
            assert await backend.collective_rpc("get_num_unfinished_requests") == 0
            assert await backend.collective_rpc("engine_core_pids") == list(backend.core_pids)
            assert await backend.collective_rpc("check_health") is None
            ranks = await backend.collective_rpc("get_kv_connector_handshake_metadata")
        assert isinstance(ranks, list) and len(ranks) == 1  # one answer per worker rank
        stats = backend.statistics()
        assert stats.requests_in_flight == 0 and stats.requests_aborted == 2
        assert stats.requests_failed == 2 and stats.requests_finished >= 7

        with bounded("the reference run", 300):
            await ref_done.wait()  # the reference subprocess finishes in its own time
        nursery.cancel_scope.cancel()

    # same greedy tokens as the hand-driven AsyncLLM
    assert [tokens(o) for o in by_text] == [r[0] for r in ref]
    # nothing left: no EngineCore, no worker thread, no shared memory; and the EngineCore
    # exited by itself after SIGTERM (exit code 0), it was not killed
    assert leftover_engine_processes() == []
    assert [p.exitcode for p in backend._worker._procs] == [0]  # type: ignore[union-attr]
    assert still_there(shared) == []
    assert our_threads() == []
    new = {t.name for t in threading.enumerate()} - threads_before - {"tqdm_monitor"}
    assert {n for n in new if not n.startswith("Trio thread")} == set()
    assert not backend.alive and "stopped" in repr(backend)
    # the engine's stop is logged (debug) where it begins and ends, with its EngineCore's pid
    # and monotonic times: what bench_vllm_pipeline tells an engine's own stop by
    stops = [r for r in caplog.records if hasattr(r, "stop_phase")]
    assert [(r.stop_phase, r.core_pids) for r in stops] == [
        ("begin", tuple(backend.core_pids)),
        ("end", tuple(backend.core_pids)),
    ]
    assert stops[0].t < stops[1].t <= time.monotonic()


async def test_killed_engine_core_fails_only_its_replica() -> None:
    cfg = stage("thinker", THINKER, options={"cpu_bind": ["0", "1"]})
    b0, b1 = (VllmBackend(cfg, stage_index=0, replica=r) for r in (0, 1))
    b0_returned = trio.Event()
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:

        async def serve0(*, task_status: trio.TaskStatus[None]) -> None:
            await b0.serve(task_status=task_status)
            b0_returned.set()

        with bounded("both engines' start", 240, b0, b1):
            async with trio.open_nursery() as starters:  # both engines start at once
                starters.start_soon(nursery.start, serve0)
                starters.start_soon(nursery.start, b1.serve)
        assert b0.alive and b1.alive and b0.core_pids != b1.core_pids
        # per-engine CPU binding: each engine's model worker is pinned to its own core
        affinities = []
        for b in (b0, b1):
            workers = psutil.Process(b.core_pids[0]).children()
            affinities.append(sorted({c for w in workers for c in w.cpu_affinity()}))
        if os.cpu_count() and os.cpu_count() >= 2:
            assert affinities == [[0], [1]], affinities

        long = {**GREEDY, "max_tokens": 200}

        async def on_b0() -> None:
            victim: list[StageOutput] = []

            async def emit(o: StageOutput) -> None:
                victim.append(o)
                if len(victim) == 2:
                    os.kill(b0.core_pids[0], signal.SIGKILL)

            try:
                await b0.run_request("victim", one_chunk(StageInput(prompt="hi")), long, emit)
            except ReplicaDeadError as exc:
                errors.append(exc)

        survivor: list[StageOutput] = []

        async def on_b1() -> None:
            survivor.extend(await run(b1, "survivor", StageInput(prompt="hi"), long))

        with bounded("'victim' killed with its EngineCore, and 'survivor' to its end", 180, b0, b1):
            async with trio.open_nursery() as reqs:
                reqs.start_soon(on_b0)
                reqs.start_soon(on_b1)
        with bounded("the dead replica's serve() to return", 60, b0):
            await b0_returned.wait()  # the dead replica's serve() returned by itself
        assert len(errors) == 1 and errors[0].replica == 0
        assert not b0.alive and "dead" in repr(b0)
        assert b1.alive and len(tokens(survivor)) == 200 and survivor[-1].finished
        with bounded("a request to each replica after the death", 60, b0, b1):
            with pytest.raises(ReplicaDeadError):
                await run(b0, "after", StageInput(prompt="hi"))
            assert len(await run(b1, "after", StageInput(prompt="hi"))) > 1
        nursery.cancel_scope.cancel()
    assert leftover_engine_processes() == []
    assert our_threads() == []


def break_abort_of(backend: VllmBackend, request_id: str) -> None:
    """Make the backend's real AsyncLLM fail to abort ``request_id`` (fault injection: the
    one way a request's own task can raise)."""
    engine = backend._worker.engine  # type: ignore[union-attr]
    real_abort = engine.abort

    async def abort(rid: Any, *args: Any, **kwargs: Any) -> Any:
        if rid == request_id:
            raise RuntimeError(f"abort of {rid} broke")
        return await real_abort(rid, *args, **kwargs)

    engine.abort = abort


async def run_held(
    backend: VllmBackend, request_id: str, settled: trio.Event, errors: list[BaseException]
) -> None:
    """A long request whose consumer takes its first output and no more, so it stays in
    flight until something else ends it; how it ended (aborted, or its replica's death)
    goes to ``errors``. ``settled`` is set at its first output, or when it ended without
    one (its engine died): see :func:`wait_held`."""

    async def emit(o: StageOutput) -> None:
        settled.set()
        await trio.sleep_forever()

    long = {**GREEDY, "max_tokens": 400}
    try:
        await backend.run_request(request_id, one_chunk(StageInput(prompt="hi")), long, emit)
    except (StageAborted, ReplicaDeadError) as exc:
        errors.append(exc)
    finally:
        settled.set()


async def wait_held(
    backend: VllmBackend, request_id: str, settled: trio.Event, errors: list[BaseException]
) -> None:
    """Wait (bounded) until the :func:`run_held` request is in flight, its first output
    taken; fail at once, with its engine's error, if it ended before that."""
    with bounded(f"the first output of {request_id!r}", 120, backend):
        await settled.wait()
    if errors:
        raise AssertionError(f"{request_id!r} ended before its first output") from errors[0]


async def test_a_request_vllm_could_not_drop_kills_the_replica_or_fails_its_stop() -> None:
    cfg = stage("thinker", THINKER, options={"cpu_bind": ["0", "1"]})
    b0, b1 = (VllmBackend(cfg, stage_index=0, replica=r) for r in (0, 1))
    b0_returned = trio.Event()
    stop1 = trio.CancelScope()
    stop_errors: list[StageStopError] = []
    long = {**GREEDY, "max_tokens": 400}
    async with trio.open_nursery() as nursery:

        async def serve0(*, task_status: trio.TaskStatus[None]) -> None:
            await b0.serve(task_status=task_status)
            b0_returned.set()

        async def serve1(*, task_status: trio.TaskStatus[None]) -> None:
            try:
                with stop1:
                    await b1.serve(task_status=task_status)
            except StageStopError as exc:
                stop_errors.append(exc)

        with bounded("both engines' start", 240, b0, b1):
            async with trio.open_nursery() as starters:  # both engines start at once
                starters.start_soon(nursery.start, serve0)
                starters.start_soon(nursery.start, serve1)
        break_abort_of(b0, "doomed")
        break_abort_of(b1, "held")

        # 1. while serving: the request is aborted, vLLM cannot drop it, the replica dies of it
        doomed_ended: list[BaseException] = []
        first = trio.Event()

        async def abort_after_first() -> None:
            await first.wait()
            await b0.abort("doomed")

        async def emit(o: StageOutput) -> None:
            # a consumer that takes no more: the request cannot finish before its abort,
            # however fast the engine
            first.set()
            await trio.sleep_forever()

        with bounded("'doomed' to start, be aborted and end", 120, b0):
            async with trio.open_nursery() as pair:
                pair.start_soon(abort_after_first)
                try:
                    await b0.run_request("doomed", one_chunk(StageInput(prompt="hi")), long, emit)
                except (StageAborted, ReplicaDeadError) as exc:
                    doomed_ended.append(exc)
                # ended without a first output (its engine died first): no abort will come
                pair.cancel_scope.cancel()
        assert first.is_set(), f"'doomed' ended before its first output: {doomed_ended!r}"
        assert doomed_ended, "'doomed' finished although it was aborted"
        with bounded("the dead replica's serve() to return", 60, b0):
            await b0_returned.wait()  # the replica's serve() returned by itself
        death = b0.death
        assert isinstance(death, ReplicaDeadError) and not b0.alive
        assert "request 'doomed' could not be dropped: RuntimeError" in str(death)
        assert isinstance(death.__cause__, RuntimeError)

        # 2. while stopping: the request in flight cannot be dropped, the stop fails with it
        held_settled = trio.Event()
        held_errors: list[BaseException] = []
        nursery.start_soon(run_held, b1, "held", held_settled, held_errors)
        await wait_held(b1, "held", held_settled, held_errors)
        stop1.cancel()
    assert len(held_errors) == 1
    (stop_error,) = stop_errors
    failed = stop_error.__cause__
    assert isinstance(failed, StageError)
    assert "1 request task(s) failed while the worker stopped" in str(failed)
    assert isinstance(failed.__cause__, RuntimeError) and "held" in str(failed.__cause__)
    assert leftover_engine_processes() == []
    assert our_threads() == []


async def test_a_crash_of_the_worker_loop_kills_the_replica_caused_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fault injection: the worker's main coroutine ends with an error while a request is in
    # flight (its engine is shut down first, as any end of the worker does)
    triggers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    real_main = EngineWorker._main

    async def main(worker: EngineWorker) -> None:
        loop = asyncio.get_running_loop()
        crash = asyncio.Event()
        triggers.append((loop, crash))
        inner = loop.create_task(real_main(worker))
        waiter = loop.create_task(crash.wait())
        await asyncio.wait({inner, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if inner.done():
            waiter.cancel()
            return inner.result()
        inner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await inner
        raise OSError("the worker's loop broke")

    monkeypatch.setattr(EngineWorker, "_main", main)
    backend = VllmBackend(stage("thinker", THINKER), stage_index=0)
    returned = trio.Event()
    failures: list[BaseException] = []
    async with trio.open_nursery() as nursery:

        async def serve(*, task_status: trio.TaskStatus[None]) -> None:
            await backend.serve(task_status=task_status)  # a stop failure would raise here
            returned.set()

        with bounded("the engine's start", 180, backend):
            await nursery.start(serve)
        settled = trio.Event()
        nursery.start_soon(run_held, backend, "r", settled, failures)  # in flight when it breaks
        await wait_held(backend, "r", settled, failures)
        ((loop, crash),) = triggers
        loop.call_soon_threadsafe(crash.set)
        with bounded("the crashed replica's serve() to return", 60, backend):
            await returned.wait()  # the replica's serve() returned by itself
    death = backend.death
    assert isinstance(death, ReplicaDeadError) and not backend.alive
    assert "worker's loop crashed: OSError: the worker's loop broke" in str(death)
    assert isinstance(death.__cause__, OSError)
    assert len(failures) == 1 and backend.statistics().requests_in_flight == 0
    assert leftover_engine_processes() == []
    assert our_threads() == []


async def test_cancelled_start_kills_the_half_built_engine() -> None:
    backend = VllmBackend(stage("thinker", THINKER), stage_index=0)
    async with trio.open_nursery() as nursery:
        with trio.move_on_after(6) as start_scope:
            await nursery.start(backend.serve)
        t_cancel = time.perf_counter()
    assert start_scope.cancelled_caught and not backend.alive
    assert time.perf_counter() - t_cancel < 30  # bounded, not the ~20 s of a full start
    assert leftover_engine_processes() == []
    assert our_threads() == []


# -- engine-level -------------------------------------------------------------------------
async def test_a_killed_engine_core_fails_only_its_requests_and_is_restarted() -> None:
    config = {
        "stages": [
            {
                "id": "thinker",
                "backend": "vllm",
                "engine_args": THINKER,
                "final_output": True,
                "default_sampling_params": GREEDY,
                "replicas": 2,
                "restart": "on-failure",
                "restart_backoff_s": 0.5,
                "options": {"cpu_bind": ["0", "1"]},
            }
        ]
    }
    long = {"thinker": {**GREEDY, "max_tokens": 200}}
    async with omni_trio.open_engine(config) as engine:
        pool = engine.pools["thinker"]
        old_pids = [list(b.core_pids) for b in pool.replicas]
        results: dict[str, object] = {}
        streaming: set[str] = set()
        all_streaming = trio.Event()

        async def one(rid: str) -> None:
            try:
                async with engine.generate("hi", request_id=rid, sampling_params=long) as stream:
                    async for _out in stream:
                        streaming.add(rid)
                        if len(streaming) == 4:
                            all_streaming.set()
            except ReplicaDeadError as exc:
                results[rid] = exc
                if rid not in streaming:  # no wait below would end: fail now, with why
                    raise AssertionError(f"{rid!r} failed before its first output") from exc
            else:
                results[rid] = "ok"

        with bounded("4 requests streaming, then the 2 on the killed replica failing", 180, engine):
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, f"r{i}")
                await all_streaming.wait()
                bound = {rid: pool.replica_of(rid) for rid in streaming}
                victims = {rid for rid, b in bound.items() if b is not None and b.replica == 0}
                assert len(victims) == 2  # least_loaded spread them 2 + 2
                os.kill(pool.replica(0).core_pids[0], signal.SIGKILL)
        failed = {rid for rid, r in results.items() if r != "ok"}
        assert failed == victims
        assert all(getattr(results[rid], "replica", None) == 0 for rid in failed)
        with bounded("the killed replica's restart", 180, engine):
            await wait_until_settled(engine)
        stats = pool.statistics()
        assert [r.state for r in stats.replicas] == ["ready", "ready"]
        assert [(r.restarts, r.failures) for r in stats.replicas] == [(1, 1), (0, 0)]
        assert "EngineCore" in (stats.replicas[0].last_error or "")
        assert list(pool.replica(0).core_pids) != old_pids[0]
        assert engine.check_health().status == "ok"
        # later requests use both replicas again
        before = [r.requests_finished for r in stats.replicas]
        short = {"thinker": {**GREEDY, "max_tokens": 8}}
        with bounded("4 requests after the restart", 120, engine):
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(
                        lambda rid: engine.generate(
                            "hi", request_id=rid, sampling_params=short
                        ).collect(),
                        f"later{i}",
                    )
        after = [r.requests_finished for r in pool.statistics().replicas]
        assert after[0] > before[0] and after[1] > before[1]
        assert engine.statistics().stage_requests_in_flight == 0
    assert leftover_engine_processes() == []
    assert our_threads() == []


async def test_open_engine_one_and_two_stage_pipelines_match_hand_driven() -> None:
    config = {
        "name": "tiny-llm-chain",
        # a window of 2 outputs per request: a consumer that lags fills it (backpressure);
        # while it has room, outputs go straight on from the replica's demultiplexer
        "output_buffer": 2,
        "stages": [
            {
                "id": "thinker",
                "backend": "vllm",
                "engine_args": THINKER,
                "final_output": True,
                "default_sampling_params": GREEDY,
                "options": {"cpu_bind": "0"},
            },
            {
                "id": "talker",
                "backend": "vllm",
                "inputs": ["thinker"],
                "engine_args": TALKER,
                "final_output": True,
                "output_type": "tokens",
                "default_sampling_params": GREEDY,
                "options": {"cpu_bind": "1"},
            },
        ],
    }
    ref: list[Any] = []
    async with trio.open_nursery() as refs:

        async def get_reference() -> None:
            ref.extend(await reference([THINKER, TALKER], PROMPTS, GREEDY["max_tokens"]))

        refs.start_soon(get_reference)
        got: dict[tuple[int, str], list[int]] = {}
        one_stage: list[list[int]] = []
        slow: list[int] = []
        cut: list[int] = []
        async with omni_trio.open_engine(config) as engine:
            with bounded("the two-stage and one-stage outputs of each prompt", 180, engine):
                for i, prompt in enumerate(PROMPTS):
                    async with engine.generate(prompt, request_id=f"chain-{i}") as stream:
                        async for out in stream:
                            got.setdefault((i, out.stage_id), []).extend(out.token_ids)
                    # the one-stage pipeline: stop after the thinker
                    toks: list[int] = []
                    async for out in engine.generate(
                        prompt, request_id=f"one-{i}", final_stage_id="thinker"
                    ):
                        assert out.stage_id == "thinker"
                        toks.extend(out.token_ids)
                    one_stage.append(toks)
            # leaving a stream early aborts the request in every stage
            with bounded("a stream left at its first output, and its abort", 60, engine):
                async with engine.generate(PROMPTS[0], request_id="early") as stream:
                    async for _out in stream:
                        break
                unfinished = await engine.collective_rpc("get_num_unfinished_requests")
            assert unfinished == [0, 0]
            assert engine.statistics().stage_requests_in_flight == 0

            # a consumer slower than the engine (its window fills: outputs wait in the
            # request's task, then vLLM's collector) gets the same tokens, in order
            with bounded("the slow consumer's outputs", 120, engine):
                async for out in engine.generate(
                    PROMPTS[0], request_id="slow", final_stage_id="thinker"
                ):
                    slow.extend(out.token_ids)
                    await trio.sleep(0.02)
            with bounded("3 outputs of 'cut', its abort and its terminal", 120, engine):
                cut = await abort_mid_stream(engine, PROMPTS[0])
            with bounded("a consumer cancelled at each of its checkpoints", 400, engine):
                await cancel_a_chain_consumer_at_every_checkpoint(engine, PROMPTS[1])
    assert leftover_engine_processes() == []
    assert our_threads() == []
    for i in range(len(PROMPTS)):
        assert got[(i, "thinker")] == ref[i][0]
        assert got[(i, "talker")] == ref[i][1]
        assert one_stage[i] == ref[i][0]
    assert slow == ref[0][0]
    n = min(len(cut), len(ref[0][0]))
    assert n >= 3 and cut[:n] == ref[0][0][:n]  # greedy: a prefix of the same stream


async def test_per_request_options_reach_vllm() -> None:
    # One request at a time (max_num_seqs: 1) under vLLM's priority scheduling: requests
    # waiting behind a long one start in priority order (lower first), not arrival order.
    # Each option is observed on vLLM's side: the scheduler's order (priority), the request
    # stats vLLM keeps (arrival_time), the prompt vLLM tokenized (tokenization_kwargs), and
    # vLLM's own refusal of a LoRA on an engine without LoRA (lora_request).
    from vllm.lora.request import LoRARequest

    config = {
        "stages": [
            {
                "id": "thinker",
                "backend": "vllm",
                "engine_args": {**THINKER, "scheduling_policy": "priority", "max_num_seqs": 1},
                "final_output": True,
                "default_sampling_params": {**GREEDY, "max_tokens": 4},
            }
        ]
    }
    long = {**GREEDY, "max_tokens": 200}
    arrival = time.time() - 1000.0
    async with omni_trio.open_engine(config) as engine:
        started: list[str] = []
        finished: dict[str, omni_trio.OmniOutput] = {}
        blocker_runs = trio.Event()

        async def consume(stream: Any) -> None:
            async with stream:
                async for out in stream:
                    if out.request_id not in started:
                        started.append(out.request_id)
                        blocker_runs.set()
                    if out.finished:
                        finished[out.request_id] = out

        with bounded("the blocker, the 3 requests behind it and the LoRA refusal", 180, engine):
            async with trio.open_nursery() as nursery:
                blocker = engine.generate(PROMPTS[1], "blocker", long, priority=-10)
                nursery.start_soon(consume, blocker)
                await blocker_runs.wait()  # everything after it waits in vLLM
                for rid, priority, options in [
                    ("low", 5, {"arrival_time": arrival}),
                    ("high", -3, {"tokenization_kwargs": {"truncate_prompt_tokens": 2}}),
                    ("mid", 1, {"trace_headers": {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}}),
                ]:
                    nursery.start_soon(
                        consume, engine.generate(PROMPTS[1], rid, priority=priority, **options)
                    )
                # a LoRA reaches vLLM, which refuses it: this engine has no LoRA enabled
                with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
                    lora = LoRARequest("adapter", 1, "/nonexistent/adapter")
                    await engine.generate("x", "lora", lora_request=lora).collect()
        # arrival order was low, high, mid: vLLM ran them by priority
        assert started == ["blocker", "high", "mid", "low"]
        assert finished["low"].metrics is not None
        assert finished["low"].metrics["arrival_time"] == pytest.approx(arrival)
        assert finished["mid"].metrics is not None
        assert finished["mid"].metrics["arrival_time"] > arrival + 900
        # the prompt was truncated where vLLM tokenized it
        assert finished["high"].metrics is not None
        assert finished["high"].metrics["num_prompt_tokens"] == 2
        assert finished["mid"].metrics["num_prompt_tokens"] > 2
        assert all(out.finish_reason == "length" for out in finished.values())


class _Handoffs(EngineObserver):
    """When the thinker handed each chunk to the talker, and when the thinker ended."""

    routes_stages = False  # requests take the paths they take unobserved

    def __init__(self) -> None:
        self.handoffs: list[float] = []
        self.thinker_done = float("inf")

    def transfer_sent(self, request_id: str, transfer: Transfer, t: float) -> None:
        if (transfer.source, transfer.target) == ("thinker", "talker"):
            self.handoffs.append(t)

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        if stage_id == "thinker":
            self.thinker_done = t


async def test_streaming_input_reaches_vllm_as_it_comes() -> None:
    config = {
        "stages": [
            {
                "id": "thinker",
                "backend": "vllm",
                "engine_args": THINKER,
                "final_output": True,
                "default_sampling_params": {**GREEDY, "max_tokens": 4},
                "options": {"cpu_bind": "0"},
            },
            {
                "id": "talker",
                "backend": "vllm",
                "inputs": ["thinker"],
                "stream_input": True,
                "engine_args": TALKER,
                "final_output": True,
                "output_type": "tokens",
                "default_sampling_params": {**GREEDY, "max_tokens": 2},
                "options": {"cpu_bind": "1"},
            },
        ]
    }
    async with omni_trio.open_engine(config) as engine:
        # a streaming-input request: its first output comes while its input is still open
        with bounded("the streaming-input request's outputs", 120, engine):
            async with engine.generate(
                "hello", final_stage_id="thinker", streaming_input=True
            ) as stream:
                first = await stream.receive()
                assert first.stage_id == "thinker" and first.token_ids and not first.finished
                await stream.send_input(" tiny world")
                await stream.end_input()
                rest = [out async for out in stream]
        assert rest[-1].finished
        # vLLM's resumable request: up to max_tokens new tokens per segment
        assert len(tokens([first, *rest])) == 8
        # a stream_input talker gets the thinker's deltas as they come, not its whole answer
        # at its end (whether the talker's own first output beats the thinker's end is a
        # race between the two engines, not the feature)
        seen = _Handoffs()
        engine.add_observer(seen)
        order: list[tuple[str, bool]] = []
        long = {"thinker": {**GREEDY, "max_tokens": 48}}
        with bounded("the stream_input talker's outputs", 120, engine):
            async with engine.generate("the river", sampling_params=long) as stream:
                async for out in stream:
                    order.append((out.stage_id, out.finished))
            unfinished = await engine.collective_rpc("get_num_unfinished_requests")
        assert order.count(("thinker", False)) >= 1 and order[-1] == ("talker", True)
        assert len(seen.handoffs) >= 2, seen.handoffs
        assert seen.handoffs[0] < seen.thinker_done
        assert unfinished == [0, 0]
        assert engine.statistics().stage_requests_in_flight == 0
    assert leftover_engine_processes() == []
    assert our_threads() == []
