"""The session journal's bookkeeping: what is undelivered, what is trimmed, kept exact
incrementally (each event costs the same whatever the journal holds)."""

import random

from omni_trio.engine.live_events import Journal, ResponseDelta, event_bytes
from omni_trio.engine.live_rules import has_room


def delta(seq: int, text: str) -> ResponseDelta:
    return ResponseDelta(seq=seq, response_id="r", stage_id="s", text=text, token_ids=(), data=None)


def test_the_running_counts_equal_a_recount_under_random_use():
    rng = random.Random(7)
    journal = Journal(max_events=16, max_bytes=4096)
    for _ in range(5000):
        op = rng.random()
        if op < 0.5:
            journal.append(lambda s: delta(s, "x" * rng.randrange(0, 200)))
        elif op < 0.8:
            journal.mark_delivered(rng.randrange(journal.delivered, journal.next_seq))
        elif op < 0.95:
            journal.ack(rng.randrange(journal.acked, journal.next_seq))
        else:
            last = rng.randrange(journal.first_seq - 1, journal.next_seq)
            journal.restart_delivery(last)
        held = journal.after(0)
        assert [e.seq for e in held] == list(range(journal.first_seq, journal.next_seq))
        undelivered = [e for e in held if e.seq > journal.delivered]
        assert journal.n_bytes == sum(event_bytes(e) for e in held)
        expected_room = has_room(
            undelivered_events=len(undelivered),
            undelivered_bytes=sum(event_bytes(e) for e in undelivered),
            max_events=16,
            max_bytes=4096,
        )
        assert journal.has_room() == expected_room
        # never trimmed: what no reader got yet (nor the client acknowledged)
        assert journal.first_seq <= max(journal.delivered, journal.acked) + 1


def test_after_returns_the_events_after_a_seq():
    journal = Journal(max_events=100, max_bytes=1 << 20)
    for _ in range(10):
        journal.append(lambda s: delta(s, "a"))
    assert [e.seq for e in journal.after(7)] == [8, 9, 10]
    assert journal.after(10) == [] and len(journal.after(0)) == 10
