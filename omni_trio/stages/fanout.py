"""One ``collective_rpc`` call on every replica of a stage, concurrently, one typed error for
every failure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import trio

from ..errors import CollectiveRPCTimeoutError, InvalidRequestError, StageRPCError
from ..failures import describe_failures, group_causes
from .backend import StageBackend

__all__ = ["call_replicas", "check_rpc_timeout"]


def check_rpc_timeout(timeout: object) -> None:
    """Refuse a ``collective_rpc`` timeout that is not ``None`` or a number of seconds at
    least 0 (``math.inf``: no bound). Pure. Raises :class:`InvalidRequestError` naming it."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidRequestError(
            f"collective_rpc: timeout must be None or a number of seconds >= 0, not {timeout!r}"
        )


async def call_replicas(
    stage_id: str,
    replicas: Sequence[StageBackend],
    method: str,
    args: Sequence[object] | None,
    kwargs: Mapping[str, object] | None,
    *,
    timeout: float | None,  # noqa: ASYNC109 (the engine's API passes it through)
) -> list[object]:
    """Call ``method`` on each of ``replicas`` concurrently; one result per replica, in
    order. Checkpoints; cancelling the caller cancels every call. Raises
    :class:`CollectiveRPCTimeoutError` naming the replicas that did not answer within
    ``timeout``; :class:`StageRPCError` naming each replica that raised, from an
    ``ExceptionGroup`` of every cause; :class:`InvalidRequestError` for a bad ``timeout``
    (:func:`check_rpc_timeout`), nothing called."""
    try:
        check_rpc_timeout(timeout)
    except InvalidRequestError:
        await trio.lowlevel.checkpoint()
        raise
    results: list[object] = [None] * len(replicas)
    answered = [False] * len(replicas)
    errors: list[Exception | None] = [None] * len(replicas)

    async def call(i: int, backend: StageBackend) -> None:
        try:
            results[i] = await backend.collective_rpc(method, args, kwargs)
        except Exception as exc:
            errors[i] = exc
        answered[i] = True

    with trio.move_on_after(math.inf if timeout is None else timeout):
        async with trio.open_nursery() as nursery:
            for i, backend in enumerate(replicas):
                nursery.start_soon(call, i, backend)
    failed = [(b.name, e) for b, e in zip(replicas, errors, strict=True) if e is not None]
    causes = (
        group_causes(f"collective_rpc({method!r}) on stage {stage_id!r}", [e for _, e in failed])
        if failed
        else None
    )
    if not all(answered):
        pending = [b.name for b, done in zip(replicas, answered, strict=True) if not done]
        raise CollectiveRPCTimeoutError(method, float(timeout or 0.0), pending) from causes
    if failed:
        raise StageRPCError(
            f"collective_rpc({method!r}) failed on {describe_failures(failed)}",
            stage_id=stage_id,
            failures=failed,
        ) from causes
    return results
