"""Dynamic batching decisions for the torch backend, as small pure functions.

The torch backend keeps a FIFO of pending work items (one per request chunk). Whenever a
worker slot is free it asks :func:`decide_batch` what to do: run some items now, or wait until
more arrive or until the oldest one has waited ``max_batch_delay_s``. Streaming requests
decode their codes in spans chosen by :func:`chunk_spans`, each with the left context from
:func:`context_window`. None of these functions checkpoint, read clocks or touch torch, so
they are tested on their own (``tests/backends/torch/test_backend.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BatchDecision",
    "BatchingStatistics",
    "Pending",
    "chunk_spans",
    "context_window",
    "decide_batch",
]


@dataclass(frozen=True, slots=True)
class Pending:
    """What the batching decision needs to know about one pending item."""

    enqueued_at: float
    length: int


@dataclass(frozen=True, slots=True)
class BatchDecision:
    """``take``: indices (into the pending FIFO) to run as one batch now, oldest first; empty
    means wait. ``wake_at``: the trio time to decide again if nothing arrives before (``None``:
    wait for an arrival)."""

    take: tuple[int, ...] = ()
    wake_at: float | None = None


@dataclass(frozen=True, slots=True)
class BatchingStatistics:
    """A snapshot of one torch replica's batcher.

    ``dropped_pending`` counts items whose request was cancelled before their batch ran (they
    never ran); ``dropped_running`` those cancelled while their batch ran (their result was
    thrown away, the other items of the batch were delivered)."""

    pending: int
    running_batches: int
    batches_run: int
    items_run: int
    largest_batch: int
    dropped_pending: int
    dropped_running: int
    compute_s: float


def decide_batch(
    pending: Sequence[Pending],
    now: float,
    *,
    max_batch_size: int,
    max_batch_delay_s: float,
    same_length: bool = False,
) -> BatchDecision:
    """Decide whether to flush a batch now, and which pending items go in it.

    A batch is flushed when ``max_batch_size`` items are eligible, or when the oldest pending
    item has waited ``max_batch_delay_s`` (then every eligible item goes, up to the size
    limit). Eligible items are all pending ones, or with ``same_length`` (modules whose
    outputs cannot be cut per request) only those as long as the oldest. FIFO order is kept,
    so no item starves: the oldest is always in the next batch.
    """
    if not pending:
        return BatchDecision()
    head = pending[0]
    eligible = [i for i, p in enumerate(pending) if not same_length or p.length == head.length][
        :max_batch_size
    ]
    deadline = head.enqueued_at + max_batch_delay_s
    if len(eligible) >= max_batch_size or now >= deadline:
        return BatchDecision(take=tuple(eligible))
    return BatchDecision(wake_at=deadline)


def chunk_spans(
    done: int, available: int, *, chunk_size: int | None, final: bool
) -> list[tuple[int, int]]:
    """The ``[start, end)`` code spans a request decodes now.

    ``done`` codes are decoded already and ``available`` have arrived. Every full chunk of
    ``chunk_size`` codes is decoded as soon as it is complete; the remainder once the input is
    ``final``. ``chunk_size=None`` decodes everything in one span at the end.
    """
    spans: list[tuple[int, int]] = []
    start = done
    if chunk_size is not None:
        while available - start >= chunk_size:
            spans.append((start, start + chunk_size))
            start += chunk_size
    if final and start < available:
        spans.append((start, available))
    return spans


def context_window(start: int, end: int, context: int) -> tuple[int, int]:
    """The codes to feed for span ``[start, end)`` with ``context`` codes of left context:
    returns ``(window_start, trim)`` where ``trim`` is how many leading frames to drop."""
    window_start = max(0, start - context)
    return window_start, start - window_start
