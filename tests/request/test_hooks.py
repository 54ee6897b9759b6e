"""prompt_transform hooks: the transformed prompt everywhere, typed failures, and artifact
directories deleted however the request ends (scripted stages, real directories)."""

import gc
from pathlib import Path

import pytest
import trio

from omni_trio import (
    DuplicateRequestError,
    EngineOverloadedError,
    InvalidRequestError,
    StageError,
    open_engine,
)
from omni_trio.request.hooks import split_hook_result

#: where the hooks below make their directories (set per test by the ``root`` fixture)
ROOT = Path("/nonexistent")
CALLS: list[tuple[object, str]] = []


def make_artifacts(prompt, request_id):
    """A hook that writes a small tree per request and marks the prompt."""
    CALLS.append((prompt, request_id))
    top = ROOT / request_id
    (top / "nested").mkdir(parents=True)
    (top / "nested" / "image.bin").write_bytes(b"\x00" * 1024)
    return f"{prompt}!", [top, str(ROOT / f"{request_id}-gone")]


def suffix_b(prompt, request_id):
    return f"{prompt}+b"


def picky(prompt, request_id):
    if prompt == "bad":
        raise RuntimeError("cannot decode the attachment")
    return make_artifacts(prompt, request_id)


def bad_prompt(prompt, request_id):
    top = ROOT / f"{request_id}-bad"
    top.mkdir()
    return 3.5, [top]


def relative_dir(prompt, request_id):
    top = ROOT / f"{request_id}-abs"
    top.mkdir()
    return prompt, [top, "relative/dir"]


def expand_refuses(prompt, sampling_params):
    CALLS.append((prompt, "expand"))
    raise ValueError("no negative prompt for this one")


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    CALLS.clear()
    return tmp_path


def pipeline(hook="tests.request.test_hooks:make_artifacts", *, entry=None, final=None, **engine):
    return {
        "stages": [
            {
                "id": "a",
                "prompt_transform": hook,
                "options": {"outputs": 3, "latency_s": 0.1, **(entry or {})},
            },
            {
                "id": "b",
                "inputs": ["a"],
                "final_output": True,
                "options": {"outputs": 2, **(final or {})},
            },
        ],
        **engine,
    }


def assert_no_artifacts(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir()) == []


# -- what a hook returns --------------------------------------------------------------------


def test_split_hook_result():
    assert split_hook_result("p") == ("p", (), None)
    assert split_hook_result([1, 2]) == ([1, 2], (), None)
    assert split_hook_result((1, 2)) == ((1, 2), (), None)  # two token ids: a prompt
    assert split_hook_result(("p", "/tmp/x")) == ("p", ("/tmp/x",), None)
    assert split_hook_result(("p", [Path("/a"), "/b", "/a"])) == ("p", ("/a", "/b"), None)
    assert split_hook_result(("p", ())) == ("p", (), None)
    prompt, dirs, problem = split_hook_result(("p", ["/ok", "rel", b"/x", "/"]))
    assert prompt == "p" and dirs == ("/ok",)
    assert "absolute path, not 'rel'" in problem
    assert "str or os.PathLike path, not b'/x'" in problem
    assert "root" in problem
    assert "a path or an iterable of paths" in split_hook_result(("p", 3.5))[2]


# -- the transformed prompt -------------------------------------------------------------------


async def test_the_hook_transforms_the_prompt_and_its_dirs_go_when_the_request_ends(
    autojump_clock, root
):
    async with open_engine(pipeline()) as engine:
        stream = engine.generate("hi", request_id="r1")
        assert CALLS == [("hi", "r1")]  # in generate(), once
        assert stream.context.prompt == "hi!"
        assert stream.context.artifacts.dirs == (str(root / "r1"), str(root / "r1-gone"))
        async with stream:
            outs = [await stream.receive()]
            assert (root / "r1" / "nested" / "image.bin").exists()  # alive while it runs
            outs += [out async for out in stream]
        assert outs[-1].finished
        assert_no_artifacts(root)  # gone once the stream is left
        assert engine._prompt_hooks.keeper.held == 0


async def test_hook_input_is_checked_after_the_hook(autojump_clock, root):
    # the hook may accept what the engine would not (here a dict -> text)
    cfg = pipeline("tests.request.test_hooks:suffix_b")
    async with open_engine(cfg) as engine:
        stream = engine.generate("x")
        assert stream.context.prompt == "x+b" and stream.context.artifacts is None
        assert (await stream.collect())[-1].finished


def two_entries():
    return {
        "stages": [
            {"id": "a", "prompt_transform": "tests.request.test_hooks:make_artifacts"},
            {"id": "b", "prompt_transform": "tests.request.test_hooks:suffix_b"},
            {"id": "c", "inputs": ["a", "b"], "final_output": True},
        ]
    }


async def test_several_entry_hooks_run_in_config_order_on_the_route_only(autojump_clock, root):
    async with open_engine(two_entries()) as engine:
        both = engine.generate("x", request_id="both")
        assert both.context.prompt == "x!+b"
        only_b = engine.generate("y", request_id="only-b", output_stages=["b"])
        assert only_b.context.prompt == "y+b" and only_b.context.artifacts is None
        assert CALLS == [("x", "both")]
        await both.collect()
        await only_b.collect()
        assert_no_artifacts(root)


# -- a failing hook ---------------------------------------------------------------------------


async def test_a_raising_hook_fails_only_that_request(autojump_clock, root):
    async with open_engine(pipeline("tests.request.test_hooks:picky")) as engine:
        async with engine.generate("ok", request_id="running") as running:
            with pytest.raises(InvalidRequestError) as info:
                engine.generate("bad", request_id="r")
            message = str(info.value)
            assert "prompt_transform 'tests.request.test_hooks:picky' of stage 'a'" in message
            assert "request 'r'" in message and "RuntimeError: cannot decode" in message
            assert isinstance(info.value.__cause__, RuntimeError)
            # the request in flight and the engine go on
            assert [out async for out in running][-1].finished
        assert (await engine.generate("ok").collect())[-1].finished
        stats = engine.statistics()
        assert (stats.requests_total, stats.requests_finished, stats.requests_failed) == (2, 2, 0)
    assert_no_artifacts(root)


async def test_a_hook_returning_a_bad_prompt_or_dirs_is_refused_and_its_dirs_deleted(
    autojump_clock, root
):
    async with open_engine(pipeline("tests.request.test_hooks:bad_prompt")) as engine:
        with pytest.raises(InvalidRequestError, match="returned a bad prompt: prompt must be"):
            engine.generate("x", request_id="r")
        assert_no_artifacts(root)
    async with open_engine(pipeline("tests.request.test_hooks:relative_dir")) as engine:
        with pytest.raises(InvalidRequestError, match="bad artifact_dirs: .*'relative/dir'"):
            engine.generate("x", request_id="r")
        assert_no_artifacts(root)  # the absolute one it returned was deleted
        assert engine.statistics().requests_total == 0


async def test_dirs_deleted_when_prompt_expand_refuses_the_request(autojump_clock, root):
    cfg = pipeline()
    cfg["stages"][0]["prompt_expand"] = "tests.request.test_hooks:expand_refuses"
    async with open_engine(cfg) as engine:
        with pytest.raises(InvalidRequestError, match="no negative prompt"):
            engine.generate("x", request_id="r")
        assert CALLS == [("x", "r"), ("x!", "expand")]  # it expands the transformed prompt
        assert_no_artifacts(root)
        assert engine._prompt_hooks.keeper.held == 0


async def test_no_hook_runs_for_a_call_refused_for_another_argument(autojump_clock, root):
    async with open_engine(pipeline()) as engine:
        with pytest.raises(InvalidRequestError, match="not a stage"):
            engine.generate("x", final_stage_id="nope")
        with pytest.raises(InvalidRequestError, match="priority"):
            engine.generate("x", priority="high")
    assert CALLS == []
    assert_no_artifacts(root)


# -- artifact dirs, however the request ends ---------------------------------------------


async def test_dirs_deleted_when_a_stage_fails(autojump_clock, root):
    async with open_engine(pipeline(final={"fail_at_output": 1})) as engine:
        with pytest.raises(StageError):
            async with engine.generate("x", request_id="r") as stream:
                async for _ in stream:
                    pass
        assert_no_artifacts(root)
        assert engine.statistics().requests_failed == 1


async def test_dirs_deleted_on_abort_and_on_leaving_the_stream_early(autojump_clock, root):
    async with open_engine(pipeline(entry={"hang": True})) as engine:
        stream = engine.generate("x", request_id="aborted")
        async with stream:
            await trio.sleep(1)
            assert (root / "aborted").exists()
            assert await engine.abort("aborted") == []
            assert not (root / "aborted").exists()
        with trio.move_on_after(1):
            async with engine.generate("x", request_id="left"):
                await trio.sleep_forever()
        assert_no_artifacts(root)
        assert engine.statistics().requests_aborted == 2


async def test_dirs_deleted_when_the_engine_closes_on_a_running_request(autojump_clock, root):
    async with open_engine(pipeline(entry={"hang": True})) as engine:
        stream = engine.generate("x", request_id="r")
        await stream.__aenter__()
        await trio.sleep(1)
        assert (root / "r").exists()
    assert_no_artifacts(root)
    assert stream.status == "aborted"


async def test_dirs_deleted_when_admission_is_refused(autojump_clock, root):
    cfg = pipeline(entry={"hang": True}, max_requests_in_flight=1, admission="reject")
    async with open_engine(cfg) as engine:
        async with engine.generate("x", request_id="running"):
            refused = engine.generate("x", request_id="refused")
            assert (root / "refused").exists()
            with pytest.raises(EngineOverloadedError):
                await refused.__aenter__()
            assert not (root / "refused").exists()
            # the stream is spent: entering it again is refused, it never runs without them
            with pytest.raises(InvalidRequestError, match="refused admission before, or"):
                await refused.__aenter__()
            # a duplicate id is refused the same way; the running request keeps its own
            duplicate = engine.generate("x", request_id="running-2")
            duplicate.request_id = "running"
            with pytest.raises(DuplicateRequestError):
                await duplicate.__aenter__()
            assert not (root / "running-2").exists()
            assert (root / "running").exists()
        assert_no_artifacts(root)
        assert engine._prompt_hooks.keeper.held == 0


async def test_dirs_deleted_when_cancelled_while_waiting_for_admission(autojump_clock, root):
    cfg = pipeline(entry={"hang": True}, max_requests_in_flight=1)
    async with open_engine(cfg) as engine:
        async with engine.generate("x", request_id="running"):
            waiting = engine.generate("x", request_id="waiting")
            with trio.move_on_after(5) as scope:
                await waiting.__aenter__()
            assert scope.cancelled_caught
            assert not (root / "waiting").exists()
            assert engine.statistics().requests_waiting == 0
    assert_no_artifacts(root)


async def test_a_stream_never_entered_does_not_keep_its_dirs(autojump_clock, root):
    async with open_engine(pipeline()) as engine:
        dropped = engine.generate("x", request_id="dropped")
        del dropped
        gc.collect()
        # swept by the next deletion of any request's directories
        assert (root / "dropped").exists()
        await engine.generate("x", request_id="next").collect()
        assert_no_artifacts(root)
        kept = engine.generate("x", request_id="kept")  # held, never entered
        assert (root / "kept").exists()
    assert_no_artifacts(root)  # the engine's close deleted it
    assert kept.status == "pending"


async def test_a_thousand_mixed_requests_leave_no_dirs(autojump_clock, root):
    # b fails at its output 2 unless max_tokens stops it before; some time out (aborted),
    # some are never entered
    cfg = pipeline(final={"outputs": 4, "fail_at_output": 2}, max_requests_in_flight=8)
    async with open_engine(cfg) as engine:

        async def one(i: int) -> None:
            params = {"b": {"max_tokens": 2}} if i % 2 else None
            stream = engine.generate("x", request_id=f"m{i}", sampling_params=params)
            if i % 5 == 4:
                return  # never entered
            with trio.move_on_after(0.15 if i % 3 == 0 else 100):
                try:
                    async with stream:
                        async for _ in stream:
                            pass
                except StageError:
                    pass

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        gc.collect()
        stats = engine.statistics()
        assert stats.requests_aborted and stats.requests_finished and stats.requests_failed
        assert stats.requests_in_flight == 0
    assert_no_artifacts(root)
    assert engine._prompt_hooks.keeper.held == 0
