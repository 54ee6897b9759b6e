"""What the runs of ``bench_vllm_pipeline.py`` become: a run's throughput and frontend CPU, a
cell's ratios and spreads over passes, the compact summary row, the rounded report, and the
progress line of one run. Pure: no vLLM, no processes."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .vllm_cells import OMNI_LOOPS, TRACED, TRACING_AB, VERSUS_HAND, Run, bind_for, cell_name


def batch_throughput(walls: Sequence[float], requests: int) -> dict[str, float]:
    """Requests/s of the best and of the median batch."""
    rates = [requests / w for w in walls]
    return {"best": max(rates), "median": statistics.median(rates)}


def cpu_ms_per_request_stage(cpu_s: float, requests: int, batches: int, stages: int) -> float:
    return 1000.0 * cpu_s / (requests * batches * stages)


def cpu_split_ms_per_request_stage(
    before: dict[str, float], after: dict[str, float], requests: int, batches: int, stages: int
) -> dict[str, float]:
    """:func:`cpu_ms_per_request_stage` of each thread group between two
    ``thread_cpu()`` snapshots."""
    return {
        group: cpu_ms_per_request_stage(after[group] - before[group], requests, batches, stages)
        for group in after
    }


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max of ``values`` (None when there are none)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratios(
    passes: Sequence[dict[str, dict[str, Any]]],
    key: Callable[[dict[str, Any]], float],
    system: str = "omni",
    base: str = "hand",
) -> list[float]:
    """``system``/``base`` of ``key`` for every pass where both systems produced a result."""
    return [key(p[system]) / key(p[base]) for p in passes if succeeded(p, base, system)]


def succeeded(one_pass: dict[str, dict[str, Any]], *systems: str) -> bool:
    """Whether every one of ``systems`` ran in this pass and produced a result."""
    return all(s in one_pass and "error" not in one_pass[s] for s in systems)


def _rps(result: dict[str, Any]) -> float:
    return float(result["requests_per_s"]["median"])


def _cpu(result: dict[str, Any]) -> float:
    return float(result["cpu_ms_per_request_stage"])


def summarize_cell(
    n_stages: int, layout: str, passes: Sequence[dict[str, dict[str, Any]]], systems: Sequence[str]
) -> dict[str, Any]:
    """One cell of the report from its passes (``{system: child result}`` each)."""

    def per_pass(system: str, field: Callable[[dict[str, Any]], Any]) -> list[Any]:
        """``field`` of the system's result in every pass (None where it failed)."""
        return [field(p[system]) if succeeded(p, system) else None for p in passes]

    versus = {}
    for s in VERSUS_HAND:
        if s in systems:
            # against the same hand-driven program
            versus[f"{s}_ratio"] = spread(paired_ratios(passes, _rps, s))
            versus[f"{s}_cpu_ratio"] = spread(paired_ratios(passes, _cpu, s))
    first, second = OMNI_LOOPS
    if first in systems and second in systems:
        # omni-trio on one worker loop against the other, run for run
        versus["loop_ratio"] = spread(paired_ratios(passes, _rps, second, first))
        versus["loop_cpu_ratio"] = spread(paired_ratios(passes, _cpu, second, first))
    if TRACED in systems and first in systems:
        # tracing on against off, run for run (below 1: tracing costs throughput)
        versus["tracing_ratio"] = spread(paired_ratios(passes, _rps, TRACED, first))
        versus["tracing_cpu_ratio"] = spread(paired_ratios(passes, _cpu, TRACED, first))
    if TRACING_AB in systems:
        # tracing on against off, batch against batch in one process
        abs_ = [ab for ab in per_pass(TRACING_AB, lambda r: r.get("ab")) if ab is not None]
        versus["tracing_ab_ratio"] = spread([ab["ratio"] for ab in abs_])
        versus["tracing_ab_cpu_ratio"] = spread([ab["cpu_ratio"] for ab in abs_])
        versus["tracing_ab_cpu_split_ms_median"] = {
            mode: _split_median([ab[mode]["cpu_split_ms"] for ab in abs_]) for mode in ("off", "on")
        }
    return {
        "cell": cell_name(n_stages, layout),
        "stages": n_stages,
        "layout": layout,
        "binds": [bind_for(layout, k) for k in range(n_stages)],
        "ratio": spread(paired_ratios(passes, _rps)),
        "cpu_ratio": spread(paired_ratios(passes, _cpu)),
        "requests_per_s": {s: per_pass(s, _rps) for s in systems},
        "best_batch_requests_per_s": {
            s: per_pass(s, lambda r: r["requests_per_s"]["best"]) for s in systems
        },
        "cpu_ms_per_request_stage": {s: per_pass(s, _cpu) for s in systems},
        "cpu_ms_per_request_stage_median": {s: _median(per_pass(s, _cpu)) for s in systems},
        "cpu_split_ms_median": {
            s: _split_median(per_pass(s, lambda r: r.get("cpu_split_ms"))) for s in systems
        },
        "init_s": {s: per_pass(s, lambda r: r["init_s"]) for s in systems},
        "shutdown_s": {s: per_pass(s, lambda r: r["shutdown_s"]) for s in systems},
        "tokens_ok": {s: per_pass(s, lambda r: r["tokens_ok"]) for s in systems},
        "stop": {s: per_pass(s, lambda r: r["stop"]) for s in systems},
        "idle": {s: per_pass(s, lambda r: r.get("idle")) for s in systems},
        "leftover": {
            s: [
                {"pass": i, **p[s]["leftover"]}
                for i, p in enumerate(passes)
                if s in p and p[s].get("leftover", {}).get("at_exit")
            ]
            for s in systems
        },
        "errors": {
            s: [p[s]["error"] for p in passes if s in p and "error" in p[s]] for s in systems
        },
        **versus,
    }


def summary_row(cell: dict[str, Any]) -> dict[str, Any]:
    """The compact line of a cell: median ratio, its spread, frontend CPU of each system."""
    ratio, cpu_ratio = cell["ratio"], cell["cpu_ratio"]

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    versus = {}
    for s in VERSUS_HAND:
        if f"{s}_ratio" in cell:
            versus[f"cpu_ms_{s}"] = r3(cell["cpu_ms_per_request_stage_median"].get(s))
    kinds = ("ratio", "cpu_ratio")
    systems = (*VERSUS_HAND, "loop", "tracing", "tracing_ab")
    for key in [f"{s}_{kind}" for s in systems for kind in kinds]:
        if key in cell:
            versus[key] = cell[key] and r3(cell[key]["median"])
    if "tracing_ab_cpu_split_ms_median" in cell:
        versus["tracing_ab_loop_ms"] = {
            mode: split and r3(split["loop"])
            for mode, split in cell["tracing_ab_cpu_split_ms_median"].items()
        }
    return {
        "ratio": ratio and r3(ratio["median"]),
        "spread": ratio and [r3(ratio["min"]), r3(ratio["max"])],
        "cpu_ms_hand": r3(cell["cpu_ms_per_request_stage_median"].get("hand")),
        "cpu_ms_omni": r3(cell["cpu_ms_per_request_stage_median"].get("omni")),
        "cpu_ratio": cpu_ratio and r3(cpu_ratio["median"]),
        "cpu_ms_by_thread": {
            s: split and {group: r3(ms) for group, ms in split.items()}
            for s, split in cell["cpu_split_ms_median"].items()
        },
        "init_s": {s: _median(cell["init_s"][s]) for s in cell["init_s"]},
        "shutdown_s": {s: _median(cell["shutdown_s"][s]) for s in cell["shutdown_s"]},
        "slowest_own_stop_s": {s: _stop_median(cell, s, "slowest_own_stop") for s in cell["stop"]},
        "stop_gap_s": {s: _stop_median(cell, s, "gap") for s in cell["stop"]},
        "idle_cpu_s": {s: _idle_median(cell["idle"][s]) for s in cell["idle"]},
        "left_at_exit": sum(len(r["at_exit"]) for v in cell["leftover"].values() for r in v),
        "left_after_grace": sum(
            len(r["after_grace"]) for v in cell["leftover"].values() for r in v
        ),
        "failed_runs": sum(len(v) for v in cell["errors"].values()),
        **versus,
    }


def _stop_median(cell: dict[str, Any], system: str, field: str) -> float | None:
    """The median over passes of one figure of the stop breakdowns of ``system``."""
    return _median([None if stop is None else stop[field] for stop in cell["stop"][system]])


def _split_median(splits: Sequence[dict[str, float] | None]) -> dict[str, float] | None:
    """Median over passes of each thread group's CPU ms per request-stage."""
    present = [s for s in splits if s is not None]
    if not present:
        return None
    return {group: statistics.median(s[group] for s in present) for group in present[0]}


def _idle_median(idles: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Median over passes of the idle CPU seconds of the frontend and of all engines."""
    present = [i for i in idles if i is not None]
    if not present:
        return None
    return {
        "seconds": present[0]["seconds"],
        "frontend": _median([i["frontend_cpu_s"] for i in present]),
        "engines": _median([sum(i["engines_cpu_s"].values()) for i in present]),
    }


def _median(values: Sequence[float | None]) -> float | None:
    """The median of the values present (None when none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to 4 digits (for the printed report)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def describe(run: Run, result: dict[str, Any]) -> str:
    head = f"pass {run.pass_index + 1} {cell_name(run.n_stages, run.layout)} {run.system}:"
    if "error" in result:
        return f"{head} FAILED {result['error']}\n{result.get('stderr', '')}"
    left, stop = result["leftover"], result["stop"]
    return (
        f"{head} {result['requests_per_s']['median']:.1f} req/s (best "
        f"{result['requests_per_s']['best']:.1f}), cpu {result['cpu_ms_per_request_stage']:.2f} "
        f"ms/request-stage{_describe_split(result.get('cpu_split_ms'))}, "
        f"init {result['init_s']:.1f} s, shutdown {result['shutdown_s']:.1f} s"
        f" (slowest engine's own stop {_seconds(stop['slowest_own_stop'])}, gap "
        f"{_seconds(stop['gap'])})"
        + ("" if result["tokens_ok"] else ", TOKENS MISSING")
        + (
            f", tracing on/off {result['ab']['ratio']:.3f} (cpu {result['ab']['cpu_ratio']:.3f},"
            f" loop {result['ab']['off']['cpu_split_ms']['loop']:.2f} -> "
            f"{result['ab']['on']['cpu_split_ms']['loop']:.2f} ms/request-stage)"
            if "ab" in result
            else ""
        )
        + (_describe_idle(result["idle"]) if result.get("idle") else "")
        + (f", left at exit: {left['at_exit']}" if left["at_exit"] else "")
        + (
            f", STILL THERE after {left['grace_s']:g} s: {left['after_grace']}"
            if left["after_grace"]
            else ""
        )
    )


def _describe_split(split: dict[str, float] | None) -> str:
    if not split:
        return ""
    return " (" + ", ".join(f"{group} {ms:.2f}" for group, ms in split.items() if ms) + ")"


def _describe_idle(idle: dict[str, Any]) -> str:
    engines = ", ".join(f"{cpu:.3f}" for cpu in idle["engines_cpu_s"].values())
    return (
        f", idle {idle['seconds']:g} s: frontend {idle['frontend_cpu_s']:.3f} s CPU,"
        f" engines {engines} s"
    )


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"
