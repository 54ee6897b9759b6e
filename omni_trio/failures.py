"""Several failures, one typed error: the merge rules, as pure functions.

Where several children fail at once (stages starting, replicas stopping, the stages of one
request), the caller gets one error of the type that names the situation, raised ``from`` an
``ExceptionGroup`` of every cause (as trio's ``open_tcp_stream`` does): one line to act on,
no cause dropped. A single failure is raised as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import StageError, StageStartError, StageStopError

__all__ = [
    "describe_failures",
    "group_causes",
    "leaves",
    "merge_start_errors",
    "merge_stop_errors",
    "request_error",
    "single_leaf",
]


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """Every exception inside a (nested) exception group, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The only exception inside a (nested) group, or None if there are several."""
    found = leaves(group)
    return found[0] if len(found) == 1 else None


def merge_start_errors(failures: Sequence[StageStartError]) -> StageStartError:
    """One StageStartError naming every stage that failed to start."""
    if len(failures) == 1:
        return failures[0]
    error = StageStartError(
        ", ".join(f.stage_id for f in failures), "; ".join(str(f) for f in failures)
    )
    error.__cause__ = ExceptionGroup("stage start failures", list(failures))
    return error


def merge_stop_errors(group: BaseExceptionGroup[BaseException]) -> StageStopError:
    """One StageStopError listing every replica, of every stage, whose stop failed or overran
    (the StageStopErrors found in ``group``)."""
    stops = [exc for exc in leaves(group) if isinstance(exc, StageStopError)]
    if len(stops) == 1:
        return stops[0]
    error = StageStopError([f for stop in stops for f in stop.failures])
    error.__cause__ = ExceptionGroup("stage stop failures", stops)
    return error


def request_error(request_id: str, errors: Sequence[BaseException]) -> BaseException:
    """The one error a failed request raises: its only error, or a StageError naming every
    stage that failed it."""
    if len(errors) == 1:
        return errors[0]
    stages = [getattr(e, "stage_id", None) or "?" for e in errors]
    first = errors[0]
    error = StageError(
        f"request {request_id!r} failed in {len(errors)} places (stages {', '.join(stages)}); "
        f"first: {first}",
        stage_id=getattr(first, "stage_id", None),
        request_id=request_id,
    )
    error.__cause__ = BaseExceptionGroup(f"request {request_id!r} failures", list(errors))
    return error


def describe_failures(failures: Sequence[tuple[str, BaseException]]) -> str:
    """``"a[0]: ValueError: boom; a[2]: ..."``: one line naming every failed child. A
    replica's own StageStartError gives its reason only (the line it goes into already
    says which stage failed to start). Pure."""
    return "; ".join(f"{name}: {_describe(exc)}" for name, exc in failures)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, StageStartError):
        return exc.reason
    return f"{type(exc).__name__}: {exc}"


def group_causes(message: str, causes: Sequence[BaseException]) -> BaseException:
    """The single cause itself, or every cause kept in one (Base)ExceptionGroup. Pure."""
    if len(causes) == 1:
        return causes[0]
    if all(isinstance(c, Exception) for c in causes):
        return ExceptionGroup(message, [c for c in causes if isinstance(c, Exception)])
    return BaseExceptionGroup(message, list(causes))
