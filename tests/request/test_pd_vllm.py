"""A real KV handoff: the shipped ``tiny-pd`` pipeline (a prefill engine and a decode engine on
``tiny:thinker``, vLLM's ExampleConnector between them) against a single engine of the same
model, each through omni-trio's engine.

The proof that the decode did not recompute the prompt is vLLM's own counter: the decode's
finished output's ``num_cached_tokens`` (its prefix cache is off, so every prompt token it
did not compute came through the connector) equals what ExampleConnector loads, and a prompt
the decode stage runs alone, never prefilled, counts 0. The proof that what it loaded is
used: zeroing a prompt's stored tensors changes the decode's greedy answer.

The three engines start together, once for the module (~1 min on 2 cores): they run in a
trio loop of their own thread (an anyio blocking portal), since each test is its own
``trio.run``; each test ends with nothing in flight in any layer and no request left in any
vLLM engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from anyio.from_thread import BlockingPortal, start_blocking_portal

import omni_trio
from omni_trio import testing
from omni_trio.engine.engine import Engine
from omni_trio.models import resolve_model
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.pipelines import pipeline_path

from ..conftest import EngineWaitTimeout, bounded, engine_seconds

pytestmark = pytest.mark.vllm

START_S = 300.0  # three engines starting at once on 2 cores (tiny model built on first use)
STOP_S = 120.0
WAIT_S = 120.0  # a few requests, or settling afterwards: a hang guard
BLOCK_SIZE = 32  # tiny-pd's
GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
WORDS = (
    "the tiny omni model sings a song about the river and the moon while a long and winding "
    "road leads to the quiet village by the sea"
).split()


def sentence(start: int, words: int) -> str:
    """``words`` words of WORDS from word ``start`` on (wrapping): a prompt no other one
    begins like."""
    return " ".join((WORDS[start:] + WORDS * 8)[:words])


#: 35, 59, 69, 96, 114 and 125 tokens (BOS included): ExampleConnector loads 32, 32, 64,
#: 64, 96 and 96 of them
PROMPTS = [sentence(3 * k, words) for k, words in enumerate((18, 26, 34, 42, 50, 58))]


def loaded_by_example_connector(n: int, block_size: int = BLOCK_SIZE) -> int:
    """How many tokens of an ``n``-token prompt ExampleConnector loads into the decode engine:
    the whole blocks of the prompt less its last token (vLLM computes at least the last
    position). It stores under the whole blocks of the prompt and looks up under those of the
    prompt less one token: when ``n - 1`` is a multiple of the block size the two differ and
    it loads nothing (the decode silently recomputes); the test's prompts avoid that. Pure."""
    assert (n - 1) % block_size, f"a {n}-token prompt is one ExampleConnector never finds"
    return (n - 2) // block_size * block_size


# -- the module's engines ---------------------------------------------------------------------
@dataclass
class Answer:
    """What a caller got for one request: the stages that answered, the token ids, and the
    finished output's metrics."""

    stages: set[str]
    token_ids: list[int]
    metrics: Mapping[str, Any]

    @property
    def prompt_tokens(self) -> int:
        return int(self.metrics["num_prompt_tokens"])

    @property
    def cached_tokens(self) -> int:
        return int(self.metrics["num_cached_tokens"])


async def answer(engine: Engine, prompt: str, **kw: Any) -> Answer:
    """One greedy request, streamed to its end."""
    stages: set[str] = set()
    ids: list[int] = []
    metrics: Mapping[str, Any] | None = None
    async with engine.generate(prompt, sampling_params=GREEDY, **kw) as stream:
        async for out in stream:
            stages.add(out.stage_id)
            ids.extend(out.token_ids)
            if out.finished:
                assert isinstance(out.metrics, Mapping)
                metrics = out.metrics
    assert metrics is not None, f"no finished output for {prompt!r}"
    return Answer(stages, ids, metrics)


async def answers(engine: Engine, prompts: Sequence[str]) -> list[Answer]:
    """Every prompt at once (the engine batches them), in the prompts' order."""
    got: dict[int, Answer] = {}

    async def one(k: int) -> None:
        got[k] = await answer(engine, prompts[k])

    async with trio.open_nursery() as nursery:
        for k in range(len(prompts)):
            nursery.start_soon(one, k)
    return [got[k] for k in range(len(prompts))]


@dataclass
class Engines:
    """The module's engines, on the portal's trio loop; ``store`` is ExampleConnector's."""

    portal: BlockingPortal
    pd: Engine
    single: Engine
    store: Path

    async def run(self, check: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await check(self, *args)`` on the engines' loop; its result or what it raised."""
        call = partial(self.portal.call, check, self, *args)
        with bounded(f"{check.__name__} on the engines' loop", WAIT_S, self.pd, self.single):
            return await trio.to_thread.run_sync(call, abandon_on_cancel=True)

    def folders(self) -> set[Path]:
        """The store's folders: one per prompt stored (its whole blocks' hash)."""
        return {p for p in self.store.iterdir() if p.is_dir()}


async def settled(engines: Engines) -> None:
    """Nothing in flight in any layer of either engine, nothing left in any vLLM engine."""
    for engine, vllm_stages in ((engines.pd, 2), (engines.single, 1)):
        await testing.wait_until_idle(engine)
        testing.assert_nothing_in_flight(engine)
        assert engine.statistics().requests_in_flight == 0
        left = await engine.collective_rpc("get_num_unfinished_requests")
        assert left == [0] * vllm_stages


def configs(store: Path) -> dict[str, Any]:
    """tiny-pd with its store in ``store``, and a one-stage pipeline of the same engine (the
    decode's engine args without the connector): they share nothing."""
    kv = {"kv_transfer_config": {"kv_connector_extra_config": {"shared_storage_path": str(store)}}}
    pd = omni_trio.load_config(
        pipeline_path("tiny-pd"),
        stage_overrides={s: {"engine_args": kv} for s in ("prefill", "decode")},
    )
    args = {k: v for k, v in pd.stage("decode").engine_args.items() if k != "kv_transfer_config"}
    single = {
        "name": "tiny-single",
        "stages": [
            {
                "id": "single",
                "backend": "vllm",
                "engine_args": args,
                "final_output": True,
                "output_type": "text",
            }
        ],
    }
    return {"pd": pd, "single": single}


@asynccontextmanager
async def opened(cfgs: Mapping[str, Any]) -> AsyncIterator[dict[str, Engine]]:
    """Every engine of ``cfgs`` open, their starts overlapping; they close together. Start
    and stop bounded (hang guards)."""
    engines: dict[str, Engine] = {}
    leave = trio.Event()

    async def hold(cfg: Any, *, task_status: trio.TaskStatus[Engine]) -> None:
        async with omni_trio.open_engine(cfg) as engine:
            task_status.started(engine)
            await leave.wait()

    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = trio.current_time() + engine_seconds(START_S)

        async def start(name: str) -> None:
            engines[name] = await nursery.start(hold, cfgs[name])

        async with trio.open_nursery() as starting:
            for name in cfgs:
                starting.start_soon(start, name)
        nursery.cancel_scope.deadline = math.inf
        try:
            yield engines
        finally:
            leave.set()
            nursery.cancel_scope.deadline = trio.current_time() + engine_seconds(STOP_S)
    if nursery.cancel_scope.cancelled_caught:
        raise EngineWaitTimeout("the engines did not start or stop within their bounds")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    store = tmp_path_factory.mktemp("kv-store")
    with start_blocking_portal(backend="trio") as portal:
        with portal.wrap_async_context_manager(opened(configs(store))) as engines:
            yield Engines(portal, engines["pd"], engines["single"], store)


# -- the tests --------------------------------------------------------------------------------
async def test_the_decode_loads_the_prompt_and_answers_as_one_engine(shared: Engines) -> None:
    async def check(engines: Engines) -> tuple[list[Answer], list[Answer]]:
        pd = await answers(engines.pd, PROMPTS)
        single = await answers(engines.single, PROMPTS)
        await settled(engines)
        return pd, single

    pd, single = await shared.run(check)
    lengths = [a.prompt_tokens for a in single]
    assert [a.prompt_tokens for a in pd] == lengths == [35, 59, 69, 96, 114, 125]
    for k, (got, want) in enumerate(zip(pd, single, strict=True)):
        assert got.stages == {"decode"}, k  # the prefill's one token never reaches the caller
        assert len(got.token_ids) == GREEDY["max_tokens"], k
        assert got.token_ids == want.token_ids, f"prompt {k} ({lengths[k]} tokens)"
    # the decode engine loaded the prompt's whole blocks and computed only the rest
    assert [a.cached_tokens for a in pd] == [loaded_by_example_connector(n) for n in lengths]
    assert [a.cached_tokens for a in single] == [0] * len(PROMPTS)  # no prefix cache there
    # the prefill stored each prompt in a folder of its own: one file per layer
    layers = json.loads((Path(resolve_model("tiny:thinker")) / "config.json").read_text())
    folders = shared.folders()
    assert len(folders) == len(PROMPTS)
    for folder in folders:
        files = sorted(f.name for f in folder.iterdir())
        assert len(files) == layers["num_hidden_layers"], files
        assert all(f.endswith(".safetensors") for f in files), files


async def test_the_decode_stage_alone_recomputes_a_prompt_never_prefilled(
    shared: Engines,
) -> None:
    # the negative control: the same decode replica, a prompt no prefill ever ran, straight
    # into the stage (not through the pair): nothing to load, so nothing counts as loaded
    prompt = sentence(1, 46)

    async def check(engines: Engines) -> list[StageOutput]:
        decode = engines.pd.pools["decode"].replica(0)
        tx, rx = trio.open_memory_channel[StageInput](1)
        tx.send_nowait(StageInput(prompt=prompt, final=True))
        tx.close()
        outs: list[StageOutput] = []

        async def emit(out: StageOutput) -> None:
            outs.append(out)

        await decode.run_request("never-prefilled", rx, dict(GREEDY), emit)
        await settled(engines)
        return outs

    outs = await shared.run(check)
    metrics = outs[-1].metrics
    assert outs[-1].finished and isinstance(metrics, Mapping)
    n = metrics["num_prompt_tokens"]
    assert loaded_by_example_connector(n) > 0  # long enough to load blocks, were they stored
    assert metrics["num_cached_tokens"] == 0


async def test_zeroed_stored_tensors_change_the_decodes_answer(shared: Engines) -> None:
    # what the decode loads is what it attends to: the same prompt again after its stored
    # tensors were zeroed loads as much and answers differently
    import safetensors.torch
    import torch

    prompt = sentence(5, 40)

    def zero(folder: Path) -> None:
        for path in folder.glob("*.safetensors"):
            kv = safetensors.torch.load_file(str(path))["kv_cache"]
            safetensors.torch.save_file({"kv_cache": torch.zeros_like(kv)}, str(path))

    async def check(engines: Engines) -> tuple[Answer, Answer, Answer]:
        before = engines.folders()
        first = await answer(engines.pd, prompt)
        (stored,) = engines.folders() - before  # the one this prompt's prefill wrote
        await trio.to_thread.run_sync(zero, stored)
        again = await answer(engines.pd, prompt)
        single = await answer(engines.single, prompt)
        await settled(engines)
        return first, again, single

    first, again, single = await shared.run(check)
    expected = loaded_by_example_connector(first.prompt_tokens)
    assert first.cached_tokens == again.cached_tokens == expected > 0
    assert first.token_ids == single.token_ids
    assert again.token_ids != first.token_ids


async def test_a_consumer_leaving_mid_decode_ends_the_request_in_both_engines(
    shared: Engines,
) -> None:
    long = {**GREEDY, "max_tokens": 120}

    async def check(engines: Engines) -> tuple[list[omni_trio.OmniOutput], int]:
        async with engines.pd.generate(PROMPTS[0], sampling_params=long) as stream:
            seen = [await stream.receive() for _ in range(2)]
        # leaving the stream aborted the request in every stage before __aexit__ returned
        left = await engines.pd.collective_rpc("get_num_unfinished_requests")
        await settled(engines)
        return seen, sum(left)

    seen, left = await shared.run(check)
    assert [o.stage_id for o in seen] == ["decode", "decode"]
    assert not any(o.finished for o in seen)
    assert left == 0
