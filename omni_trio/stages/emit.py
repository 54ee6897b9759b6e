"""The ``emit`` of the stage contract, and its optional synchronous fast path.

A backend delivers each output with ``await emit(output)``, which may wait (backpressure).
The ``emit`` a backend's ``_run`` gets is an :class:`Emitter`: besides being awaited it has
``emit.nowait(output) -> bool``, which delivers the output at once, without a checkpoint,
when nothing on the way to its consumer would have to wait, and returns ``False``, having
changed nothing, in every other case (a full window, a consumer gone, an abort or failure
under way, an output after the finished one). ``False`` only says "not now": the output
must then go through ``await emit(output)``, which does whatever the case calls for (waits,
aborts, raises the contract violation).

``nowait`` lets a backend that receives outputs for many requests in one task (a vllm
replica's demultiplexer) hand each one on without waking the request's own task, so an
output costs one task switch (the consumer's) instead of two. Who calls ``nowait`` keeps the
order: an output may take the fast path only while the request's own task has nothing left
to deliver, and only while it is not being cancelled (the vllm backend's
:class:`~._vllm_demux.RequestInbox` is the example).

Layers pass it down: the orchestrator gives ``run_request`` an ``Emitter`` whose ``nowait``
puts the output into the consumer's queue when its window has room, and the replica's
:class:`~._running.RunningRequest` wraps it in the one ``_run`` gets (enforcing "nothing
after the finished output"). An ``emit`` that is a plain async function
has no fast path: :func:`nowait_of` gives ``None`` for it and the wrapper's ``nowait``
always returns ``False``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Self

from ..outputs import StageOutput

__all__ = ["Emit", "EmitNowait", "Emitter", "never", "nowait_of"]

#: what ``run_request`` takes: deliver one output, waiting if the consumer is behind
Emit = Callable[[StageOutput], Awaitable[None]]
#: deliver one output now if nothing would wait; whether it was delivered (see module doc)
EmitNowait = Callable[[StageOutput], bool]


def never(out: StageOutput) -> bool:
    """The fast path of an ``emit`` that has none: never delivers. Pure."""
    return False


class Emitter(functools.partial[Awaitable[None]]):
    """An ``emit`` with a synchronous fast path: ``await emitter(out)`` and
    ``emitter.nowait(out) -> bool`` (see the module docstring for the contract).

    Awaiting it awaits the wrapped ``emit`` (waiting while the consumer is behind; whether
    it checkpoints is that emit's rule). A ``functools.partial`` underneath: the call costs
    no Python frame of its own, and every output passes through two of them."""

    __slots__ = ("nowait",)

    #: deliver ``out`` now if nothing would wait; ``False`` (nothing changed) otherwise.
    #: Synchronous, never checkpoints, never raises for a delivery it refuses.
    nowait: EmitNowait

    def __new__(cls, emit: Emit, nowait: EmitNowait = never) -> Self:
        self = super().__new__(cls, emit)
        self.nowait = nowait
        return self

    def __repr__(self) -> str:
        return f"<Emitter {self.func!r} nowait={self.nowait!r}>"


def nowait_of(emit: Emit) -> EmitNowait | None:
    """``emit``'s fast path, or ``None`` if it has none (a plain async function, or an
    :class:`Emitter` whose ``nowait`` is :func:`never`). Pure."""
    if not isinstance(emit, Emitter):
        return None
    nowait = emit.nowait
    return None if nowait is never else nowait
