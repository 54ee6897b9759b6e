"""The torch backend with the real tiny vocoder in real worker threads.

Tests that wait on worker threads use the real clock (MockClock autojump would jump while a
thread runs); ``fail_after`` there is only a hang guard. The delay test uses a MockClock
without autojump, advanced by hand, so it asserts when the flush happens without sleeping.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
import trio.testing

from omni_trio.backends.torch.backend import TorchBackend, codes_of
from omni_trio.backends.torch.batching import Pending, chunk_spans, context_window, decide_batch
from omni_trio.backends.torch.worker import import_torch
from omni_trio.config import StageConfig
from omni_trio.config.options import parse_torch_options
from omni_trio.errors import BackendUnavailableError, ConfigError, StageError
from omni_trio.models.vocoder import build_vocoder
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.stages import StageAborted

from ...conftest import engine_seconds

GUARD_S = engine_seconds(60)  # hang guard only; no test asserts a duration


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omni-trio-cache")


@pytest.fixture(scope="module")
def vocoder(cache_dir: Path) -> torch.nn.Module:
    return build_vocoder({"weights": "tiny:code2wav", "cache_dir": str(cache_dir)})


def make_backend(cache_dir: Path, *, stream_input: bool = False, **options: Any) -> TorchBackend:
    opts = {"weights": "tiny:code2wav", "cache_dir": str(cache_dir), **options}
    config = StageConfig(id="code2wav", backend="torch", stream_input=stream_input, options=opts)
    return TorchBackend(config, stage_index=2)


@asynccontextmanager
async def serving(backend: TorchBackend) -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        yield nursery
        nursery.cancel_scope.cancel()


async def run_one(
    backend: TorchBackend,
    request_id: str,
    chunks: Sequence[StageInput],
    outs: list[StageOutput] | None = None,
) -> list[StageOutput]:
    """Run one request; its outputs (also appended to ``outs`` as they come)."""
    send, receive = trio.open_memory_channel[StageInput](len(chunks) + 1)
    for chunk in chunks:
        send.send_nowait(chunk)
    send.close()
    outs = [] if outs is None else outs

    async def emit(out: StageOutput) -> None:
        outs.append(out)

    await backend.run_request(request_id, receive, None, emit)
    return outs


def one_shot(vocoder: torch.nn.Module, codes: Sequence[int]) -> np.ndarray:
    with torch.inference_mode():
        return vocoder(torch.tensor([list(codes)], dtype=torch.long))[0].numpy()


def metrics_of(out: StageOutput) -> Mapping[str, Any]:
    assert out.metrics is not None
    return out.metrics


def codes_for(i: int, n: int) -> tuple[int, ...]:
    return tuple((7 * i + 13 * k) % 512 for k in range(n))


# -- pure decisions -------------------------------------------------------------------------


def test_decide_batch_waits_then_flushes_on_delay() -> None:
    pending = [Pending(10.0, 5), Pending(10.5, 5)]
    kw: dict[str, Any] = {"max_batch_size": 4, "max_batch_delay_s": 1.0}
    assert decide_batch([], 10.0, **kw).take == ()
    assert decide_batch([], 10.0, **kw).wake_at is None
    waiting = decide_batch(pending, 10.9, **kw)
    assert waiting.take == () and waiting.wake_at == 11.0
    assert decide_batch(pending, 11.0, **kw).take == (0, 1)


def test_decide_batch_flushes_full_batches_fifo() -> None:
    pending = [Pending(float(i), 3) for i in range(6)]
    decision = decide_batch(pending, 0.0, max_batch_size=4, max_batch_delay_s=100.0)
    assert decision.take == (0, 1, 2, 3)


def test_decide_batch_same_length_groups_with_the_oldest() -> None:
    pending = [Pending(0.0, 3), Pending(0.1, 9), Pending(0.2, 3), Pending(0.3, 3)]
    kw: dict[str, Any] = {"max_batch_delay_s": 1.0, "same_length": True}
    assert decide_batch(pending, 0.0, max_batch_size=3, **kw).take == (0, 2, 3)
    assert decide_batch(pending, 5.0, max_batch_size=8, **kw).take == (0, 2, 3)


def test_chunk_spans_and_context_window() -> None:
    assert chunk_spans(0, 10, chunk_size=16, final=False) == []
    assert chunk_spans(0, 35, chunk_size=16, final=False) == [(0, 16), (16, 32)]
    assert chunk_spans(32, 35, chunk_size=16, final=True) == [(32, 35)]
    assert chunk_spans(32, 32, chunk_size=16, final=True) == []
    assert chunk_spans(0, 40, chunk_size=None, final=False) == []
    assert chunk_spans(0, 40, chunk_size=None, final=True) == [(0, 40)]
    assert context_window(16, 32, 4) == (12, 4)
    assert context_window(2, 10, 4) == (0, 2)


def test_parse_options_splits_and_validates() -> None:
    opts, rest = parse_torch_options({"max_batch_size": 2, "weights": "w.pt", "seed": 3})
    assert opts.max_batch_size == 2 and rest == {"weights": "w.pt", "seed": 3}
    with pytest.raises(ConfigError, match=r"options\.max_batch_size.*>= 1"):
        parse_torch_options({"max_batch_size": 0}, stage_index=2)
    with pytest.raises(ConfigError, match="factory must be 'package.module:callable'"):
        parse_torch_options({"factory": "nocolon"})
    with pytest.raises(ConfigError, match="max_batch_delay_s"):
        parse_torch_options({"max_batch_delay_s": -1})


def test_codes_of_accepts_ids_and_arrays_and_names_bad_codes() -> None:
    assert codes_of(StageInput(token_ids=(1, 2)), 512) == [1, 2]
    assert codes_of(StageInput(data=np.array([3, 4])), 512) == [3, 4]
    assert codes_of(StageInput(data={"codes": [5]}), 512) == [5]
    with pytest.raises(ValueError, match=r"code 512 at position 1 is outside .*\[0, 512\)"):
        codes_of(StageInput(token_ids=(1, 512)), 512)
    with pytest.raises(ValueError, match="position 1 is 2.5, not an integer"):
        codes_of(StageInput(data=[1, 2.5]), 512)
    with pytest.raises(ValueError, match="not a text prompt"):
        codes_of(StageInput(prompt="hello"), 512)


def test_missing_torch_raises_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'omni-trio\[torch\]'"):
        import_torch()


# -- the backend in real threads -------------------------------------------------------------


async def test_concurrent_requests_batch_to_ceil_n_over_size(
    cache_dir: Path, vocoder: torch.nn.Module
) -> None:
    # A long delay: batches flush only when full, so 8 requests make exactly 2 batches.
    backend = make_backend(cache_dir, max_batch_size=4, max_batch_delay_s=GUARD_S)
    results: dict[str, list[StageOutput]] = {}
    lengths = [3, 17, 40, 1, 25, 9, 33, 5]  # variable lengths, padded inside each batch

    async def one(i: int) -> None:
        results[f"r{i}"] = await run_one(
            backend, f"r{i}", [StageInput(token_ids=codes_for(i, lengths[i]))]
        )

    with trio.fail_after(GUARD_S):
        async with serving(backend), trio.open_nursery() as requests:
            for i in range(len(lengths)):
                requests.start_soon(one, i)
    stats = backend.batching_statistics()
    assert stats.batches_run == 2 and stats.items_run == 8 and stats.largest_batch == 4
    for i, n in enumerate(lengths):
        (out,) = results[f"r{i}"]
        assert out.finished and out.metrics is not None
        assert metrics_of(out)["batch_size"] == 4 and metrics_of(out)["sample_rate"] == 16_000
        assert out.data.dtype == np.float32 and out.data.shape == (n * 160,)
        # padding in a batch must not change a request's audio
        np.testing.assert_allclose(out.data, one_shot(vocoder, codes_for(i, n)), atol=1e-5)
    assert backend.requests_in_flight == 0 and stats.pending == 0


async def test_partial_batch_flushes_after_delay(cache_dir: Path) -> None:
    backend = make_backend(cache_dir, max_batch_size=4, max_batch_delay_s=0.2)
    results: list[list[StageOutput]] = []

    async def one(i: int) -> None:
        results.append(await run_one(backend, f"r{i}", [StageInput(token_ids=codes_for(i, 8))]))

    with trio.fail_after(GUARD_S):
        async with serving(backend), trio.open_nursery() as requests:
            for i in range(6):
                requests.start_soon(one, i)
    stats = backend.batching_statistics()
    assert stats.batches_run == 2 and stats.items_run == 6
    assert sorted(metrics_of(r[0])["batch_size"] for r in results) == [2, 2, 4, 4, 4, 4]


async def test_delay_flush_on_the_trio_clock(
    cache_dir: Path, mock_clock: trio.testing.MockClock
) -> None:
    backend = make_backend(cache_dir, max_batch_size=4, max_batch_delay_s=1.0)
    results: list[list[StageOutput]] = []

    async def one() -> None:
        results.append(await run_one(backend, "alone", [StageInput(token_ids=codes_for(0, 8))]))

    async with serving(backend), trio.open_nursery() as requests:
        requests.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(0.9)
        await trio.testing.wait_all_tasks_blocked()
        assert backend.batching_statistics().pending == 1  # not yet: the delay is not over
        assert backend.batching_statistics().batches_run == 0
        mock_clock.jump(0.2)
    assert metrics_of(results[0][0])["batch_size"] == 1
    assert backend.batching_statistics().batches_run == 1


async def test_cancel_in_pending_batch_never_runs(cache_dir: Path) -> None:
    backend = make_backend(cache_dir, max_batch_size=4, max_batch_delay_s=GUARD_S)
    results: dict[str, list[StageOutput]] = {}

    async def one(rid: str, i: int) -> None:
        results[rid] = await run_one(backend, rid, [StageInput(token_ids=codes_for(i, 10))])

    with trio.fail_after(GUARD_S):
        async with serving(backend):
            async with trio.open_nursery() as doomed:
                doomed.start_soon(one, "doomed", 0)
                await trio.testing.wait_all_tasks_blocked()
                assert backend.batching_statistics().pending == 1
                doomed.cancel_scope.cancel()  # the request is cancelled in its pending batch
            stats = backend.batching_statistics()
            assert stats.pending == 0 and stats.dropped_pending == 1 and stats.items_run == 0
            async with trio.open_nursery() as requests:
                for i in range(4):
                    requests.start_soon(one, f"ok{i}", i + 1)
    assert "doomed" not in results
    stats = backend.batching_statistics()
    # the batch of 4 held only the 4 live requests: the cancelled one never ran
    assert stats.batches_run == 1 and stats.items_run == 4
    assert all(metrics_of(results[f"ok{i}"][0])["batch_size"] == 4 for i in range(4))
    assert backend.requests_in_flight == 0 and backend.statistics().requests_aborted == 1


class GatedVocoder(torch.nn.Module):
    """The tiny vocoder behind a gate the test opens: holds a batch inside the worker thread."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.sample_rate, self.hop_length = inner.sample_rate, inner.hop_length
        self.vocab_size, self.context_codes = inner.vocab_size, inner.context_codes
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.exited = threading.Event()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        self.exited.clear()
        self.entered.set()
        self.gate.wait(GUARD_S)
        try:
            return self.inner(codes)
        finally:
            self.exited.set()


def gated_factory(vocoder: torch.nn.Module) -> tuple[GatedVocoder, Callable[[dict], Any]]:
    module = GatedVocoder(vocoder)
    return module, lambda options: module


async def test_abort_while_batch_runs_drops_only_that_result(
    cache_dir: Path, vocoder: torch.nn.Module
) -> None:
    module, factory = gated_factory(vocoder)
    backend = make_backend(cache_dir, factory=factory, max_batch_size=2, max_batch_delay_s=GUARD_S)
    results: dict[str, list[StageOutput]] = {}
    emitted: dict[str, list[StageOutput]] = {"gone": [], "kept": []}
    failures: list[BaseException] = []

    async def one(rid: str, i: int) -> None:
        chunks = [StageInput(token_ids=codes_for(i, 12))]
        try:
            results[rid] = await run_one(backend, rid, chunks, emitted[rid])
        except StageAborted as exc:
            failures.append(exc)

    with trio.fail_after(GUARD_S):
        async with serving(backend), trio.open_nursery() as requests:
            module.gate.clear()
            module.entered.clear()
            requests.start_soon(one, "gone", 0)
            requests.start_soon(one, "kept", 1)
            await trio.to_thread.run_sync(module.entered.wait)  # the batch of 2 is running
            assert backend.batching_statistics().running_batches == 1
            await backend.abort("gone")
            module.gate.set()
    assert len(failures) == 1 and "gone" not in results and emitted["gone"] == []
    (kept,) = results["kept"]
    assert metrics_of(kept)["batch_size"] == 2
    np.testing.assert_allclose(kept.data, one_shot(vocoder, codes_for(1, 12)), atol=1e-5)
    stats = backend.batching_statistics()
    assert stats.dropped_running == 1 and stats.running_batches == 0
    assert backend.requests_in_flight == 0


async def test_shutdown_waits_for_the_running_batch(
    cache_dir: Path, vocoder: torch.nn.Module
) -> None:
    """Stopping a replica cannot interrupt a worker thread: serve returns only after the
    running batch left the module (its result is still delivered); pending requests abort."""
    module, factory = gated_factory(vocoder)
    backend = make_backend(cache_dir, factory=factory, max_batch_size=1)
    results: dict[str, list[StageOutput]] = {}
    aborted: list[str] = []
    serve_returned = trio.Event()

    async def request(rid: str) -> None:
        try:
            results[rid] = await run_one(backend, rid, [StageInput(token_ids=codes_for(0, 8))])
        except StageAborted:
            aborted.append(rid)

    async def open_gate_later() -> None:
        await trio.testing.wait_all_tasks_blocked()
        assert not serve_returned.is_set()  # serve is waiting for the thread
        module.gate.set()

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as server:
                await server.start(backend.serve)
                module.gate.clear()
                module.entered.clear()
                outer.start_soon(request, "running")
                await trio.to_thread.run_sync(module.entered.wait)
                outer.start_soon(request, "pending")
                await trio.testing.wait_all_tasks_blocked()
                assert backend.batching_statistics().pending == 1
                server.cancel_scope.cancel()  # stop the replica while its batch runs
                outer.start_soon(open_gate_later)
            serve_returned.set()
            # serve returned only after the worker thread left the module
            assert module.exited.is_set() and not backend.alive
    assert list(results) == ["running"] and results["running"][-1].finished
    assert aborted == ["pending"] and backend.batching_statistics().dropped_pending == 1
    assert backend.requests_in_flight == 0


async def test_streamed_chunks_arrive_early_and_equal_one_shot(
    cache_dir: Path, vocoder: torch.nn.Module
) -> None:
    backend = make_backend(cache_dir, stream_input=True, chunk_size=16, max_batch_delay_s=0)
    codes = codes_for(3, 45)
    send, receive = trio.open_memory_channel[StageInput](4)
    out_send, out_receive = trio.open_memory_channel[StageOutput](8)
    outs: list[StageOutput] = []

    async def request() -> None:
        async with out_send:
            await backend.run_request("s", receive, None, out_send.send)

    with trio.fail_after(GUARD_S):
        async with serving(backend), trio.open_nursery() as nursery:
            nursery.start_soon(request)
            for start in range(0, 20, 5):  # 20 codes, not final
                await send.send(StageInput(token_ids=codes[start : start + 5], final=False))
            # the first chunk comes while the upstream is still producing
            outs.append(await out_receive.receive())
            assert not outs[0].finished and outs[0].data.shape == (16 * 160,)
            await send.send(StageInput(token_ids=codes[20:], final=True))
            async for out in out_receive:
                outs.append(out)
    assert [metrics_of(o)["codes"] for o in outs] == [16, 16, 13]
    assert [o.finished for o in outs] == [False, False, True]
    audio = np.concatenate([o.data for o in outs])
    np.testing.assert_allclose(audio, one_shot(vocoder, codes), atol=1e-5)


async def test_stream_with_empty_final_chunk_still_finishes(cache_dir: Path) -> None:
    backend = make_backend(cache_dir, stream_input=True, chunk_size=4, max_batch_delay_s=0)
    chunks = [StageInput(token_ids=(1, 2, 3, 4), final=False), StageInput(final=True)]
    with trio.fail_after(GUARD_S):
        async with serving(backend):
            outs = await run_one(backend, "e", chunks)
    assert [o.finished for o in outs] == [False, True]
    assert outs[-1].data.shape == (0,) and outs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (StageInput(token_ids=(1, 2, 600)), r"code 600 at position 2 is outside"),
        (StageInput(data=[1, "x"]), r"position 1 is 'x', not an integer"),
        (StageInput(prompt="some text"), r"integer codes, not a text prompt"),
    ],
)
async def test_bad_input_fails_only_that_request(
    cache_dir: Path, bad: StageInput, message: str
) -> None:
    backend = make_backend(cache_dir, max_batch_size=2, max_batch_delay_s=0.01)
    good: list[list[StageOutput]] = []

    async def good_one() -> None:
        good.append(await run_one(backend, "good", [StageInput(token_ids=codes_for(1, 8))]))

    with trio.fail_after(GUARD_S):
        async with serving(backend):
            async with trio.open_nursery() as requests:
                requests.start_soon(good_one)
                with pytest.raises(StageError, match=message) as info:
                    await run_one(backend, "bad", [bad])
            assert backend.alive
    assert info.value.request_id == "bad" and info.value.stage_id == "code2wav"
    assert good[0][0].finished and good[0][0].data.shape == (8 * 160,)
    assert backend.statistics().requests_failed == 1 and backend.requests_in_flight == 0


class PoisonVocoder(torch.nn.Module):
    """The tiny vocoder, but code 511 makes forward raise (a module bug one input triggers)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.sample_rate, self.hop_length = inner.sample_rate, inner.hop_length
        self.vocab_size, self.context_codes = inner.vocab_size, inner.context_codes

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if bool((codes == 511).any()):
            raise RuntimeError("code 511 breaks this module")
        return self.inner(codes)


async def test_module_error_fails_only_the_request_that_causes_it(
    cache_dir: Path, vocoder: torch.nn.Module
) -> None:
    module = PoisonVocoder(vocoder)
    backend = make_backend(
        cache_dir, factory=lambda options: module, max_batch_size=2, max_batch_delay_s=GUARD_S
    )
    good: list[list[StageOutput]] = []
    errors: list[StageError] = []

    async def one(rid: str, codes: tuple[int, ...]) -> None:
        try:
            good.append(await run_one(backend, rid, [StageInput(token_ids=codes)]))
        except StageError as exc:
            errors.append(exc)

    with trio.fail_after(GUARD_S):
        async with serving(backend), trio.open_nursery() as requests:
            requests.start_soon(one, "good", codes_for(1, 8))
            requests.start_soon(one, "poison", (3, 511, 4))
    (error,) = errors
    assert error.request_id == "poison" and "code 511 breaks this module" in str(error)
    assert metrics_of(good[0][0])["batch_size"] == 2  # it shared the failed batch
    np.testing.assert_allclose(good[0][0].data, one_shot(vocoder, codes_for(1, 8)), atol=1e-5)
    assert backend.batching_statistics().batches_run == 1
    assert backend.statistics().requests_failed == 1 and backend.statistics().requests_finished == 1


async def test_rpc_reports_the_module(cache_dir: Path, vocoder: torch.nn.Module) -> None:
    backend = make_backend(cache_dir)
    with trio.fail_after(GUARD_S):
        async with serving(backend):
            assert await backend.collective_rpc("sample_rate") == 16_000
            assert await backend.collective_rpc("hop_length") == 160
            n_params = sum(p.numel() for p in vocoder.parameters())
            assert await backend.collective_rpc("num_parameters") == n_params
            described = await backend.collective_rpc("describe")
            assert described["module"] == "TinyVocoder" and described["vocab_size"] == 512
            stats = await backend.collective_rpc("batching_statistics")
            assert stats.batches_run == 0
            with pytest.raises(StageError, match="no rpc method 'nope'"):
                await backend.collective_rpc("nope")
            assert "pending=0" in repr(backend)


async def test_bad_factory_fails_start(cache_dir: Path) -> None:
    backend = make_backend(cache_dir, factory="omni_trio.models.vocoder:no_such_factory")
    with trio.fail_after(GUARD_S), pytest.raises(ConfigError, match="no_such_factory"):
        await backend.serve()
    assert not backend.alive
