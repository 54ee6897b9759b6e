"""The startup heap frozen while a process of omni-trio's serves (``_heap.frozen_heap``), and
the command line's ``run`` doing so once its engine is up (``serve_engine``: in
tests/server/test_shutdown.py)."""

from __future__ import annotations

import gc
import sys
import weakref

from omni_trio.cli.main import main
from omni_trio.heap import frozen_heap

from .cli.test_main import write


class Node:
    """A container the collector tracks; two of them referring to each other are a cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def _tracked(obj: object) -> bool:
    # gc.get_objects() lists the three generations, not the frozen (permanent) one
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_on_entry_are_frozen_until_the_block_ends():
    before = Node()
    assert _tracked(before) and gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        assert not _tracked(before)  # skipped by every collection inside the block
        during = Node()
        assert _tracked(during)  # made after the freeze: collected as usual
    assert gc.get_freeze_count() == 0 and _tracked(before)


def test_garbage_on_entry_is_collected_not_frozen():
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b  # a cycle nothing refers to: only a collection frees it
    gc.disable()  # so that only frozen_heap's own collection can
    try:
        assert ref() is not None
        with frozen_heap():
            assert ref() is None  # collected before the freeze, not frozen for good
    finally:
        gc.enable()


def test_a_cycle_that_dies_while_frozen_is_collected_once_unfrozen():
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    with frozen_heap():
        del a, b  # frozen while it was alive: no collection frees it meanwhile
        gc.collect()
        assert ref() is not None
    # unfrozen on leaving: the next full collection frees it (no leak after a server stops)
    gc.collect()
    assert ref() is None


def test_nested_sessions_unfreeze_when_the_last_one_ends():
    with frozen_heap():
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the outer session still keeps it frozen
    assert gc.get_freeze_count() == 0


def test_a_session_that_raises_still_unfreezes():
    try:
        with frozen_heap():
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0


def test_run_freezes_the_heap_while_its_prompts_run(tmp_path, user_module, capsys):
    module = user_module(
        """
        import gc
        from omni_trio.backends.scripted import ScriptedBackend

        FROZEN = []

        class Recording(ScriptedBackend):
            async def _run(self, request_id, inputs, sampling_params, emit):
                FROZEN.append(gc.get_freeze_count())
                await super()._run(request_id, inputs, sampling_params, emit)
        """
    )
    config = write(
        tmp_path,
        f"name: one\nstages:\n  - id: a\n    backend: {module}:Recording\n    final_output: true\n",
        "one.yaml",
    )
    assert main(["run", config, "--prompt", "hi", "--prompt", "yo"]) == 0
    frozen = sys.modules[module].FROZEN
    assert len(frozen) == 2 and all(n > 0 for n in frozen)
    assert gc.get_freeze_count() == 0  # undone once the run ended


def test_a_run_whose_request_fails_still_unfreezes(tmp_path, capsys):
    config = write(
        tmp_path,
        "name: one\nstages:\n  - id: a\n    final_output: true\n    options: {fail_at_output: 1}\n",
        "fails.yaml",
    )
    assert main(["run", config, "--prompt", "hi"]) == 1  # a runtime failure
    assert "StageError" in capsys.readouterr().err
    assert gc.get_freeze_count() == 0
