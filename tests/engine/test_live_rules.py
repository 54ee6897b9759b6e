"""The live sessions' decisions, on their own values (pure functions)."""

from collections import OrderedDict

import pytest

from omni_trio.engine.live_rules import (
    Fence,
    admit_session,
    append_refusal,
    as_fence,
    commits_answered_turn,
    fence_refusal,
    has_room,
    input_bytes,
    lease_deadline,
    remember,
    resume_refusal,
    trim_count,
)


def test_admit_session():
    assert admit_session(held=0, limit=1, exists=False, closed=False) == "admit"
    assert admit_session(held=1, limit=1, exists=False, closed=False) == "full"
    # a duplicate id is named as such even at the limit; a closed engine before both
    assert admit_session(held=1, limit=1, exists=True, closed=False) == "exists"
    assert admit_session(held=0, limit=1, exists=True, closed=True) == "closed"


def test_fences():
    assert as_fence(None) is None
    assert as_fence((1, 2)) == Fence(1, 2)
    for bad in ((1,), (1, "2"), (True, 1), [1, 2], "1,2"):
        with pytest.raises(TypeError, match="fence"):
            as_fence(bad)  # type: ignore[arg-type]
    now = {"epoch": 2, "turn_id": 5}
    assert fence_refusal(None, **now, check_turn=True, what="append") is None
    assert fence_refusal(Fence(2, 5), **now, check_turn=True, what="append") is None
    stale_epoch = fence_refusal(Fence(1, 5), **now, check_turn=True, what="append")
    assert stale_epoch is not None and "epoch 1" in stale_epoch and "epoch 2" in stale_epoch
    stale_turn = fence_refusal(Fence(2, 4), **now, check_turn=True, what="append")
    assert stale_turn is not None and "turn 4" in stale_turn
    # a cancel targets the epoch: another turn of the same epoch is fine
    assert fence_refusal(Fence(2, 4), **now, check_turn=False, what="cancel") is None
    # a fence from the future is no better than a stale one
    assert fence_refusal(Fence(3, 5), **now, check_turn=False, what="cancel") is not None


def test_append_refusal():
    ok = {
        "turn_open": True,
        "pending_turns": 4,
        "max_pending_turns": 4,
        "turn_bytes": 6,
        "chunk_bytes": 4,
        "max_pending_input_bytes": 10,
    }
    assert append_refusal(**ok) is None  # appends to an open turn start nothing new
    why = append_refusal(**{**ok, "turn_open": False})
    assert why is not None and "max_pending_turns" in why
    why = append_refusal(**{**ok, "chunk_bytes": 5})
    assert why is not None and "max_pending_input_bytes" in why
    assert append_refusal(**{**ok, "turn_open": False, "pending_turns": 3}) is None
    # a full journal refuses a new turn, never an append to the open one
    why = append_refusal(**{**ok, "turn_open": False, "pending_turns": 3, "journal_room": False})
    assert why is not None and "not being read" in why
    assert append_refusal(**{**ok, "journal_room": False}) is None


def test_input_bytes():
    assert input_bytes("héllo") == 6
    assert input_bytes([1, 2, 3]) == 12
    assert input_bytes(b"abcd") == 4
    assert input_bytes({"prompt": "ab", "prompt_token_ids": [1]}) == 6

    class Samples:
        nbytes = 3200

    assert input_bytes({"multi_modal_data": {"audio": Samples()}}) == 3200


def test_lease_deadline():
    common = {"last_activity": 10.0, "detached_at": 50.0, "idle_timeout_s": 300.0}
    assert lease_deadline(state="attached", detach_grace_s=30.0, **common) == 310.0
    assert lease_deadline(state="detached", detach_grace_s=30.0, **common) == 80.0


def test_resume_refusal():
    ok = {
        "state": "detached",
        "token": "t1",
        "given": "t1",
        "last_seq": 3,
        "first_kept_seq": 2,
        "next_seq": 9,
    }
    assert resume_refusal(**ok) is None
    assert resume_refusal(**{**ok, "last_seq": 1}) is None  # replays from seq 2: all kept
    assert "not detached" in (resume_refusal(**{**ok, "state": "attached"}) or "")
    assert "not detached" in (resume_refusal(**{**ok, "token": None}) or "")
    assert "stale" in (resume_refusal(**{**ok, "given": "t0"}) or "")
    assert "trimmed" in (resume_refusal(**{**ok, "last_seq": 0}) or "")
    assert "ahead" in (resume_refusal(**{**ok, "last_seq": 9}) or "")


def test_has_room():
    bounds = {"max_events": 3, "max_bytes": 100}
    assert has_room(undelivered_events=0, undelivered_bytes=10_000, **bounds)  # one always
    assert has_room(undelivered_events=2, undelivered_bytes=99, **bounds)
    assert not has_room(undelivered_events=3, undelivered_bytes=10, **bounds)
    assert not has_room(undelivered_events=1, undelivered_bytes=100, **bounds)


def test_trim_count():
    sizes = [10, 10, 10, 10]  # seqs 5..8
    common = {"first_seq": 5, "total_bytes": 40, "max_events": 2, "max_bytes": 1000}
    # nothing delivered: nothing dropped, however far over the bounds
    assert trim_count(sizes, delivered_seq=4, acked_seq=4, **common) == 0
    # delivered ones go while over the bound, no further
    assert trim_count(sizes, delivered_seq=8, acked_seq=0, **common) == 2
    assert trim_count(sizes, delivered_seq=6, acked_seq=0, **common) == 2
    assert trim_count(sizes, delivered_seq=5, acked_seq=0, **common) == 1
    # acknowledged ones go at once, within the bounds too
    assert trim_count(sizes, delivered_seq=7, acked_seq=7, **{**common, "max_events": 10}) == 3
    # bytes bound the same way
    assert trim_count(sizes, delivered_seq=8, acked_seq=0, **{**common, "max_bytes": 15}) == 3


def test_remember_keeps_the_most_recent():
    ops: OrderedDict[str, int] = OrderedDict()
    for i in range(5):
        remember(ops, f"op{i}", i, limit=3)
    assert list(ops) == ["op2", "op3", "op4"]
    remember(ops, "op2", 20, limit=3)
    assert list(ops.items()) == [("op3", 3), ("op4", 4), ("op2", 20)]


def test_commits_answered_turn():
    answered = Fence(0, 3)
    assert commits_answered_turn(None, answered=answered, turn_open=False)
    assert commits_answered_turn(Fence(0, 3), answered=answered, turn_open=False)
    # another turn's fence, or a later turn that already has input: the normal commit
    assert not commits_answered_turn(Fence(0, 4), answered=answered, turn_open=False)
    assert not commits_answered_turn(None, answered=answered, turn_open=True)
