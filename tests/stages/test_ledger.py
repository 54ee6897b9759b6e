"""The resource ledger (``omni_trio.stages.ledger``): the pure reserve/release rule, and the
engine's use of it: every replica reserved at once before any starts (a deployment that does
not fit starts nothing), ``add_replica`` reserving first (refused, nothing started),
``remove_replica`` and a failed add giving the share back, a restart keeping it, the close
giving everything back. Scripted stages, MockClock."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import trio

import omni_trio
from omni_trio import (
    ConfigError,
    ResourceStatistics,
    ResourceUnavailableError,
    StageStartError,
    load_config,
)
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.config.pipeline import PipelineConfig
from omni_trio.stages.ledger import (
    Ledger,
    Refusal,
    ResourceLedger,
    pipeline_capacities,
    release,
    reserve,
)
from omni_trio.stages.machine import machine_capacities, read_machine
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_pipeline,
    wait_until_settled,
)

# -- the pure rule -------------------------------------------------------------------------


def test_reserve_holds_every_ask_or_none():
    ledger = Ledger.of({"gpu": 3, "cpu_cores": 8})
    held = reserve(ledger, [("a", 0, {"gpu": 1, "cpu_cores": 2}), ("a", 1, {"gpu": 1})])
    assert isinstance(held, Ledger)
    assert held.reserved == {"gpu": 2, "cpu_cores": 2}
    assert held.left("gpu") == 1
    refused = reserve(held, [("b", 0, {"cpu_cores": 1}), ("b", 1, {"gpu": 2})])
    assert refused == Refusal(
        "b", 1, "gpu", Fraction(2), Fraction(1), Fraction(3), holders=(("a", Fraction(2)),)
    )
    # the refusal left the ledger as it was: b[0]'s cpu is not held either
    assert held.reserved == {"gpu": 2, "cpu_cores": 2}
    assert ("b", 0) not in held.held


def test_the_refusal_counts_the_asks_before_it_in_the_same_list():
    refused = reserve(Ledger.of({"gpu": 3}), [("a", 0, {"gpu": 2}), ("a", 1, {"gpu": 2})])
    assert isinstance(refused, Refusal)
    assert (refused.stage_id, refused.replica, refused.left) == ("a", 1, 1)
    assert refused.holders == (("a", 2),)


def test_release_gives_one_replica_back_and_is_a_noop_for_others():
    held = reserve(Ledger.of({"gpu": 2}), [("a", 0, {"gpu": 1}), ("b", 0, {"gpu": 1})])
    assert isinstance(held, Ledger)
    after = release(held, "a", 0)
    assert after.reserved == {"gpu": 1}
    assert list(after.held) == [("b", 0)]
    assert release(after, "a", 0) is after


def test_amounts_are_the_decimals_the_config_wrote():
    # in binary floats 0.1 + 0.2 > 0.3: the second ask would be refused
    held = reserve(Ledger.of({"frac": 0.3}), [("a", 0, {"frac": 0.1}), ("b", 0, {"frac": 0.2})])
    assert isinstance(held, Ledger)
    assert held.left("frac") == 0
    # and a thousand reserve/release cycles come back to exactly zero
    ledger = held
    for _ in range(500):
        again = reserve(release(ledger, "a", 0), [("a", 0, {"frac": 0.1})])
        assert isinstance(again, Ledger)
        ledger = again
    assert ledger.reserved == {"frac": Fraction(3, 10)}
    assert release(release(ledger, "a", 0), "b", 0).reserved == {"frac": 0}


def test_a_replica_cannot_reserve_twice_nor_a_resource_without_capacity():
    held = reserve(Ledger.of({"gpu": 2}), [("a", 0, {"gpu": 1})])
    assert isinstance(held, Ledger)
    with pytest.raises(ValueError, match=r"a\[0\] already holds"):
        reserve(held, [("a", 0, {"gpu": 1})])
    with pytest.raises(ValueError, match="no capacity of 'tpu'"):
        reserve(held, [("b", 0, {"tpu": 1})])


def test_resource_ledger_raises_the_refusal_as_a_typed_error():
    ledger = ResourceLedger({"gpu": 2})
    ledger.reserve([("a", 0, {"gpu": 1.5})], "nothing was started")
    with pytest.raises(ResourceUnavailableError) as info:
        ledger.reserve([("b", 0, {"gpu": 1})], "the replica was not added")
    error = info.value
    assert isinstance(error, StageStartError)
    assert (error.stage_id, error.replica, error.resource) == ("b", 0, "gpu")
    assert (error.asked, error.left, error.capacity) == (1.0, 0.5, 2.0)
    assert str(error) == (
        "stage 'b' failed to start: replica b[0] reserves gpu=1 but only 0.5 of the capacity "
        "of 2 is left (held: a 1.5); the replica was not added"
    )
    assert ledger.statistics() == (ResourceStatistics("gpu", 2.0, 1.5),)
    assert repr(ledger) == "<ResourceLedger gpu=1.5/2 replicas=1>"
    ledger.release_all()
    assert ledger.statistics() == (ResourceStatistics("gpu", 2.0, 0.0),)


def resourced(
    *,
    capacities: dict[str, float] | None = None,
    resources: dict[str, dict[str, float]],
    backend: str = "scripted",
    **kw: Any,
) -> PipelineConfig:
    """A scripted pipeline a -> b whose stages reserve ``resources`` (by stage id)."""
    base = scripted_pipeline(["a", "b"], outputs=2, **kw)
    overrides = {
        sid: {"resources": amounts, "backend": backend} for sid, amounts in resources.items()
    }
    extra = {} if capacities is None else {"capacities": capacities}
    return load_config(base, stage_overrides=overrides, **extra)


def test_the_machine_is_read_only_for_the_resources_a_stage_asks_without_a_capacity():
    reads: list[int] = []

    def machine() -> dict[str, float]:
        reads.append(1)
        return {"cpu_cores": 2.0, "memory_gib": 7.5}

    declared = resourced(capacities={"cpu_cores": 1}, resources={"a": {"cpu_cores": 1}})
    assert pipeline_capacities(declared, machine) == {"cpu_cores": 1}
    assert reads == []
    measured = resourced(resources={"a": {"cpu_cores": 1}, "b": {"memory_gib": 1}})
    assert pipeline_capacities(measured, machine) == {"cpu_cores": 2.0, "memory_gib": 7.5}
    assert reads == [1]
    with pytest.raises(ConfigError, match=r"\$\.capacities\.memory_gib: .*cannot be read here"):
        pipeline_capacities(measured, lambda: {"cpu_cores": 2.0})


# -- the engine: its start -----------------------------------------------------------------

#: replicas whose start ran, by name (a Recorded stage's)
STARTED: list[str] = []
RECORDED = "tests.stages.test_ledger:Recorded"


class Recorded(ScriptedBackend):
    """A scripted replica that notes its start in ``STARTED``; a replica added at run time
    (index >= 1) fails its start while ``FAIL_ADDED`` holds anything."""

    async def _start(self) -> None:
        STARTED.append(self.name)
        await super()._start()
        if self.replica >= 1 and FAIL_ADDED:
            raise OSError(f"no device for {self.name}")


FAIL_ADDED: list[bool] = []


@pytest.fixture(autouse=True)
def _fresh_records():
    STARTED.clear()
    FAIL_ADDED.clear()
    yield
    STARTED.clear()
    FAIL_ADDED.clear()


async def test_a_deployment_that_does_not_fit_starts_nothing_and_names_stage_and_resource(
    autojump_clock,
):
    cfg = resourced(
        capacities={"gpu_slots": 3},
        resources={"a": {"gpu_slots": 1}, "b": {"gpu_slots": 2}},
        backend=RECORDED,
        replicas={"a": 2, "b": 1},
    )
    engine = omni_trio.open_engine(cfg)
    with pytest.raises(ResourceUnavailableError) as info:
        async with engine:
            pytest.fail("the engine opened")
    error = info.value
    assert (error.stage_id, error.replica, error.resource) == ("b", 0, "gpu_slots")
    assert (error.asked, error.left, error.capacity) == (2, 1, 3)
    assert "replica b[0] reserves gpu_slots=2 but only 1 of the capacity of 3 is left" in str(error)
    assert "(held: a 2); nothing was started" in str(error)
    assert STARTED == []  # not a replica of either stage started
    assert engine.statistics().resources == (ResourceStatistics("gpu_slots", 3.0, 0.0),)


async def test_the_machine_is_the_default_capacity_of_cpu_cores(autojump_clock):
    cores = machine_capacities(read_machine())["cpu_cores"]
    cfg = resourced(resources={"b": {"cpu_cores": cores + 1}}, backend=RECORDED)
    with pytest.raises(ResourceUnavailableError) as info:
        async with omni_trio.open_engine(cfg):
            pytest.fail("the engine opened")
    assert (info.value.resource, info.value.capacity) == ("cpu_cores", cores)
    assert STARTED == []


async def test_replicas_that_fit_start_in_parallel_and_hold_their_share(autojump_clock):
    cfg = resourced(
        capacities={"gpu_slots": 4},
        resources={"a": {"gpu_slots": 1}, "b": {"gpu_slots": 2}},
        backend=RECORDED,
        replicas={"a": 2, "b": 1},
        start_delay_s=10.0,
    )
    t0 = trio.current_time()
    async with omni_trio.open_engine(cfg) as engine:
        assert trio.current_time() - t0 == 10.0  # one start's time: all in parallel
        assert sorted(STARTED) == ["a[0]", "a[1]", "b[0]"]
        assert engine.statistics().resources == (ResourceStatistics("gpu_slots", 4.0, 4.0),)
        outs = await engine.generate("hi").collect()
        assert outs[-1].finished
    # the close gave everything back
    assert engine.statistics().resources == (ResourceStatistics("gpu_slots", 4.0, 0.0),)


async def test_stages_without_resources_reserve_nothing(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(2)) as engine:
        assert engine.statistics().resources == ()
        assert await engine.add_replica("s0") == 1


# -- the engine: membership ----------------------------------------------------------------


def reserved(engine: omni_trio.Engine) -> dict[str, float]:
    return {r.resource: r.reserved for r in engine.statistics().resources}


async def test_add_replica_over_capacity_is_refused_and_removing_gives_back(autojump_clock):
    cfg = resourced(
        capacities={"gpu_slots": 2},
        resources={"a": {"gpu_slots": 1}},
        backend=RECORDED,
    )
    async with omni_trio.open_engine(cfg) as engine:
        assert await engine.add_replica("a") == 1
        assert reserved(engine) == {"gpu_slots": 2}
        started = list(STARTED)
        with pytest.raises(ResourceUnavailableError) as info:
            await engine.add_replica("a")
        assert "replica a[2] reserves gpu_slots=1 but only 0 of the capacity of 2 is left" in str(
            info.value
        )
        assert "(held: a 2); the replica was not added" in str(info.value)
        assert STARTED == started  # nothing was built or started
        assert engine.stages[0].replicas == 2
        await engine.remove_replica("a", 0)
        assert reserved(engine) == {"gpu_slots": 1}
        # the freed share goes to the next add, which takes the next index
        assert await engine.add_replica("a") == 2
        assert reserved(engine) == {"gpu_slots": 2}
        assert [r.replica for r in engine.statistics().stage("a").replicas] == [1, 2]
        outs = await engine.generate("hi").collect()
        assert outs[-1].finished
        assert_nothing_in_flight(engine)


async def test_an_add_that_fails_to_start_gives_its_share_back(autojump_clock):
    cfg = resourced(
        capacities={"gpu_slots": 2}, resources={"a": {"gpu_slots": 1}}, backend=RECORDED
    )
    FAIL_ADDED.append(True)
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(StageStartError, match=r"added replica a\[1\]: OSError"):
            await engine.add_replica("a")
        assert reserved(engine) == {"gpu_slots": 1}
        FAIL_ADDED.clear()
        assert await engine.add_replica("a") == 2  # the share was there to take
        assert reserved(engine) == {"gpu_slots": 2}


async def test_a_restarted_replica_keeps_its_share(autojump_clock):
    cfg = resourced(
        capacities={"gpu_slots": 2},
        resources={"b": {"gpu_slots": 2}},
        stage_options={"b": {"crash_at_request": 1}},
    )
    cfg = load_config(cfg, stage_overrides={"b": {"restart": "on-failure", "restart_backoff_s": 1}})
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(omni_trio.ReplicaDeadError):
            await engine.generate("dies").collect()
        with trio.fail_after(60):
            await wait_until_settled(engine)
        assert engine.statistics().stage("b").replicas[0].restarts == 1
        assert reserved(engine) == {"gpu_slots": 2}
        with pytest.raises(ResourceUnavailableError):
            await engine.add_replica("b")


async def test_add_and_remove_cancelled_at_every_checkpoint_leave_the_ledger_as_it_was(
    autojump_clock,
):
    cfg = resourced(
        capacities={"gpu_slots": 2},
        resources={"a": {"gpu_slots": 1}},
        start_delay_s=1.0,
        stop_delay_s=1.0,
    )

    async def scenario(engine: omni_trio.Engine) -> None:
        index = await engine.add_replica("a")
        await engine.remove_replica("a", index)

    def invariant(engine: omni_trio.Engine) -> None:
        # the add was cancelled (nothing held), or the added replica is still a member
        # (cancelled in its removal before it was committed) and holds its share
        members = engine.stages[0].replicas
        assert reserved(engine) == {"gpu_slots": members}, (members, reserved(engine))

    async with omni_trio.open_engine(cfg) as engine:

        async def cleanup_scenario(engine: omni_trio.Engine) -> None:
            # a run cancelled between the add and the removal leaves a member: take it out
            for r in engine.statistics().stage("a").replicas[1:]:
                await engine.remove_replica("a", r.replica)
            await scenario(engine)

        report = await cancel_at_every_checkpoint(engine, cleanup_scenario, invariant=invariant)
        report.raise_if_failed()
        assert report.checkpoints >= 3  # the add's start, the removal's drain and stop
