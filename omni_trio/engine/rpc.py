"""``collective_rpc`` across stages: fan out to each stage's pool, merge what comes back.

Each pool fans out to its own replicas (:meth:`StagePool.collective_rpc`); this module runs
the chosen pools concurrently, waits for all of them (no cause is dropped because a sibling
failed first) and turns their outcomes into one result list or one typed error
(:func:`merge_rpc_outcomes`, pure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import outcome
import trio

from ..errors import CollectiveRPCTimeoutError, ReplicaDeadError, StageRPCError
from ..failures import describe_failures
from ..stages.pool import StagePool

__all__ = ["fan_out_rpc", "merge_rpc_outcomes"]


async def fan_out_rpc(
    pools: Sequence[StagePool],
    method: str,
    args: Sequence[object] | None,
    kwargs: Mapping[str, object] | None,
    timeout: float | None,  # noqa: ASYNC109 (passed through to each pool)
) -> list[object]:
    """Call ``method`` on every replica of ``pools`` concurrently; see :func:`merge_rpc_outcomes`
    for what it returns or raises. Always checkpoints; cancelling it cancels every call."""
    outcomes: list[outcome.Outcome[list[object]] | None] = [None] * len(pools)

    async def call(i: int, pool: StagePool) -> None:
        outcomes[i] = await outcome.acapture(
            pool.collective_rpc, method, args, kwargs, timeout=timeout
        )

    async with trio.open_nursery() as nursery:
        for i, pool in enumerate(pools):
            nursery.start_soon(call, i, pool)
    await trio.lowlevel.cancel_shielded_checkpoint()
    done = [o for o in outcomes if o is not None]
    return merge_rpc_outcomes(method, timeout, done)


def merge_rpc_outcomes(
    method: str, timeout: float | None, outcomes: Sequence[outcome.Outcome[list[object]]]
) -> list[object]:
    """Every pool's results, in order; or one error for them all. Pure.

    A timeout anywhere raises :class:`CollectiveRPCTimeoutError` naming every replica that did
    not answer (other failures kept as its cause). Else one failing replica that died raises
    its :class:`ReplicaDeadError`; any other failure raises :class:`StageRPCError` naming every
    failing replica, ``from ExceptionGroup`` of all the pools' errors. Non-omni-trio errors
    (bugs) propagate as they are.
    """
    results: list[object] = []
    errors: list[Exception] = []
    for o in outcomes:
        if isinstance(o, outcome.Value):
            results.extend(o.value)
        elif isinstance(o, outcome.Error):
            if not isinstance(o.error, Exception):
                raise o.error  # KeyboardInterrupt and the like are nobody's RPC result
            errors.append(o.error)
    if not errors:
        return results
    for exc in errors:
        if not isinstance(exc, (CollectiveRPCTimeoutError, StageRPCError, ReplicaDeadError)):
            raise exc
    cause: BaseException = (
        errors[0] if len(errors) == 1 else ExceptionGroup(f"collective_rpc({method!r})", errors)
    )
    timeouts = [e for e in errors if isinstance(e, CollectiveRPCTimeoutError)]
    if timeouts:
        pending = [name for t in timeouts for name in t.pending]
        raise CollectiveRPCTimeoutError(method, float(timeout or 0.0), pending) from cause
    failures: list[tuple[str, BaseException]] = []
    for exc in errors:
        if isinstance(exc, StageRPCError) and exc.failures:
            failures.extend(exc.failures)
        else:
            failures.append((_replica_name(exc), exc))
    if len(failures) == 1 and isinstance(failures[0][1], ReplicaDeadError):
        raise failures[0][1]
    if len(errors) == 1 and isinstance(errors[0], StageRPCError):
        raise errors[0]
    raise StageRPCError(
        f"collective_rpc({method!r}) failed on {describe_failures(failures)}",
        failures=failures,
    ) from cause


def _replica_name(exc: BaseException) -> str:
    stage = getattr(exc, "stage_id", None) or "?"
    replica = getattr(exc, "replica", None)
    return f"{stage}[{replica if replica is not None else '?'}]"
