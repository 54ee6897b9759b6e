"""Membership changes racing the engine's close and each other (scripted stages, MockClock):
an ``add_replica`` whose replica is still starting when the engine closes, overruns its
``stage_init_timeout``, or is removed; failures at each step of an add; cancellation at every
checkpoint. After each: the stage is unchanged (statistics, health, ``engine.stages``) and no
task of the add is left running."""

import logging
import re
from contextlib import nullcontext

import pytest
import trio
import trio.testing

from omni_trio import (
    EngineClosedError,
    InvalidRequestError,
    StageStartError,
    StageStopError,
    open_engine,
)
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.stages.pool import StagePool, join_failure
from omni_trio.testing import assert_nothing_in_flight, cancel_at_every_checkpoint

from .test_binding import pipeline, run, stage
from .test_replicas import lone_pool

#: how an added replica (index >= 1) of an ``AddedReplica`` stage behaves; set per test
SCRIPT: dict[str, object] = {}
ADDED = "tests.stages.test_membership:AddedReplica"


class AddedReplica(ScriptedBackend):
    """A scripted replica; the ones added to the pool (index >= 1) follow ``SCRIPT``:
    ``start_s`` more to start, ``fail_init``/``fail_start``/``fail_stop`` raise OSError there,
    ``stop_s`` more to stop. The configured replica starts and stops as the options say."""

    def __init__(self, config, *, stage_index, replica=0):
        if replica >= 1 and SCRIPT.get("fail_init"):
            raise OSError(f"no config for {config.id}[{replica}]")
        super().__init__(config, stage_index=stage_index, replica=replica)

    @property
    def added(self):
        return self.replica >= 1

    async def _start(self):
        await super()._start()
        if self.added:
            await trio.sleep(SCRIPT.get("start_s", 0.0))
            if SCRIPT.get("fail_start"):
                raise OSError(f"no device for {self.name}")

    async def _stop(self):
        await super()._stop()
        if self.added:
            await trio.sleep(SCRIPT.get("stop_s", 0.0))
            if SCRIPT.get("fail_stop"):
                raise OSError(f"cannot release {self.name}")


@pytest.fixture
def script():
    SCRIPT.clear()
    yield SCRIPT
    SCRIPT.clear()


def config(**top):
    options = top.pop("options", {})
    keys = top.pop("stage_keys", {})
    return pipeline(stage("a", 1, backend=ADDED, options=options, **keys), **top)


def task_names():
    """The names of every live trio task (to tell that no task of an add is left)."""
    names = []
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        names.append(task.name)
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return names


def added_replica_tasks():
    """How many supervising tasks of added replicas are running."""
    return sum(1 for name in task_names() if str(name).endswith("StagePool._serve_added"))


def states(engine):
    return [r.state for r in engine.statistics().stage("a").replicas]


def assert_unchanged(engine):
    """Stage 'a' is its one configured replica again, everywhere it is reported."""
    assert [r.replica for r in engine.statistics().stage("a").replicas] == [0]
    assert states(engine) == ["ready"]
    assert engine.stages[0].replicas == 1
    health = engine.check_health()
    assert health.status == "ok", health.message
    assert (health.stage("a").live_replicas, health.stage("a").total_replicas) == (1, 1)
    assert added_replica_tasks() == 0
    assert_nothing_in_flight(engine)


async def add_into(engine, outcome, stage_id="a"):
    try:
        outcome["add"] = await engine.add_replica(stage_id)
    except Exception as exc:
        outcome["add"] = exc


# -- the engine closes while an added replica starts ----------------------------------------
@pytest.mark.parametrize(("stop_s", "close_s"), [(0.0, 0.0), (1000.0, 10.0)])
async def test_close_cancels_an_add_whose_replica_is_starting(
    autojump_clock, script, stop_s, close_s
):
    script.update(start_s=999.0)
    cfg = config(shutdown_timeout=5, options={"stop_delay_s": stop_s})
    outcome = {}
    async with open_engine(cfg) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_into, engine, outcome)
            await trio.testing.wait_all_tasks_blocked()
            starting = engine.pools["a"].replica(1)
            assert states(engine) == ["ready", "starting"]
            assert added_replica_tasks() == 1
            t0 = trio.current_time()
            overran = pytest.raises(StageStopError, match=r"^1 replica\(s\) .*: a\[0\]: TooSlow")
            with overran if stop_s else nullcontext():
                await engine.aclose()
            # the add's stop (bounded by shutdown_timeout), then the stage's: not the 999 s
            # the start would have taken
            assert trio.current_time() - t0 == close_s
    assert isinstance(outcome["add"], EngineClosedError)
    assert str(outcome["add"]) == "the engine closed while add_replica('a') was pending"
    assert starting.state == "stopped"
    assert [r.replica for r in engine.statistics().stage("a").replicas] == [0]
    assert states(engine) == ["stopped"]
    assert engine.stages[0].replicas == 1
    assert engine.check_health().status == "closed"
    assert engine.statistics().closed
    assert added_replica_tasks() == 0
    assert_nothing_in_flight(engine)


async def test_close_while_adding_logs_the_stop_failure_of_the_cancelled_start(
    autojump_clock, script, caplog
):
    script.update(start_s=999.0, fail_stop=True)
    outcome = {}
    with caplog.at_level(logging.WARNING, logger="omni_trio.stages.backend"):
        async with open_engine(config()) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(add_into, engine, outcome)
                await trio.testing.wait_all_tasks_blocked()
                await engine.aclose()
    assert isinstance(outcome["add"], EngineClosedError)
    # not a member, so not the close's StageStopError; logged, not lost
    assert any("a[1] did not stop cleanly: OSError" in r.getMessage() for r in caplog.records)


async def test_add_and_remove_after_close_are_refused(autojump_clock, script):
    async with open_engine(config()) as engine:
        pass
    for call in (engine.add_replica("a"), engine.remove_replica("a", 0)):
        with trio.testing.assert_checkpoints(), pytest.raises(EngineClosedError):
            await call


# -- the pool stops while an added replica starts ------------------------------------------
@pytest.mark.parametrize(("stop_s", "stop_took"), [(0.0, 0.0), (1000.0, 5.0)])
async def test_a_stopping_pool_cancels_an_add_in_parallel_with_its_replicas(
    autojump_clock, script, stop_s, stop_took
):
    script.update(start_s=999.0)
    pool = lone_pool(AddedReplica, shutdown_timeout=5, options={"stop_delay_s": stop_s})
    assert isinstance(pool, StagePool)
    outcome = {}
    pool_scope = trio.CancelScope()
    stop_errors = []

    async def serve(*, task_status):
        with pool_scope:
            try:
                await pool.serve(task_status=task_status)
            except StageStopError as exc:
                stop_errors.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(serve)
        nursery.start_soon(add_into_pool, pool, outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert [r.state for r in pool.statistics().replicas] == ["ready", "starting"]
        t0 = trio.current_time()
        pool_scope.cancel()
    # both replicas stopped together, each bounded by shutdown_timeout
    assert trio.current_time() - t0 == stop_took
    error = outcome["add"]
    assert isinstance(error, EngineClosedError)
    expected = "stage 'a' stopped while its added replica a[1] was starting; it was not added"
    if stop_s:
        assert str(error).startswith(expected + " (and did not stop cleanly: a[1]: TooSlowError")
    else:
        assert str(error) == expected
    # the pool's stop failures are its members' (a[1] never joined: its add names it)
    assert [[name for name, _ in e.failures] for e in stop_errors] == ([["a[0]"]] if stop_s else [])
    if stop_s:
        assert str(error.__cause__).startswith("1 replica(s) did not stop cleanly: a[1]")
    assert [r.replica for r in pool.statistics().replicas] == [0]
    assert added_replica_tasks() == 0
    with trio.testing.assert_checkpoints(), pytest.raises(EngineClosedError, match="not serving"):
        await pool.add_replica()


async def add_into_pool(pool, outcome):
    try:
        outcome["add"] = await pool.add_replica()
    except Exception as exc:
        outcome["add"] = exc


# -- stage_init_timeout ----------------------------------------------------------------------
async def failing_add(engine, message):
    """``engine.add_replica("a")`` raising StageStartError matching ``message``; returns the
    trio-clock seconds it took."""
    t0 = trio.current_time()
    with pytest.raises(StageStartError, match=message):
        await engine.add_replica("a")
    return trio.current_time() - t0


@pytest.mark.parametrize("where", ["stage", "pipeline"])
async def test_an_add_overrunning_stage_init_timeout_leaves_the_stage_unchanged(
    autojump_clock, script, where
):
    script.update(start_s=1000.0)
    keys = {"stage_init_timeout": 10}
    cfg = config(**keys) if where == "pipeline" else config(stage_keys=keys)
    async with open_engine(cfg) as engine:
        took = await failing_add(
            engine,
            r"^stage 'a' failed to start: added replica a\[1\] did not start within "
            r"stage_init_timeout=10(\.0)?s$",
        )
        assert took == 10
        assert_unchanged(engine)
        # the deadline bounds the start only: a replica that starts in time keeps serving
        script.update(start_s=9.0)
        assert await engine.add_replica("a") == 2
        await trio.sleep(100)
        assert states(engine) == ["ready", "ready"]
        assert (await run(engine, "r"))[-1].finished


async def test_an_add_that_overruns_and_does_not_stop_names_both(autojump_clock, script):
    script.update(start_s=1000.0, stop_s=1000.0)
    async with open_engine(config(stage_init_timeout=10, shutdown_timeout=5)) as engine:
        took = await failing_add(
            engine,
            r"did not start within stage_init_timeout=10(\.0)?s \(and did not stop "
            r"cleanly: a\[1\]: TooSlowError: stop did not finish within shutdown_timeout=5",
        )
        assert took == 10 + 5
        assert_unchanged(engine)


# -- a failure at each step of an add ------------------------------------------------------
@pytest.mark.parametrize(
    ("failure", "message", "cause"),
    [
        ({"fail_init": True}, r"added replica a\[1\]: ConfigError: .*no config for a\[1\]", None),
        ({"fail_start": True}, r"added replica a\[1\]: OSError: no device for a\[1\]$", OSError),
        (
            {"fail_start": True, "fail_stop": True},
            r"added replica a\[1\]: OSError: no device for a\[1\] \(and did not stop cleanly: "
            r"a\[1\]: OSError: cannot release a\[1\]\)$",
            OSError,
        ),
    ],
    ids=["backend", "start", "start-and-stop"],
)
async def test_a_failed_add_leaves_the_stage_unchanged(
    autojump_clock, script, failure, message, cause
):
    script.update(start_s=3.0, **failure)
    async with open_engine(config()) as engine:
        with trio.testing.assert_checkpoints():
            with pytest.raises(StageStartError, match=message) as info:
                await engine.add_replica("a")
        assert info.value.stage_id == "a"
        assert info.value.__cause__ is not None
        if cause is not None:
            assert type(info.value.__cause__) is cause
        assert_unchanged(engine)
        # nothing else was affected: the stage serves, and the next add takes a new index
        assert (await run(engine, "r"))[-1].finished
        script.clear()
        assert await engine.add_replica("a") == 2


# -- remove_replica of a replica that is being added -----------------------------------------
async def test_removing_a_starting_replica_cancels_its_start(autojump_clock, script):
    script.update(start_s=1000.0, stop_s=2.0)
    outcome = {}
    async with open_engine(config()) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_into, engine, outcome)
            await trio.testing.wait_all_tasks_blocked()
            starting = engine.pools["a"].replica(1)
            report = engine.check_health()
            assert report.status == "degraded" and "a[1] starting" in report.message
            t0 = trio.current_time()
            nursery.start_soon(engine.remove_replica, "a", 1)
            await trio.testing.wait_all_tasks_blocked()
            # while its start is being cancelled it is stopping: listed, not a member
            assert states(engine) == ["ready", "stopped"]
            assert engine.check_health().status == "ok"
            assert engine.check_health().stage("a").total_replicas == 1
        assert trio.current_time() - t0 == 2.0  # its stop, not its start
    error = outcome["add"]
    assert isinstance(error, StageStartError)
    assert str(error) == (
        "stage 'a' failed to start: added replica a[1] was removed while it was starting"
    )
    assert starting.state == "stopped"
    assert states(engine) == ["stopped"]  # the engine closed; a[1] was gone before
    assert [r.replica for r in engine.statistics().stage("a").replicas] == [0]


async def test_removing_a_starting_replica_whose_stop_fails_reports_it_to_both(
    autojump_clock, script
):
    script.update(start_s=1000.0, fail_stop=True)
    outcome = {}
    async with open_engine(config()) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_into, engine, outcome)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(StageStopError, match=r"a\[1\]: OSError: cannot release a\[1\]"):
                await engine.remove_replica("a", 1)
        error = outcome["add"]
        assert isinstance(error, StageStartError)
        assert re.search(
            r"was removed while it was starting \(and did not stop cleanly: a\[1\]: OSError",
            str(error),
        )
        assert_unchanged(engine)


async def test_a_replica_that_became_ready_is_removed_normally(autojump_clock, script):
    # the other order: the add completes, then the removal drains and stops it
    script.update(start_s=5.0)
    cfg = config(options={"latency_s": 1.0, "outputs": 3})
    async with open_engine(cfg) as engine:
        index = await engine.add_replica("a")
        assert states(engine) == ["ready", "ready"]
        async with trio.open_nursery() as nursery:
            for rid in ("r0", "r1"):
                nursery.start_soon(run, engine, rid)
            await trio.testing.wait_all_tasks_blocked()
            on_added = [r for r in ("r0", "r1") if engine.pools["a"].replica_of(r).replica == 1]
            assert on_added
            await engine.remove_replica("a", index)
        assert_unchanged(engine)
        assert engine.statistics().requests_finished == 2


async def cancellable_add(engine, scope):
    with scope:
        await engine.add_replica("a")
    assert scope.cancelled_caught


@pytest.mark.parametrize("first", ["remove", "cancel"])
async def test_a_cancelled_add_and_a_removal_of_its_replica_in_either_order(
    autojump_clock, script, first
):
    # both evict the starting replica: it leaves the pool once, and neither call fails
    # unexpectedly (the removal is refused once the cancelled add is removing it already)
    script.update(start_s=1000.0, stop_s=2.0)
    async with open_engine(config()) as engine:
        async with trio.open_nursery() as nursery:
            add_scope = trio.CancelScope()
            nursery.start_soon(cancellable_add, engine, add_scope)
            await trio.testing.wait_all_tasks_blocked()
            if first == "remove":
                nursery.start_soon(engine.remove_replica, "a", 1)
                await trio.testing.wait_all_tasks_blocked()
                add_scope.cancel()
            else:
                add_scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert states(engine) == ["ready", "stopped"]
                with pytest.raises(
                    InvalidRequestError,
                    match=r"no replica 1 to remove \(it is already being removed\); its "
                    r"replicas are \[0\]",
                ):
                    await engine.remove_replica("a", 1)
        assert_unchanged(engine)


async def test_removing_a_dead_replica_drops_it(autojump_clock, script):
    async with open_engine(config()) as engine:
        assert await engine.add_replica("a") == 1
        engine.pools["a"].replica(1).kill(RuntimeError("injected"))
        await trio.testing.wait_all_tasks_blocked()
        assert states(engine) == ["ready", "dead"]
        await engine.remove_replica("a", 1)
        assert_unchanged(engine)


# -- cancellation at every checkpoint --------------------------------------------------------
def only_ready_replicas(engine):
    assert set(states(engine)) == {"ready"}, states(engine)
    assert engine.stages[0].replicas == len(states(engine))
    # one task per added replica that joined: none left of a cancelled add
    assert added_replica_tasks() == len(states(engine)) - 1


async def tidy(engine):
    for r in engine.statistics().stage("a").replicas[1:]:
        await engine.remove_replica("a", r.replica)
    assert_unchanged(engine)


async def test_cancel_at_every_checkpoint_of_add_replica(autojump_clock, script):
    script.update(start_s=2.0, stop_s=1.0)

    async def scenario(engine):
        await engine.add_replica("a")
        assert (await run(engine, "r"))[-1].finished

    async with open_engine(config()) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=only_ready_replicas)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 7
        await tidy(engine)


async def test_cancel_at_every_checkpoint_of_removing_a_starting_replica(autojump_clock, script):
    script.update(start_s=1000.0, stop_s=1.0)

    async def add_to_be_removed(engine):
        with pytest.raises(StageStartError, match="was removed while it was starting"):
            await engine.add_replica("a")

    async def scenario(engine):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_to_be_removed, engine)
            while "starting" not in states(engine):
                await trio.lowlevel.checkpoint()
            (index,) = [
                r.replica for r in engine.statistics().stage("a").replicas if r.state == "starting"
            ]
            await engine.remove_replica("a", index)

    async with open_engine(config()) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=only_ready_replicas)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 8
        assert_unchanged(engine)


# -- the outcome rule, pure ------------------------------------------------------------------
def test_join_failure_names_why_the_replica_did_not_join():
    stop = ("a[1]", OSError("cannot release"))
    boom = OSError("no device")

    def why(**kw):
        args = {"removed": False, "closing": False, "timeout": None, "cause": None, "stops": []}
        return join_failure("a", "a[1]", **{**args, **kw})

    error = why(cause=boom)
    assert (type(error), error.__cause__) == (StageStartError, boom)
    assert str(error) == "stage 'a' failed to start: added replica a[1]: OSError: no device"
    assert str(why(timeout=10.0)).endswith("a[1] did not start within stage_init_timeout=10.0s")
    # a removal wins over the pool's stop; the pool's stop is EngineClosedError
    assert str(why(removed=True, closing=True)).endswith("was removed while it was starting")
    closed = why(closing=True, stops=[stop])
    assert isinstance(closed, EngineClosedError)
    assert str(closed).endswith(
        "it was not added (and did not stop cleanly: a[1]: OSError: cannot release)"
    )
    # a StageStopError is how a cancelled start that did not stop ends: not the reason
    stopped = StageStopError([stop])
    error = why(timeout=10.0, cause=stopped, stops=[stop])
    assert error.__cause__ is stopped
    assert "stage_init_timeout=10.0s (and did not stop cleanly: a[1]: OSError" in str(error)
    assert str(why(cause=stopped)).endswith("a[1] ended before it was ready")
