"""Which requests a diffusion tick admits and steps (pure)."""

import pytest

from omni_trio.backends.diffusion.scheduling import Tick, plan_tick

A, B = ("a",), ("b",)


def test_nothing_to_do():
    assert plan_tick("step", [], [], 4) == Tick((), ())
    assert plan_tick("request", [], [], 4) == Tick((), ())


def test_step_mode_admits_fifo_up_to_the_batch_size_and_steps_the_oldest_key():
    # two run, room for two more: the head two join, whatever their key
    tick = plan_tick("step", [A, A], [B, A, A], 4)
    assert tick.admit == (0, 1)
    # running after admission: A A B A -> the oldest's key (A), oldest first
    assert tick.batch == (0, 1, 3)


def test_step_mode_never_skips_the_head_for_a_later_compatible_request():
    tick = plan_tick("step", [A, A, A], [B, A], 4)
    assert tick.admit == (0,)  # B, not the A behind it
    assert tick.batch == (0, 1, 2)


def test_step_mode_a_full_batch_admits_nothing():
    assert plan_tick("step", [A] * 4, [A], 4) == Tick((), (0, 1, 2, 3))


def test_step_mode_another_key_runs_once_the_older_ones_are_gone():
    assert plan_tick("step", [B, A], [], 4).batch == (0,)


def test_request_mode_runs_a_batch_to_its_end_before_admitting():
    assert plan_tick("request", [A, A], [A, A], 4) == Tick((), (0, 1))


def test_request_mode_fuses_the_head_with_the_compatible_requests_behind_it():
    tick = plan_tick("request", [], [A, B, A, A, A, A], 3)
    assert tick.admit == (0, 2, 3)
    assert tick.batch == (0, 1, 2)
    # a lone head of another key runs alone
    assert plan_tick("request", [], [B, A], 4) == Tick((0,), (0,))


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        plan_tick("step", [], [A], 0)
