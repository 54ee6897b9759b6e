"""The one-shot commands: ``validate``, ``run``, ``bench`` and ``demo``, each through ``main``
(``schema``: with the config schema's tests in ``test_config_pipeline.py``); and the SIGINT
watch that ``run`` and ``demo`` run under (``_until_sigint``), on its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import wave
from functools import partial
from pathlib import Path

import pytest
import trio

import omni_trio
from omni_trio.cli.args import UsageError
from omni_trio.cli.commands import CHECKOUT_NEEDED, _until_sigint, find_benchmarks
from omni_trio.cli.main import main
from omni_trio.cli.runner import StageTimer, run_prompts
from omni_trio.errors import StageError
from omni_trio.testing import cancel_at_every_checkpoint, scripted_pipeline, scripted_tokens

from ..config.test_loading import stage
from ..config.test_reading import one_stage_yaml
from ..config.test_reading import write as write_config
from ..conftest import run_bounded
from .test_main import LOG_NOTE, log_file, one_line_error, pipeline, write


def test_validate_ok_bad_and_missing(tmp_path, capsys):
    assert main(["validate", pipeline(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "pipeline 'two', 2 stages" in out

    bad = write(tmp_path, "name: bad\nstages:\n  - id: a\n    inputs: [zz]\n", "bad.yaml")
    assert main(["validate", bad]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "bad.yaml: $.stages[0].inputs[0]: unknown input stage 'zz'" in line

    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "nope.yaml" in line and "tiny-omni" in line  # names the shipped pipelines

    assert main(["validate", "tiny-omni-scripted"]) == 0  # a shipped pipeline by name
    assert "pipeline 'tiny-omni-scripted', 3 stages" in capsys.readouterr().out


def test_run_streams_text_and_logs_stats(tmp_path, capsys):
    rc = main(["run", pipeline(tmp_path), "--prompt", "hi", "--prompt", "yo", "--log-stats"])
    assert rc == 0
    out, err = capsys.readouterr()
    for prompt in ("hi", "yo"):
        tokens = scripted_tokens(scripted_tokens(list(prompt.encode()), 3), 4)
        assert "".join(f"b:{t} " for t in tokens) in out
    assert "start-up timeline" in out and "replica 0: start" in out
    assert "engine: 2 requests: 2 finished, 0 aborted, 0 failed, 0 in flight" in out
    assert "per-stage timing" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("omni-trio run: 2 prompt(s) through 'two' (a -> b); no audio")
    assert "a (scripted) ready in" in err and "b (scripted) ready in" in err  # the display
    log = Path(err.split(LOG_NOTE)[1].split()[0])
    assert not log.exists()  # scripted stages say nothing: no log file is left behind


@pytest.mark.slow
def test_run_writes_a_wav_per_prompt_from_the_audio_stage(tmp_path, capsys):
    out_dir = tmp_path / "wavs"
    argv = ["run", "tiny-omni-scripted", "--prompt", "a b", "--prompt", "c"]
    assert main([*argv, "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "thinker:" in out
    for n in (1, 2):
        with wave.open(str(out_dir / f"prompt-{n}.wav")) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
            assert w.getnframes() == 64 * 160  # 64 talker codes x the vocoder's hop
        assert f"wrote {out_dir / f'prompt-{n}.wav'}" in out


def test_bench_runs_scripts_and_forwards_args(tmp_path, capfd):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "bench_echo.py").write_text(
        "import json, sys\nprint(json.dumps({'argv': sys.argv[1:]}))\n"
    )
    (bench / "bench_fail.py").write_text("import sys\nsys.exit(3)\n")
    assert main(["bench", "--dir", str(bench), "--only", "echo", "--", "--quick", "7"]) == 0
    out = capfd.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == {"argv": ["--quick", "7"]}
    assert main(["bench", "--dir", str(bench)]) == 1
    assert "bench_fail.py (exit 3)" in capfd.readouterr().err
    assert main(["bench", "--dir", str(bench), "--only", "nope"]) == 2
    assert "no such benchmark(s): bench_nope.py" in capfd.readouterr().err
    assert main(["bench", "--dir", str(tmp_path / "missing")]) == 2
    assert one_line_error(capfd.readouterr().err).endswith("missing: no such directory")


REPO = Path(__file__).resolve().parents[2]


def checkout(root: Path, name: str = "omni-trio") -> Path:
    """A directory that looks like a checkout of project ``name``: pyproject.toml and a
    benchmarks/ directory with one script, which prints where omni_trio came from."""
    (root / "benchmarks").mkdir(parents=True)
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\n')
    (root / "benchmarks" / "bench_where.py").write_text(
        "import json, omni_trio\nprint(json.dumps({'omni_trio': omni_trio.__file__}))\n"
    )
    return root


def test_bench_finds_the_checkout_around_the_directory_or_the_package(tmp_path):
    repo = checkout(tmp_path / "repo")
    inside = repo / "docs" / "deep"
    inside.mkdir(parents=True)
    site = tmp_path / "site-packages"
    site.mkdir()
    # from anywhere inside a checkout, whatever the package's place
    assert find_benchmarks(None, inside, site) == repo / "benchmarks"
    # outside any: the checkout the package runs from (an editable install)
    assert find_benchmarks(None, tmp_path, repo) == repo / "benchmarks"
    # another project's benchmarks are not run
    other = checkout(tmp_path / "other", name="other-project")
    assert find_benchmarks(None, other, repo) == repo / "benchmarks"
    # an installed package outside any checkout: say what is needed
    with pytest.raises(UsageError) as info:
        find_benchmarks(None, other, site)
    assert str(info.value) == CHECKOUT_NEEDED
    assert find_benchmarks(str(site), other, site) == site  # --dir as given


def test_bench_from_anywhere_in_this_checkout_runs_its_benchmarks(monkeypatch, capfd):
    monkeypatch.chdir(REPO / "docs")
    # --only with an unknown name lists what it found, and runs nothing
    assert main(["bench", "--only", "nope"]) == 2
    err = one_line_error(capfd.readouterr().err)
    assert "have: bench_bridge.py, bench_codec.py" in err and "bench_orchestrator.py" in err


def installed_copy(site: Path) -> dict[str, str]:
    """The package as a wheel installs it (omni_trio/ only, no benchmarks/ beside it) in
    ``site``; the environment that imports it from there."""
    shutil.copytree(
        REPO / "omni_trio", site / "omni_trio", ignore=shutil.ignore_patterns("__pycache__")
    )
    return {**os.environ, "PYTHONPATH": str(site)}


def test_bench_from_an_installed_package_runs_a_checkouts_benchmarks_or_says_it_needs_one(
    tmp_path,
):
    env = installed_copy(tmp_path / "site-packages")
    command = [sys.executable, "-m", "omni_trio", "bench"]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    done = run_bounded(command, 120, "omni-trio bench", cwd=outside, env=env)
    assert done.returncode == 2, done.stderr
    assert one_line_error(done.stderr) == f"omni-trio: error: {CHECKOUT_NEEDED}"
    assert done.stdout == ""
    repo = checkout(tmp_path / "repo")
    done = run_bounded(command, 120, "omni-trio bench", cwd=repo, env=env)
    assert done.returncode == 0, done.stderr
    where = json.loads(done.stdout.strip().splitlines()[-1])["omni_trio"]
    assert Path(where).is_relative_to(tmp_path / "site-packages")  # the installed package


# -- omni-trio validate: exit 2 and one line naming the file and path -------------------


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("opt.yaml", one_stage_yaml("    options: {outptus: 3}\n"), "$.stages[0].options.outptus"),
        (
            "nan.yaml",
            one_stage_yaml("    stage_init_timeout: .nan\n"),
            "$.stages[0].stage_init_timeout",
        ),
        ("dup.json", '{"name": "a", "name": "b", "stages": []}', "$.name"),
        (
            "rel.yaml",
            one_stage_yaml("    input_processor: '.x:f'\n"),
            "$.stages[0].input_processor",
        ),
        ("bytes.yaml", b"name: \xff\n", "$"),
        ("deep.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "$"),
    ],
)
def test_cli_validate_exits_2_with_one_line(tmp_path, capsys, name, text, where):
    path = write_config(tmp_path, name, text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"omni-trio: error: ConfigError: {path}: {where}: ")


def test_cli_validate_ok(tmp_path, capsys):
    path = write_config(tmp_path, "ok.yaml", one_stage_yaml())
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {path}: pipeline 't', 1 stages")


def test_cli_validate_keeps_one_line_for_a_big_pipeline(tmp_path, capsys):
    stages = [stage(f"s{i}", inputs=[f"s{i - 1}"] if i else []) for i in range(100)]
    stages[-1]["final_output"] = True
    path = write_config(tmp_path, "big.json", json.dumps({"name": "big", "stages": stages}))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.endswith("s11(scripted <- s10), ... (88 more)")


# -- the embedded tiny-omni pipeline on real vLLM engines (slow: ~20-70 s of engine start) ----


@pytest.mark.vllm
def test_demo_end_to_end_streams_text_and_writes_wavs(tmp_path):
    out_dir = tmp_path / "demo"
    # past the bound the demo and its EngineCores are killed, all of them
    proc = run_bounded(
        [
            sys.executable,
            "-m",
            "omni_trio",
            "demo",
            "--output-dir",
            str(out_dir),
            "--prompt",
            "Hello there.",
            "--max-tokens",
            "8",
        ],  # fmt: skip
        600,
        "`omni-trio demo` to end",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    assert "random weights" in out and "noise" in out
    text_line = next(line for line in out.splitlines() if line.startswith("[1] thinker: "))
    assert len(text_line) > len("[1] thinker: ")  # some (random) text was streamed
    assert "per-stage timing" in out and "code2wav" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith(
        "omni-trio demo: 1 prompt(s) through 'tiny-omni' (thinker -> talker -> code2wav); "
        f"1 WAV file(s) in {out_dir}/; "
    )
    # quiet by default: one line per stage once it is ready, vLLM's output in the log only
    for stage_line in ("thinker (vllm) ready in", "talker (vllm) ready in", "code2wav (torch)"):
        assert stage_line in err
    assert "warning" not in (out + err).lower() and "Traceback" not in err
    log = log_file(err)
    assert "EngineCore" in log and "leaked" not in log and "force killing" not in log
    with wave.open(str(out_dir / "prompt-1.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
        assert w.getnframes() > 0 and w.getnframes() % 160 == 0  # whole vocoder hops


# -- _until_sigint: the SIGINT watch of run and demo ------------------------------------------
def _tasks_of_until_sigint() -> list[str]:
    """The live tasks _until_sigint started (its watcher, the work's task)."""
    found: list[str] = []

    def walk(task: trio.lowlevel.Task) -> None:
        if "_until_sigint.<locals>" in task.name:
            found.append(task.name)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return found


async def test_until_sigint_cancelled_at_every_checkpoint(autojump_clock, tmp_path, capsys):
    handler = signal.getsignal(signal.SIGINT)
    seen_running: list[str] = []

    def nothing_left(engine: omni_trio.Engine) -> None:
        assert signal.getsignal(signal.SIGINT) == handler, "SIGINT handler not restored"
        assert not _tasks_of_until_sigint()

    async def scenario(engine: omni_trio.Engine) -> None:
        async def work() -> list[Path]:
            seen_running.extend(_tasks_of_until_sigint())  # the check above sees its tasks
            return await run_prompts(engine, ["hi"], tmp_path, None, StageTimer())

        try:
            await _until_sigint(work)
        except KeyboardInterrupt:  # would end the whole pytest session
            raise AssertionError("KeyboardInterrupt without a SIGINT") from None

    cfg = scripted_pipeline(2, outputs=3, latency_s=0.01)
    async with omni_trio.open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=nothing_left)
    report.raise_if_failed()  # every cancelled run raised Cancelled, left nothing behind
    assert report.checkpoints > 5
    assert any(name.endswith(".watch") for name in seen_running), seen_running


async def test_until_sigint_returns_what_the_work_returns(autojump_clock):
    assert await _until_sigint(partial(trio.sleep, 1)) is None  # None too, not an interrupt
    assert trio.current_time() == 1

    async def three() -> int:
        await trio.lowlevel.checkpoint()
        return 3

    assert await _until_sigint(three) == 3


async def test_until_sigint_raises_the_works_error_as_it_raised_it(autojump_clock):
    handler = signal.getsignal(signal.SIGINT)
    error = StageError("stage 'b' failed request 'r'", stage_id="b", request_id="r")

    async def work() -> None:
        await trio.sleep(1)  # the watcher is waiting for a SIGINT meanwhile
        raise error

    with pytest.raises(StageError) as caught:
        await _until_sigint(work)
    assert caught.value is error  # not in an exception group, not a KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) == handler


async def test_until_sigint_raises_a_failed_requests_stage_error(autojump_clock, tmp_path, capsys):
    cfg = scripted_pipeline(2, outputs=3, stage_options={"s1": {"fail_at_output": 2}})
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(StageError, match="fail at output 2") as caught:
            await _until_sigint(partial(run_prompts, engine, ["hi"], tmp_path, None, StageTimer()))
    assert type(caught.value) is StageError and caught.value.stage_id == "s1"


async def test_a_sigint_cancels_the_work_then_raises_keyboard_interrupt(autojump_clock):
    handler = signal.getsignal(signal.SIGINT)
    steps: list[str] = []

    async def work() -> None:
        try:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, while the watcher is installed
            steps.append("signalled")
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(5)  # the engine closing
            steps.append("cleaned up")

    with pytest.raises(KeyboardInterrupt), trio.fail_after(60):  # a missed SIGINT: fails
        await _until_sigint(work)
    assert steps == ["signalled", "cleaned up"]  # the interrupt came after the cleanup
    assert trio.current_time() == 5
    assert signal.getsignal(signal.SIGINT) == handler
    assert not _tasks_of_until_sigint()
