"""The vllm stage option ``loop``: a stage whose engine's worker thread runs trio with
trio-asyncio's loop, beside a stage on the default asyncio loop in the same pipeline.

Fast: the option is checked at load, and a missing trio-asyncio is a typed error at start.
Real engines (marked ``vllm``): one pipeline, thinker on ``trio-asyncio`` then talker on
``asyncio``, shared by the tests of this module (an engine start costs ~25 s). It runs in a
trio loop of its own thread (an anyio blocking portal), since each test is its own
``trio.run``; each test runs its checks on that loop, bounded by ``GUARD_S``. The greedy
tokens are checked against a hand-driven asyncio AsyncLLM program (``vllm_reference.py``),
run in a subprocess while the engines start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from anyio.from_thread import BlockingPortal, start_blocking_portal

import omni_trio
from omni_trio import ConfigError, load_config
from omni_trio.backends.vllm.backend import VllmBackend
from omni_trio.backends.vllm.worker import EngineWorker
from omni_trio.config import StageConfig
from omni_trio.errors import BackendUnavailableError, EngineClosedError, InvalidRequestError
from omni_trio.testing import assert_nothing_in_flight

from .test_backend import (
    REFERENCE,
    abort_mid_stream,
    cancel_a_chain_consumer_at_every_checkpoint,
    leftover_engine_processes,
    our_threads,
)

THINKER = {"model": "tiny:thinker"}
TALKER = {"model": "tiny:talker"}
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
LONG = {**GREEDY, "max_tokens": 200}
# prompts of normal length (vLLM-CPU on AMX machines may die on very short ones)
PROMPTS = [
    "the tiny omni model sings a song about the river and the moon",
    "a long and winding road leads to the quiet village by the sea",
]
START_GUARD_S = 300.0  # hang guards only; no test asserts a duration
GUARD_S = 180.0

CONFIG: dict[str, Any] = {
    "name": "mixed-loops",
    "stages": [
        {
            "id": "thinker",
            "backend": "vllm",
            "engine_args": THINKER,
            "final_output": True,
            "default_sampling_params": GREEDY,
            "options": {"cpu_bind": "0", "loop": "trio-asyncio"},
        },
        {
            "id": "talker",
            "backend": "vllm",
            "inputs": ["thinker"],
            "engine_args": TALKER,
            "final_output": True,
            "output_type": "tokens",
            "default_sampling_params": GREEDY,
            "options": {"cpu_bind": "1"},  # the default loop: asyncio
        },
    ],
}


# -- fast ---------------------------------------------------------------------------------
def test_the_loop_option_is_checked_at_load() -> None:
    # a scripted entry stage: checking a valid vllm stage would import vllm (seconds)
    bad = json.loads(json.dumps(CONFIG))
    bad["stages"][0] = {"id": "thinker", "backend": "scripted"}
    bad["stages"][1]["options"]["loop"] = "trio_asyncio"
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.path == "$.stages[1].options.loop"
    assert "Expected one of 'asyncio', 'trio-asyncio', got str 'trio_asyncio'" in str(info.value)


async def test_a_missing_trio_asyncio_fails_the_start_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "trio_asyncio", None)
    backend = VllmBackend(StageConfig(**CONFIG["stages"][0]), stage_index=0)
    assert "loop=trio-asyncio" in repr(backend)
    with pytest.raises(BackendUnavailableError, match=r"install 'omni-trio\[trio-asyncio\]'"):
        await backend.serve()
    # refused before the worker thread (and vllm) started
    assert backend._thread is None and not backend.alive


# -- real engines, shared -----------------------------------------------------------------
@asynccontextmanager
async def open_bounded(config: dict[str, Any]) -> AsyncIterator[omni_trio.Engine]:
    """``open_engine`` whose start (only) is bounded by ``START_GUARD_S``."""
    with trio.CancelScope(deadline=trio.current_time() + START_GUARD_S) as start:
        async with omni_trio.open_engine(config) as engine:
            start.deadline = math.inf
            yield engine
    if start.cancelled_caught:
        raise AssertionError(f"the engines did not start within {START_GUARD_S} s")


class SharedEngine:
    """The module's engine in a trio loop of the portal's thread; :meth:`run` runs a check
    on that loop from a test's own trio loop. A test that closed it leaves the next one a
    new one."""

    def __init__(self, portal: BlockingPortal) -> None:
        self.portal = portal
        self._cm: Any = None
        self._engine: omni_trio.Engine | None = None
        self._reference: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def start_reference(self) -> None:
        """The hand-driven AsyncLLM program of both stages, in a subprocess (not waited)."""
        spec = {"stages": [THINKER, TALKER], "prompts": PROMPTS, "max_tokens": 24}
        self._reference = subprocess.Popen(
            [sys.executable, str(REFERENCE), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def reference(self) -> list[list[list[int]]]:
        """Its greedy tokens: ``[prompt][stage]``. Blocking."""
        assert self._reference is not None
        out, err = self._reference.communicate(timeout=GUARD_S)
        for line in out.splitlines():
            if line.startswith("REFERENCE "):
                results: list[list[list[int]]] = json.loads(line.removeprefix("REFERENCE "))[
                    "results"
                ]
                return results
        raise AssertionError(f"reference run failed: {err[-3000:]}")

    def engine(self) -> omni_trio.Engine:
        """The open engine, opened first if there is none. Blocking."""
        with self._lock:
            if self._engine is None:
                cm = self.portal.wrap_async_context_manager(open_bounded(CONFIG))
                self._engine = cm.__enter__()
                self._cm = cm
            return self._engine

    def close(self) -> None:
        """Close the engine (leave ``open_engine``), if open. Blocking."""
        with self._lock:
            cm, self._cm, self._engine = self._cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def start_soon(
        self, fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> concurrent.futures.Future[Any]:
        """Start ``fn(engine, *args)`` as a task of the engine's loop, outside the engine."""
        return self.portal.start_task_soon(fn, self.engine(), *args)

    async def run(self, check: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await check(engine, *args)`` on the engine's loop; its result, or what it raised.
        Cut short by ``GUARD_S`` (the check is then cancelled there)."""
        future = await trio.to_thread.run_sync(self.start_soon, check, *args)
        try:
            return await wait_for(future)
        finally:
            future.cancel()


async def wait_for(future: concurrent.futures.Future[Any]) -> Any:
    with trio.fail_after(GUARD_S):
        return await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedEngine]:
    with start_blocking_portal(backend="trio") as portal:
        engine = SharedEngine(portal)
        engine.start_reference()  # while the engines start
        try:
            engine.engine()
            yield engine
        finally:
            engine.close()


def replica(engine: omni_trio.Engine, stage: str) -> VllmBackend:
    backend = engine.pools[stage].replica(0)
    assert isinstance(backend, VllmBackend)
    return backend


def worker(engine: omni_trio.Engine, stage: str) -> EngineWorker:
    w = replica(engine, stage)._worker
    assert w is not None
    return w


def tokens_by_stage(outs: list[omni_trio.OmniOutput]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for out in outs:
        got.setdefault(out.stage_id, []).extend(out.token_ids)
    return got


async def unfinished(engine: omni_trio.Engine) -> list[int]:
    """Requests vLLM still holds, per stage."""
    return list(await engine.collective_rpc("get_num_unfinished_requests"))


@pytest.mark.vllm
async def test_greedy_tokens_equal_a_direct_asyncllm_on_either_loop(shared: SharedEngine) -> None:
    async def check(engine: omni_trio.Engine) -> Any:
        thinker, talker = worker(engine, "thinker"), worker(engine, "talker")
        assert (thinker.loop_kind, talker.loop_kind) == ("trio-asyncio", "asyncio")
        assert "loop=trio-asyncio" in repr(replica(engine, "thinker"))
        # each engine's worker runs on the loop its stage asked for
        loops = [type(w._host.loop).__module__.split(".")[0] for w in (thinker, talker)]
        assert loops == ["trio_asyncio", "asyncio"]
        chains, alone = [], []
        for i, prompt in enumerate(PROMPTS):
            chains.append(tokens_by_stage(await engine.generate(prompt, f"chain-{i}").collect()))
            one = await engine.generate(prompt, f"one-{i}", final_stage_id="thinker").collect()
            alone.append(tokens_by_stage(one)["thinker"])
        assert await unfinished(engine) == [0, 0]
        return chains, alone

    chains, alone = await shared.run(check)
    ref = await trio.to_thread.run_sync(shared.reference, abandon_on_cancel=True)
    for i in range(len(PROMPTS)):
        assert chains[i]["thinker"] == ref[i][0]  # the trio-asyncio stage
        assert chains[i]["talker"] == ref[i][1]  # fed by it, on asyncio
        assert alone[i] == ref[i][0]


@pytest.mark.vllm
async def test_vllms_own_executor_runs_on_the_trio_asyncio_loop(shared: SharedEngine) -> None:
    # a raw text prompt makes AsyncLLM tokenize it through loop.run_in_executor with vLLM's
    # own ThreadPoolExecutor, which trio-asyncio's loop refuses unless the host evens it out
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(**GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)

    async def raw(engine: Any) -> list[int]:
        final = None
        async for out in engine.generate(PROMPTS[0], params, "raw-prompt"):
            final = out
        assert final is not None and final.finished
        return list(final.outputs[0].token_ids)

    async def check(engine: omni_trio.Engine) -> tuple[list[int], list[int]]:
        w = worker(engine, "thinker")
        done = asyncio.run_coroutine_threadsafe(raw(w.engine), w._host.loop)
        direct = await wait_for(done)
        one = await engine.generate(PROMPTS[0], "rendered", final_stage_id="thinker").collect()
        assert await unfinished(engine) == [0, 0]
        return direct, tokens_by_stage(one)["thinker"]

    direct, through_omni = await shared.run(check)
    assert len(direct) == GREEDY["max_tokens"] and direct == through_omni


@pytest.mark.vllm
async def test_abort_mid_stream_and_bad_input_leave_nothing_in_either_engine(
    shared: SharedEngine,
) -> None:
    async def check(engine: omni_trio.Engine) -> None:
        full = tokens_by_stage(
            await engine.generate(PROMPTS[1], "full", final_stage_id="thinker").collect()
        )["thinker"]
        # aborted mid-stream on the trio-asyncio stage
        cut = await abort_mid_stream(engine, PROMPTS[1])
        n = min(len(cut), len(full))
        assert n >= 3 and cut[:n] == full[:n]  # greedy: a prefix of the same stream
        # leaving a two-stage stream early aborts the request in both engines
        async with engine.generate(PROMPTS[0], "early", {"thinker": LONG}) as stream:
            async for _out in stream:
                break
        assert await unfinished(engine) == [0, 0]
        # bad sampling params fail that request only, typed, naming the key
        with pytest.raises(InvalidRequestError, match="max_tokenz"):
            await engine.generate(PROMPTS[0], "bad", {"thinker": {"max_tokenz": 3}}).collect()
        after = await engine.generate(PROMPTS[1], "after", final_stage_id="thinker").collect()
        assert tokens_by_stage(after)["thinker"] == full

        # cancelled at each checkpoint, on its way to either worker included
        await cancel_a_chain_consumer_at_every_checkpoint(engine, PROMPTS[0])
        assert_nothing_in_flight(engine)
        stats = engine.statistics()
        assert stats.requests_in_flight == 0 and stats.stage_requests_in_flight == 0
        thinker = next(s for s in stats.stages if s.stage_id == "thinker")
        assert [r.requests_in_flight for r in thinker.replicas] == [0]

    await shared.run(check)


@pytest.mark.vllm
async def test_close_with_requests_in_flight_ends_them_and_leaves_no_thread(
    shared: SharedEngine,
) -> None:
    streaming = [threading.Event() for _ in range(3)]

    async def consume(
        engine: omni_trio.Engine, i: int, final_stage: str | None
    ) -> list[omni_trio.OmniOutput] | EngineClosedError:
        outs: list[omni_trio.OmniOutput] = []
        try:
            async with engine.generate(
                PROMPTS[i % 2], f"held-{i}", {"thinker": LONG}, final_stage_id=final_stage
            ) as stream:
                async for out in stream:
                    outs.append(out)
                    streaming[i].set()
        except EngineClosedError as exc:
            return exc
        return outs

    # in flight on the trio-asyncio stage alone, and through both stages
    consumers = [
        await trio.to_thread.run_sync(shared.start_soon, consume, i, stage)
        for i, stage in enumerate(["thinker", None, None])
    ]
    for event in streaming:
        with trio.fail_after(GUARD_S):
            await trio.to_thread.run_sync(event.wait, abandon_on_cancel=True)
    engine = await trio.to_thread.run_sync(shared.engine)
    with trio.fail_after(GUARD_S):
        await trio.to_thread.run_sync(shared.close, abandon_on_cancel=True)
    # every consumer got a terminal: an abort output of each stage it streams, or the close
    for future in consumers:
        ended = await wait_for(future)
        if isinstance(ended, EngineClosedError):
            continue
        finals = {o.stage_id for o in ended if o.finished}
        assert finals and all(o.finish_reason == "abort" for o in ended if o.finished)
    stats = await trio.to_thread.run_sync(shared.portal.call, engine.statistics)
    assert stats.closed and stats.requests_in_flight == 0
    # nothing left: no EngineCore, no worker thread (the trio-asyncio one included)
    assert leftover_engine_processes() == []
    assert our_threads() == []
