"""benchmarks/bench_pd.py: its pure helpers (what ExampleConnector loads, the prompt lengths
it accepts, the prompts, the cell order, the single engine's config, the check of pd against
single, a cell's figures and the ratios), and the script in its quick mode on the real
engines (slow, vllm): it exits 0, and its JSON holds together and says the handoff was
right."""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest

from omni_trio.config import load_config
from omni_trio.pipelines import pipeline_path

from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_pd.py"

# the benchmark is a script with sibling modules, not a package: import it from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_pd")


def _reply(k: int = 0, ids: tuple[int, ...] = (1, 2), n: int = 48, cached: int = 32, **kw):
    fields = {"arrival_s": 0.002, "ttft_s": 0.01, "latency_s": 0.1, "engine_ttft_s": 0.005, **kw}
    return bench.Reply(k, token_ids=list(ids), prompt_tokens=n, cached_tokens=cached, **fields)


def test_what_example_connector_loads_and_the_lengths_it_takes() -> None:
    # whole blocks of the prompt less its last token; nothing when n - 1 fills whole blocks
    loads = {n: bench.loaded_tokens(n) for n in (1, 33, 34, 64, 65, 66, 208)}
    assert loads == {1: 0, 33: 0, 34: 32, 64: 32, 65: 0, 66: 64, 208: 192}
    assert bench.check_lengths([48, 80], 16) == [48, 80]
    with pytest.raises(ValueError, match="65 tokens loads nothing"):
        bench.check_lengths([48, 65], 16)
    with pytest.raises(ValueError, match="exceed max_model_len 256"):
        bench.check_lengths([250], 16)
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths", "33"])
    quick = bench.parse_args(["--quick"])
    assert (quick.passes, quick.requests, quick.concurrency) == (1, 4, 2)


def test_prompts_cycle_their_lengths_and_cells_rotate() -> None:
    prompts = bench.make_prompts([48, 80], 5, random.Random(0))
    assert [len(p) for p in prompts] == [48, 80, 48, 80, 48]
    assert all(bench.FIRST_ID <= t < bench.VOCAB for p in prompts for t in p)
    assert len({tuple(p) for p in prompts}) == 5  # every prompt new to every engine
    orders = [bench.cell_order(p) for p in range(len(bench.CELLS))]
    for position in range(len(bench.CELLS)):
        assert {order[position] for order in orders} == set(bench.CELLS)


def test_the_single_engine_is_the_decodes_without_the_connector() -> None:
    pd = load_config(pipeline_path("tiny-pd"), check_vllm=False)
    single = load_config(bench.single_config(pd), check_vllm=False)
    (stage,) = single.stages
    decode = dict(pd.stage("decode").engine_args)
    decode.pop("kv_transfer_config")
    assert stage.engine_args == decode and stage.final_output
    assert not (stage.is_prefill_only or stage.is_decode_only)
    assert "cpu_bind" not in stage.options  # vLLM's default binding, unless a layout says
    assert bench.single_config(pd, "1")["stages"][0]["options"] == {"cpu_bind": "1"}


def test_the_layouts_bind_the_pair_and_move_its_store() -> None:
    spread = load_config(
        pipeline_path("tiny-pd"),
        check_vllm=False,
        stage_overrides=bench.pd_overrides("/s", "spread"),
    )
    assert [s.options.get("cpu_bind") for s in spread.stages] == ["0", "1"]
    for stage in spread.stages:
        kv = stage.engine_args["kv_transfer_config"]
        assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/s"}
    default = bench.pd_overrides("/s", "default")
    assert all("options" not in o for o in default.values())


def test_the_check_pairs_pd_with_single_by_pass_and_mode() -> None:
    good = [_reply(0), _reply(1, n=80, cached=64)]
    runs = [
        bench.CellRun("single_sequential", 0, 1.0, 1.0, [_reply(0, cached=0), _reply(1)]),
        bench.CellRun("pd_sequential", 0, 2.0, 2.0, good),
        bench.CellRun("single_sequential", 1, 1.0, 1.0, [_reply(0), _reply(1)]),
        # pass 1: one answer differs, one decode loaded less than the connector stores
        bench.CellRun("pd_sequential", 1, 2.0, 2.0, [_reply(0, ids=(9,)), _reply(1, cached=0)]),
    ]
    check = bench.check_replies(runs)
    assert check["same_tokens"] is False and check["loaded_as_expected"] is False
    assert check["requests_checked"] == 4
    assert check["mismatches"] == [
        {"pass": 1, "cell": "pd_sequential", "request": 0, "differs": ["tokens"]},
        {"pass": 1, "cell": "pd_sequential", "request": 1, "differs": ["loaded 0, expected 32"]},
    ]
    assert check["decode_prompt_tokens"] == {"loaded": 32 + 64 + 32, "computed": 16 + 16 + 16 + 48}
    assert bench.check_replies(runs[:2])["same_tokens"] is True


def test_a_cell_and_the_ratios() -> None:
    runs = []
    for p, (single_wall, pd_wall) in enumerate([(1.0, 2.0), (1.0, 4.0)]):
        for mode in bench.MODES:
            runs.append(bench.CellRun(f"single_{mode}", p, single_wall, 2.0, [_reply()] * 2))
            slow = _reply(ttft_s=0.04, engine_ttft_s=None)
            runs.append(bench.CellRun(f"pd_{mode}", p, pd_wall, 4.0, [slow] * 2))
    cells = {c: bench.summarize_cell([r for r in runs if r.cell == c]) for c in bench.CELLS}
    single = cells["single_sequential"]
    assert single["requests"] == 4 and single["requests_per_s"]["median"] == 2.0
    assert single["cpu_s_per_request"] == 1.0 and single["engine_ttft_s"]["p50"] == 0.005
    assert cells["pd_sequential"]["engine_ttft_s"] is None
    ratios = bench.ratios(cells, runs)
    # pd/single per pass: 0.5 and 0.25; above 1 would be pd better
    assert ratios["sequential_rps"] == {"median": 0.375, "min": 0.25, "max": 0.5}
    assert ratios["concurrent_ttft_p50"] == pytest.approx(0.25)
    assert ratios["cpu_per_request"] == 0.5


@pytest.mark.slow
@pytest.mark.vllm
def test_the_quick_run_hands_the_cache_over_and_answers_as_one_engine() -> None:
    done = run_bounded([sys.executable, str(SCRIPT), "--quick"], 600, "bench_pd.py --quick")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "pd"
    assert set(result["cells"]) == set(bench.CELLS)
    for name, cell in result["cells"].items():
        assert cell["requests"] == 4, name
        assert cell["ttft_s"]["p50"] <= cell["latency_s"]["p50"], name
    assert all(result["ratios"][f"{m}_rps"]["median"] > 0 for m in bench.MODES)
    check = result["check"]
    assert check["requests_checked"] == 8
    assert check["same_tokens"] is True and check["loaded_as_expected"] is True, check
    # 2 pd cells x 4 requests: 48 and 112 tokens, 4 of each
    assert check["decode_prompt_tokens"]["loaded"] == 4 * (32 + 96)
    # every prompt the pd system ran (its warm-up's too) was stored by its prefill, once
    assert result["workload"]["prompts_stored"] == 2 + 2 * 4
