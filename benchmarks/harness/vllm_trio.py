"""The ``trio`` system of ``bench_vllm_pipeline.py``: the least a trio program pays to drive
the same engines, with no orchestrator. It measures the floor under omni-trio's design (vLLM
engines in worker threads, requests driven from one trio loop), not a product path.

Each stage's ``AsyncLLM`` lives in its own worker thread on a plain asyncio loop, hosted as
omni-trio hosts its engines' (``omni_trio.transport.loop_host.LoopHost``), built there one
after the other (the CPU binding is read from the environment when the engine spawns its
core). The ``shared`` system is the same program with every stage's
engine on one worker thread's loop (one vLLM host thread for the process instead of a thread
per engine): the two differ only in how many threads the engines' Python work runs on.

A request is one trio task: for each stage in turn it registers a trio memory channel, hands
the request to the stage's loop (``call_soon_threadsafe``) and reads its outputs, then feeds
the finished token ids to the next stage. In the worker thread each request is an asyncio task
that renders its prompt and iterates ``AsyncLLM.generate`` as the hand-driven program does;
what it yields is queued and sent to trio once per loop pass (``run_sync_soon``, one wake-up
per engine step), where each output goes to its request's channel. Nothing else: no admission,
no cancellation beyond the batch's nursery, no flow control, no statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import threading
import time
from functools import partial
from typing import Any

from omni_trio.transport.loop_host import LoopHost

from .vllm_cells import PROMPTS, bind_for, engine_args, stage_models
from .vllm_procs import descendants, engine_groups, measure_idle, stop_one_by_one

#: (request id, token ids, finished) as the worker sends them; a failure as (id, exc, True)
Item = tuple[str, Any, bool]
#: a stage: the host thread of its engine and the engine's index there
Stage = tuple["EngineHost", int]


class EngineHost:
    """AsyncLLMs on one asyncio loop in a worker thread: one stage's (``trio``) or every
    stage's (``shared``). ``stages`` are (model, ``VLLM_CPU_OMP_THREADS_BIND``) pairs."""

    def __init__(
        self, name: str, stages: list[tuple[str, str]], trio_token: Any, deliver: Any
    ) -> None:
        self.name = name
        self._stages = stages
        self._token = trio_token
        self._deliver = deliver
        self.engines: list[Any] = []
        self.host = LoopHost("asyncio", name=name)
        self._stopped: set[int] = set()
        self._built = threading.Event()
        self._pending: list[Item] = []
        self._tasks: list[set[asyncio.Task[None]]] = [set() for _ in stages]
        self._thread = threading.Thread(target=self._main, name=name)
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start the thread and wait (blocking) until its engines are built."""
        self._thread.start()
        self._built.wait()
        if self.error is not None:
            raise self.error

    def submit(self, k: int, request_id: str, prompt: Any, params: Any) -> None:
        """From trio: start a request on this host's engine ``k``. Thread-safe, never blocks."""
        self.host.call_soon_threadsafe(self._start, k, request_id, prompt, params)

    def stop_engine(self, k: int) -> None:
        """Shut engine ``k`` down in the thread (blocking); after the last one, join it."""
        self.host.submit(self._shutdown(k)).result()
        if len(self._stopped) == len(self.engines):
            self.host.stop()
            self._thread.join()

    def core_pids(self, k: int) -> tuple[int, ...]:
        manager = self.engines[k].engine_core.resources.engine_manager
        return tuple(p.pid for p in manager.processes)

    def _main(self) -> None:
        self.host.run(self._serve)

    async def _serve(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from omni_trio.models import resolve_model

        try:
            try:
                for model, bind in self._stages:
                    # read when the engine spawns its core: built one after the other
                    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
                    args = {**engine_args(model), "model": resolve_model(model)}
                    self.engines.append(AsyncLLM.from_engine_args(AsyncEngineArgs(**args)))
            except BaseException as exc:
                self.error = exc
                raise
            finally:
                self._built.set()
            await self.host.wait_for_stop()
        finally:
            # every engine built, also those before a failed build (stop_engine may have
            # stopped some already)
            for k in range(len(self.engines)):
                await self._shutdown(k)

    async def _shutdown(self, k: int) -> None:
        if k in self._stopped:
            return
        self._stopped.add(k)
        tasks = self._tasks[k]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.engines[k].shutdown()

    def _start(self, k: int, request_id: str, prompt: Any, params: Any) -> None:
        task = self.host.loop.create_task(
            self._request(self.engines[k], request_id, prompt, params)
        )
        tasks = self._tasks[k]
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    @staticmethod
    def _render(engine: Any, raw: Any) -> Any:
        # as the hand-driven program does: vLLM then needs no tokenizing executor thread
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        parsed = parse_model_prompt(engine.model_config, raw)
        (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
        return rendered

    async def _request(self, engine: Any, request_id: str, prompt: Any, params: Any) -> None:
        try:
            prompt = self._render(engine, prompt)
            async for out in engine.generate(prompt, params, request_id):
                self._post((request_id, out.outputs[0].token_ids, out.finished))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._post((request_id, exc, True))

    def _post(self, item: Item) -> None:
        if not self._pending:
            # after every request task of this loop pass (one engine step) has posted
            self.host.loop.call_soon(self._flush)
        self._pending.append(item)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        self._token.run_sync_soon(self._deliver, batch)


def run_trio(
    a: argparse.Namespace, child_result: Any, run_batches: Any, *, shared: bool = False
) -> dict[str, Any]:
    """Run the floor's batches: each engine on its own host thread, or (``shared``) all of
    them on one."""
    import trio
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(
            max_tokens=a.tokens, temperature=0.0, ignore_eos=True, output_kind=kind
        )

    inner, last = params(RequestOutputKind.FINAL_ONLY), params(RequestOutputKind.DELTA)
    channels: dict[str, Any] = {}  # request id -> the send side of its trio channel

    def deliver(batch: list[Item]) -> None:
        for rid, payload, finished in batch:
            send = channels[rid]
            send.send_nowait((payload, finished))
            if finished:
                del channels[rid]

    async def run_stage(stage: Stage, rid: str, prompt: Any, sp: Any) -> int | list[int]:
        """The stage's tokens of one request: their count for the last stage (``sp`` is
        ``last``), else the finished output's token ids."""
        send, receive = trio.open_memory_channel[tuple[Any, bool]](math.inf)
        channels[rid] = send
        host, k = stage
        host.submit(k, rid, prompt, sp)
        got, finished = 0, False
        while not finished:
            payload, finished = await receive.receive()
            if isinstance(payload, BaseException):
                raise payload
            if sp is not last:
                return list(payload)  # FINAL_ONLY: the one output is the finished one
            got += len(payload)
        return got

    async def one(stages: list[Stage], i: int, tag: str) -> int:
        prompt: Any = PROMPTS[i]
        for k, stage in enumerate(stages[:-1]):
            ids = await run_stage(stage, f"{tag}-{i}-{k}", prompt, inner)
            prompt = {"prompt_token_ids": ids}
        got = await run_stage(stages[-1], f"{tag}-{i}-{len(stages) - 1}", prompt, last)
        assert isinstance(got, int)
        return got

    async def main() -> dict[str, Any]:
        from omni_trio.backends.vllm.backend import THREAD_PREFIX

        token = trio.lowlevel.current_trio_token()
        specs = [
            (m, bind_for(a.child_layout, k)) for k, m in enumerate(stage_models(a.child_stages))
        ]
        # named like omni-trio's stage threads: thread_cpu counts them as engine threads
        if shared:
            hosts = [EngineHost(f"{THREAD_PREFIX}-floor", specs, token, deliver)]
            stages = [(hosts[0], k) for k in range(len(specs))]
        else:
            hosts = [
                EngineHost(f"{THREAD_PREFIX}-floor{k}", [s], token, deliver)
                for k, s in enumerate(specs)
            ]
            stages = [(host, 0) for host in hosts]
        idle = None
        t0 = time.perf_counter()
        try:
            for host in hosts:
                host.start()
            init_s = time.perf_counter() - t0

            async def batch(tag: str) -> list[int]:
                counts = [0] * a.requests

                async def count(i: int) -> None:
                    counts[i] = await one(stages, i, tag)

                async with trio.open_nursery() as nursery:
                    for i in range(a.requests):
                        nursery.start_soon(count, i)
                return counts

            timing = await run_batches(batch, a.requests, a.tokens, a.batches)
            if a.idle_s > 0:
                idle = await measure_idle(engine_groups(), trio.sleep, a.idle_s)
            procs = descendants()
        finally:
            built = [
                (host, k) for host, k in stages if host.error is None and k < len(host.engines)
            ]
            shutdown_s, stop = stop_one_by_one(
                [(host.core_pids(k), partial(host.stop_engine, k)) for host, k in built]
            )
        result: dict[str, Any] = child_result(timing, init_s, shutdown_s, procs, a, stop, idle)
        return result

    return trio.run(main)
