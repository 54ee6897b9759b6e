"""benchmarks/bench_orchestrator.py's fake engine (_orchestrator_fake.py) on the mock clock:
the omni-trio side (whose steps hand outputs straight to the consumer through
``emit.nowait``) delivers every token of every request in order, the tokens the engines
chained by hand give, and a consumer that leaves early leaves nothing in flight."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import trio

import omni_trio

ROOT = Path(__file__).resolve().parent.parent
# the benchmark is a script with sibling modules, not a package: import them from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
fake = importlib.import_module("_orchestrator_fake")

SHAPE = {"slots": 3, "step_s": 0.002, "tokens": 6}


def expected(prompt: list[int], stages: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(stages):
        tokens = [tokens[i % len(tokens)] + 1 for i in range(SHAPE["tokens"])]
    return tokens


async def test_the_fake_engine_stage_streams_every_token_in_order(autojump_clock):
    prompts = [[1, 2, 3], [10, 20], [5], [7, 8, 9, 10], [4, 4]]
    got: dict[int, list[list[int]]] = {}
    async with omni_trio.open_engine(fake.fake_pipeline(2, SHAPE)) as engine:

        async def one(i: int) -> None:
            async with engine.generate(prompts[i]) as stream:
                got[i] = [list(out.token_ids) async for out in stream]

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        assert engine.statistics().stage_requests_in_flight == 0
    for i, prompt in enumerate(prompts):
        # streamed one token per step (the first of them may be merged while the reader
        # was not waiting), in order, the same tokens as chained by hand
        assert [t for delta in got[i] for t in delta] == expected(prompt, 2)
        assert len(got[i]) >= 2


async def test_a_consumer_leaving_mid_stream_leaves_nothing(autojump_clock):
    async with omni_trio.open_engine(fake.fake_pipeline(1, SHAPE)) as engine:
        for leave_after in range(1, SHAPE["tokens"]):
            seen = 0
            async with engine.generate([1, 2]) as stream:
                async for _out in stream:
                    seen += 1
                    if seen == leave_after:
                        break
            stats = engine.statistics()
            assert stats.requests_in_flight == 0 and stats.stage_requests_in_flight == 0


def test_cost_split_is_the_one_token_figure_and_the_slope_to_sixteen():
    assert fake.CPU_TOKENS == (1, 16)
    split = fake.cost_split({1: 100.0, 16: 250.0})
    assert split == {"fixed_us_per_request": 100.0, "us_per_output": 10.0}


async def test_fake_cpu_cells_measure_both_sides_at_each_size(autojump_clock):
    cells = await fake.fake_cpu_cells(4, passes=1, batches=1)
    assert [c["stages"] for c in cells] == [1, 3]
    for cell in cells:
        for side in ("omni", "floor"):
            figures = cell[side]
            few, many = figures["us_per_request_1_tokens"], figures["us_per_request_16_tokens"]
            assert few > 0 and many > 0  # thread CPU was spent on each side
            # the split is made of the two sizes' own figures
            assert abs(figures["fixed_us_per_request"] - few) < 0.06
            assert abs(figures["us_per_output"] - (many - few) / 15) < 0.02  # from rounded figures


async def test_every_fake_engine_step_is_counted_once(autojump_clock):
    # 3 requests fill the 3 slots: one wave of 6 steps per stage, on either side
    async with omni_trio.open_engine(fake.fake_pipeline(2, SHAPE)) as engine:
        before = fake.FakeEngine.all_steps
        await fake.run_fake_omni(engine, 3, "steps", SHAPE["tokens"])
        assert fake.FakeEngine.all_steps - before == 2 * SHAPE["tokens"]
    before = fake.FakeEngine.all_steps
    await fake.run_fake_floor(2, 3, SHAPE)
    assert fake.FakeEngine.all_steps - before == 2 * SHAPE["tokens"]


async def test_fake_engine_cells_report_the_loop_cpu_per_step_of_both_sides(autojump_clock):
    cells = await fake.fake_engine_cells(3, passes=2, shape=SHAPE)
    assert [c["stages"] for c in cells] == [1, 2, 3]
    for cell in cells:
        assert set(cell["cpu_us_per_step"]) == {"omni", "floor"}
        assert all(us > 0 for us in cell["cpu_us_per_step"].values())
        low, high = cell["wall_ratio_min_max"]
        assert low <= cell["wall_ratio_median"] <= high


def test_the_exact_step_clock_blocks_until_a_millisecond_before_the_deadline_then_polls():
    clock = fake.ExactStepClock(now=lambda: 10.0)
    assert clock.current_time() == 10.0
    assert abs(clock.deadline_to_sleep_time(10.005) - 0.004) < 1e-9
    assert clock.deadline_to_sleep_time(10.0005) == 0.0  # the last millisecond: poll
    assert clock.deadline_to_sleep_time(9.0) == 0.0  # due already
    assert clock.deadline_to_sleep_time(float("inf")) == float("inf")  # nothing to wait for


async def test_fake_engine_cells_leave_the_cpu_figures_out_when_asked(autojump_clock):
    cells = await fake.fake_engine_cells(3, passes=1, shape=SHAPE, cpu_figures=False)
    assert all("cpu_us_per_step" not in c and c["wall_ratio_median"] > 0 for c in cells)
