"""Prefill/decode pairs at run time, on scripted stages standing in for vLLM engines with a
KV connector (the MockClock): the prefill runs one token and returns ``kv_transfer_params``;
the decode starts with the prefill's input and those params; a missing or malformed one
fails that request only; aborts, failures and dead replicas on either side; cancellation at
every checkpoint; several pairs in one pipeline."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import omni_trio
from omni_trio import InvalidRequestError, ReplicaDeadError, StageError
from omni_trio.observer import EngineObserver
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
    scripted_tokens,
)

from ..config.test_pd import decode, kv, prefill, stage

GREEDY = {"temperature": 0.0}


def pipeline(
    p_opts: dict[str, object] | None = None,
    d_opts: dict[str, object] | None = None,
    *,
    upstream: bool = False,
    **top: object,
) -> dict[str, object]:
    """A prefill p -> decode d pair (decode: 4 outputs, greedy, requiring the params); with
    ``upstream`` an entry stage ``up`` feeds the prefill."""
    stages = [
        prefill("p", inputs=["up"] if upstream else None, options={"outputs": 6, **(p_opts or {})}),
        decode(
            "d",
            options={"outputs": 4, "require_kv_params": True, **(d_opts or {})},
            default_sampling_params=GREEDY,
        ),
    ]
    if upstream:
        stages.insert(0, stage("up", options={"outputs": 3}))
    return {"name": "pd", "stages": stages, **top}


def only(engine: omni_trio.Engine, sid: str):
    (backend,) = scripted_backends(engine, sid)
    return backend


async def run_at_once(engine: omni_trio.Engine, ids: str) -> dict[str, object]:
    """Each request id's outputs, or the StageError it failed with; started 10 ms apart (so
    admitted, and bound to the prefill's replicas, in this order), run at once."""
    results: dict[str, object] = {}

    async def one(rid: str) -> None:
        try:
            results[rid] = await engine.generate("hey", request_id=rid).collect()
        except StageError as exc:
            results[rid] = exc

    async with trio.open_nursery() as nursery:
        for rid in ids:
            nursery.start_soon(one, rid)
            await trio.sleep(0.01)
    return results


@pytest.mark.parametrize("observed", [False, True])
@pytest.mark.parametrize("upstream", [False, True])
async def test_a_pair_carries_the_kv_params_and_the_prompt(autojump_clock, observed, upstream):
    async with omni_trio.open_engine(pipeline(upstream=upstream)) as engine:
        if observed:
            engine.add_observer(EngineObserver())
        outs = await engine.generate("hey", request_id="r1").collect()
        p, d = only(engine, "p"), only(engine, "d")
        # the prefill ran one token, asking for a remote decode
        (p_params,) = p.sampling["r1"]
        assert p_params["max_tokens"] == 1 and p_params["stop"] == []
        assert p_params["extra_args"]["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "xfer-r1",
        }
        # the decode got the request's params and what the prefill returned
        (d_params,) = d.sampling["r1"]
        assert d_params["temperature"] == 0.0 and "max_tokens" not in d_params
        assert d_params["extra_args"]["kv_transfer_params"] == {
            "transfer_id": "xfer-r1",
            "remote_engine_id": "scripted:p:0",
            "remote_request_id": "r1",
            "do_remote_prefill": True,
            "do_remote_decode": False,
        }
        # ... and the prompt the prefill computed (the ids its finished output reports:
        # "hey"'s bytes, or the upstream stage's tokens), not the prefill's one token
        (p_in,), (d_in,) = p.received["r1"], d.received["r1"]
        prompt = list(b"hey")
        if upstream:
            assert p_in.token_ids == tuple(scripted_tokens(prompt, 3))
            prompt = list(p_in.token_ids)
        else:
            assert p_in.prompt == "hey"
        assert (d_in.prompt, d_in.token_ids, d_in.source) == (None, tuple(prompt), "p")
        assert [o.stage_id for o in outs] == ["d"] * 4
        assert [t for o in outs for t in o.token_ids] == scripted_tokens(prompt, 4)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert_nothing_in_flight(engine)


async def test_a_connector_without_params_decodes_with_its_own(autojump_clock):
    cfg = pipeline(d_opts={"require_kv_params": False})
    for st, role in zip(cfg["stages"], ("kv_producer", "kv_consumer"), strict=True):
        st["engine_args"] = kv(role, "ExampleConnector")
        st["options"]["omit_kv_params_at_request"] = 1  # as ExampleConnector: nothing back
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate("hey", request_id="r").collect()
        assert outs[-1].finished
        (d_params,) = only(engine, "d").sampling["r"]
        assert d_params["extra_args"]["kv_transfer_params"] == {
            "transfer_id": "xfer-r",
            "do_remote_prefill": True,
            "do_remote_decode": False,
        }


@pytest.mark.parametrize(
    ("option", "phrase"),
    [
        ("omit_kv_params_at_request", "without kv_transfer_params"),
        ("malformed_kv_params_at_request", "returned malformed kv_transfer_params"),
    ],
)
async def test_missing_or_malformed_kv_params_fail_only_their_request(
    autojump_clock, option, phrase
):
    # the prefill's second request comes back without usable params; three run at once
    cfg = pipeline({option: 2, "latency_s": 0.1}, {"latency_s": 0.1})
    async with omni_trio.open_engine(cfg) as engine:
        results = await run_at_once(engine, "abc")
        failed = results["b"]
        assert isinstance(failed, StageError) and not isinstance(failed, ReplicaDeadError)
        assert str(failed).startswith("prefill/decode pair 'p' -> 'd': ")
        assert phrase in str(failed) and "'b'" in str(failed)
        assert (failed.stage_id, failed.request_id) == ("d", "b")
        for rid in ("a", "c"):
            assert [o.finished for o in results[rid]] == [False] * 3 + [True]
        d = only(engine, "d")
        assert "b" not in d.sampling and sorted(d.completed) == ["a", "c"]  # never started
        stats = engine.statistics()
        assert (stats.requests_finished, stats.requests_failed) == (2, 1)
        assert all(r.alive for s in stats.stages for r in s.replicas)  # no engine hurt
        # and it keeps serving
        assert (await engine.generate("yo").collect())[-1].finished
        assert_nothing_in_flight(engine)


async def test_abort_while_the_prefill_runs(autojump_clock):
    async with omni_trio.open_engine(pipeline({"latency_s": 5})) as engine:
        async with engine.generate("hey", request_id="r") as stream:
            with trio.move_on_after(1):
                await stream.receive()
            assert await engine.abort("r") == []
        assert list(only(engine, "p").aborted) == ["r"]
        assert "r" not in only(engine, "d").sampling  # the decode never started
        assert engine.statistics().requests_aborted == 1
        assert_nothing_in_flight(engine)


async def test_abort_while_the_decode_runs(autojump_clock):
    async with omni_trio.open_engine(pipeline(d_opts={"latency_s": 1})) as engine:
        async with engine.generate("hey", request_id="r") as stream:
            first = await stream.receive()
            partial = await engine.abort("r")
        # what both stages produced: the prefill's one token, the decode's first
        assert first.stage_id == "d"
        assert [(o.stage_id, o.token_ids) for o in partial] == [("p", (105,)), ("d", (105,))]
        p, d = only(engine, "p"), only(engine, "d")
        assert list(p.completed) == ["r"] and list(d.aborted) == ["r"]
        assert_nothing_in_flight(engine)


async def test_a_consumer_leaving_aborts_both_sides(autojump_clock):
    # leaving the stream while the prefill still runs cancels it; nothing reaches the decode
    async with omni_trio.open_engine(pipeline({"hang": True})) as engine:
        async with engine.generate("hey", request_id="r") as stream:
            with trio.move_on_after(3):
                await stream.receive()
        assert list(only(engine, "p").aborted) == ["r"] and not only(engine, "d").sampling
        assert_nothing_in_flight(engine)


@pytest.mark.parametrize("side", ["p", "d"])
async def test_a_failure_on_either_side_fails_the_request(autojump_clock, side):
    opts = {"fail_at_output": 0}
    cfg = pipeline(opts if side == "p" else None, opts if side == "d" else None)
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(StageError) as info:
            await engine.generate("hey", request_id="r").collect()
        assert info.value.stage_id == side and "configured to fail at output 0" in str(info.value)
        assert ("r" in only(engine, "d").sampling) == (side == "d")
        assert_nothing_in_flight(engine)


async def test_a_dead_prefill_replica_fails_only_its_requests(autojump_clock):
    cfg = pipeline({"crash_at_request": 1, "crash_replica": 0, "latency_s": 0.1})
    cfg["stages"][0].update(replicas=2, lb_policy="round_robin")
    async with omni_trio.open_engine(cfg) as engine:
        results = await run_at_once(engine, "abcd")
        dead = {rid for rid, r in results.items() if isinstance(r, ReplicaDeadError)}
        assert dead == {"a"}  # the one bound to replica 0 when it died
        assert all(results[rid][-1].finished for rid in "bcd")
        assert sorted(only(engine, "d").completed) == ["b", "c", "d"]
        assert_nothing_in_flight(engine)


@pytest.mark.parametrize("observed", [False, True])
async def test_cancel_at_every_checkpoint_of_a_pd_request(autojump_clock, observed):
    cfg = pipeline({"latency_s": 0.1}, {"latency_s": 0.1}, upstream=True)

    async def scenario(engine: omni_trio.Engine) -> None:
        async with engine.generate("hey") as stream:
            async for _ in stream:
                pass

    async with omni_trio.open_engine(cfg) as engine:
        if observed:
            engine.add_observer(EngineObserver())
        report = await cancel_at_every_checkpoint(engine, scenario)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 5
        d = only(engine, "d")
        # every decode that ran had the prefill's params: none started without them
        assert d.sampling and all(
            sp[0]["extra_args"]["kv_transfer_params"]["remote_engine_id"] == "scripted:p:0"
            for sp in d.sampling.values()
        )
        assert_nothing_in_flight(engine)


async def test_several_pairs_in_one_pipeline(autojump_clock):
    # an LLM split in two, then another: each decode gets its own prefill's input and params
    cfg = {
        "name": "two-pairs",
        "stages": [
            prefill("p1", options={"outputs": 5}),
            decode(
                "d1", "p1", final_output=False, options={"outputs": 3, "require_kv_params": True}
            ),
            prefill("p2", inputs=["d1"], options={"outputs": 5}),
            decode("d2", "p2", options={"outputs": 2, "require_kv_params": True}),
        ],
    }
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate("hey", request_id="r", sampling_params=GREEDY).collect()
        d1_tokens = scripted_tokens(list(b"hey"), 3)
        assert [t for o in outs for t in o.token_ids] == scripted_tokens(d1_tokens, 2)
        for p, d, prompt in (("p1", "d1", None), ("p2", "d2", tuple(d1_tokens))):
            (p_in,), (d_in,) = only(engine, p).received["r"], only(engine, d).received["r"]
            assert d_in.token_ids == (prompt or tuple(b"hey")) and d_in.source == p
            if prompt is not None:
                assert p_in.token_ids == prompt
            (params,) = only(engine, d).sampling["r"]
            assert (
                params["extra_args"]["kv_transfer_params"]["remote_engine_id"] == f"scripted:{p}:0"
            )
            assert only(engine, p).sampling["r"][0]["max_tokens"] == 1
        assert_nothing_in_flight(engine)


async def test_a_prompt_dict_goes_to_the_decode_as_it_is(autojump_clock):
    # multimodal data and all: the decode needs what the prefill computed the cache of
    prompt = {"prompt": "hey", "multi_modal_data": {"image": "<pixels>"}}
    async with omni_trio.open_engine(pipeline()) as engine:
        assert (await engine.generate(prompt, request_id="r").collect())[-1].finished
        (d_in,) = only(engine, "d").received["r"]
        assert (d_in.data, d_in.token_ids, d_in.source) == (prompt, (), "p")


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"sampling_params": {"temperature": 0, "n": 2}}, "sampling param 'n' of stage"),
        ({"lora_request": "an adapter"}, "lora_request is not supported on"),
        ({"sampling_params": {"temperature": 0, "logprobs": 1}}, "'logprobs' is not supported"),
        ({"sampling_params": {"d": {"temperature": 0.5}}}, "greedy (temperature: 0) or seeded"),
        ({"final_stage_id": "p"}, "without its decode stage 'd'"),
        ({"streaming_input": True}, "streaming_input cannot feed prefill stage 'p'"),
    ],
)
async def test_a_request_the_pair_cannot_take_is_refused(autojump_clock, kwargs, phrase):
    async with omni_trio.open_engine(pipeline()) as engine:
        with pytest.raises(InvalidRequestError) as info:
            engine.generate("hey", request_id="r", **kwargs)
        assert phrase in str(info.value)
        assert not only(engine, "p").sampling and engine.statistics().requests_total == 0
        assert (await engine.generate("hey").collect())[-1].finished  # nothing else affected


async def test_cancel_at_every_checkpoint_of_pd_requests_with_the_graph_gate_held(autojump_clock):
    # one ticket for the whole graph (max_requests_in_graph: 1), two PD requests: wherever
    # the cancellation lands, each admitted request's ticket is released exactly once
    cfg = pipeline({"latency_s": 0.1}, {"latency_s": 0.1}, max_requests_in_graph=1)

    async def read(engine: omni_trio.Engine, prompt: str) -> None:
        async with engine.generate(prompt, sampling_params={"d": GREEDY}) as stream:
            outs = [out async for out in stream]
            assert outs[-1].finished

    async def scenario(engine: omni_trio.Engine) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, engine, "first")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read, engine, "second")

    def tickets_balanced(engine: omni_trio.Engine) -> None:
        stats = engine.orchestrator.admission.statistics()
        assert stats.in_graph == 0, f"{stats.in_graph} ticket(s) held"
        assert stats.tickets_issued == stats.tickets_released

    async with omni_trio.open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=tickets_balanced)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 10
        stats = engine.orchestrator.admission.statistics()
        assert stats.tickets_issued > report.runs  # the second request ran in most runs
        assert_nothing_in_flight(engine)
