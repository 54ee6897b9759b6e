"""The startup heap left out of the garbage collector's full collections while a server runs.

A process that loaded vLLM and torch holds some 650 thousand objects the cyclic collector
tracks (measured here: a 2-stage tiny-Llama pipeline after start-up). A full (generation 2)
collection walks all of them, 320-430 ms here with the GIL held, so the trio loop and every
engine thread stop meanwhile; under steady load (64 requests at a time) 4 came every 120 s,
1.35-1.47 s in all. vLLM's API server and its EngineCore freeze their startup heap for this
reason; the processes omni-trio owns do the same with :func:`frozen_heap` once their engine
is up (``serve_engine``, the command line's ``run``, a Ray replica's actor from its start to
its stop): the same load then gave 8-10 full collections per 120 s, 10-13 ms in all, the
longest 2.1 ms (``benchmarks/bench_heap.py``).

Freezing is process-wide (``gc.freeze``): the objects alive at that moment are never
collected while frozen, so the heap is unfrozen again when the last session that froze it
ends, and a full collection runs first (what is garbage then is not frozen).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


class _Freezes:
    """How many :func:`frozen_heap` sessions of this process are open (several servers in
    one process share the one frozen generation)."""

    def __init__(self) -> None:
        self.open = 0

    def enter(self) -> None:
        gc.collect()
        gc.freeze()
        self.open += 1

    def exit(self) -> None:
        self.open -= 1
        if self.open == 0:
            gc.unfreeze()

    def __repr__(self) -> str:
        return f"<heap freezes open={self.open} frozen={gc.get_freeze_count()}>"


_FREEZES = _Freezes()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect the garbage, then freeze every object alive now (``gc.freeze``) until the
    block ends: full collections inside it skip them. On leaving, the heap is unfrozen once
    no other session of this process keeps it frozen. Synchronous (the first collection
    blocks the thread: up to ~0.4 s in a process with vLLM loaded); enter it once, after
    start-up, not per request."""
    _FREEZES.enter()
    try:
        yield
    finally:
        _FREEZES.exit()
