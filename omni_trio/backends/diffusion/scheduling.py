"""Which requests a diffusion replica steps next, as pure functions.

A replica keeps its requests in two lists, oldest first: *running* (prepared, holding
latents, at most ``max_batch_size``) and *waiting* (prepared, not admitted yet). Each tick
admits from the head of *waiting* and runs one denoise step for a batch of *running*
requests that share a compatibility key (:attr:`ImageRequest.key
<omni_trio.models.diffusion.contract.ImageRequest.key>`: their latents stack).

- ``step`` mode: each tick first admits waiting requests in FIFO order while fewer than
  ``max_batch_size`` run (the head is never skipped for a later one), then steps the running
  requests with the key of the oldest running one. New requests join at the next tick,
  finished ones leave; a key other than the oldest's waits until the older requests are
  done, so the oldest request is never starved.
- ``request`` mode: a batch runs all its steps before another starts: while requests run,
  none is admitted; when none runs, the head of *waiting* is admitted with the waiting
  requests behind it that share its key, up to ``max_batch_size``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Execution", "Tick", "plan_tick"]

Execution = Literal["request", "step"]


@dataclass(frozen=True, slots=True)
class Tick:
    """One tick's plan: ``admit`` indexes into *waiting* (what moves to the end of *running*,
    in that order); ``batch`` indexes into *running* as it is after the admission."""

    admit: tuple[int, ...]
    batch: tuple[int, ...]


def plan_tick(
    execution: Execution,
    running: Sequence[Hashable],
    waiting: Sequence[Hashable],
    max_batch_size: int,
) -> Tick:
    """The next tick for requests with these keys (oldest first). Pure. An empty ``batch``
    means there is nothing to step."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, not {max_batch_size}")
    if execution == "step":
        room = max(0, max_batch_size - len(running))
        admit = tuple(range(min(room, len(waiting))))
    elif running:
        admit = ()
    elif waiting:
        head = waiting[0]
        admit = tuple(i for i, key in enumerate(waiting) if key == head)[:max_batch_size]
    else:
        admit = ()
    keys = [*running, *(waiting[i] for i in admit)]
    if not keys:
        return Tick(admit, ())
    oldest = keys[0]
    batch = tuple(i for i, key in enumerate(keys) if key == oldest)[:max_batch_size]
    return Tick(admit, batch)
