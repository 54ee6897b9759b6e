"""CFG companions: extra requests that run beside a request on its entry stage.

An entry stage may name a ``prompt_expand`` hook (``"package.module:function"``)::

    def expand(prompt, sampling_params) -> list[omni_trio.Companion]: ...

called by ``generate()`` with the request's prompt and the entry stage's resolved sampling
params; e.g. classifier-free guidance returns ``[Companion("negative", negative_prompt)]``.
Every companion is built and checked (:func:`expand_companions`, before anything is
admitted: a failing hook or a bad companion raises :class:`InvalidRequestError` from
``generate()`` and nothing runs). On the entry stage each companion runs as a request of its
own (id ``"<request id>:<role>"``) on the parent's replica; its outputs never reach the
caller. The stages downstream of the entry stage start once the parent's and every
companion's entry-stage output is complete, and their input processor receives each
companion's outputs under ``"<entry stage id>:<role>"`` beside the parent's under the entry
stage's id. A companion lives in its parent's cancel scope: aborting the parent aborts it, and
a companion that fails (or whose replica dies) fails the parent with a :class:`StageError`
naming its role.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import outcome
import trio

from ..config.dotted import import_dotted
from ..context import PlannedCompanion
from ..errors import InvalidRequestError, StageAborted, StageError
from ..outputs import Prompt, SamplingParams, StageInput, StageOutput
from .feeds import WholeInput

if TYPE_CHECKING:
    from ..stages.backend import StageBackend
    from ..stages.input_stream import InputStream
    from ..stages.pool import StagePool
    from .feeds import StageFeed
    from .state import Request

__all__ = [
    "Companion",
    "ExpandHook",
    "companion_key",
    "expand_companions",
    "load_expand_hooks",
    "run_with_companions",
]


@dataclass(frozen=True, slots=True)
class Companion:
    """What a ``prompt_expand`` hook returns: one companion request. ``sampling_params``
    ``None`` means the parent's entry-stage sampling params; a mapping is merged over them."""

    role: str
    prompt: Prompt
    sampling_params: SamplingParams = None


#: ``fn(prompt, sampling_params) -> list[Companion]``
ExpandHook = Callable[[Prompt, SamplingParams], Sequence[Companion]]


def companion_key(stage_id: str, role: str) -> str:
    """Where a downstream input processor finds a companion's outputs. Pure."""
    return f"{stage_id}:{role}"


def _merged(parent: SamplingParams, own: SamplingParams) -> SamplingParams:
    if own is None:
        return parent
    if isinstance(own, Mapping) and isinstance(parent, Mapping):
        return {**parent, **own}
    return own


def expand_companions(
    hook: ExpandHook,
    *,
    hook_name: str,
    stage_id: str,
    request_id: str,
    prompt: Prompt,
    sampling_params: SamplingParams,
    to_input: Callable[[object], StageInput],
) -> tuple[PlannedCompanion, ...]:
    """Call the entry stage's ``prompt_expand`` hook and check what it returns.

    Synchronous (the hook is a plain function). Raises :class:`InvalidRequestError` naming
    the hook when it raises (from its exception) or returns something other than a sequence
    of :class:`Companion`, and naming the role for a bad role (empty, repeated, with ``:``)
    or a bad companion prompt (``to_input``'s error, from it).
    """
    try:
        companions = hook(prompt, sampling_params)
    except Exception as exc:
        raise InvalidRequestError(
            f"the prompt_expand hook {hook_name!r} of stage {stage_id!r} failed for request "
            f"{request_id!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(companions, Sequence) or not all(
        isinstance(c, Companion) for c in companions
    ):
        raise InvalidRequestError(
            f"the prompt_expand hook {hook_name!r} of stage {stage_id!r} must return a list "
            f"of omni_trio.Companion, got {type(companions).__name__}"
        )
    planned: list[PlannedCompanion] = []
    seen: set[str] = set()
    for c in companions:
        role: object = c.role
        if not isinstance(role, str) or not role or ":" in role or role in seen:
            raise InvalidRequestError(
                f"the prompt_expand hook {hook_name!r} of stage {stage_id!r} returned a "
                f"companion with role {role!r}: a role is a non-empty string without ':', "
                "unique within the request"
            )
        seen.add(role)
        try:
            first = to_input(c.prompt)
        except InvalidRequestError as exc:
            raise InvalidRequestError(
                f"companion {role!r} of request {request_id!r}: {exc}"
            ) from exc
        planned.append(
            PlannedCompanion(
                role, f"{request_id}:{role}", first, _merged(sampling_params, c.sampling_params)
            )
        )
    return tuple(planned)


async def run_with_companions(
    req: Request,
    pool: StagePool,
    backend: StageBackend,
    stage_id: str,
    feeds: Sequence[StageFeed],
    inputs: InputStream,
    emit: Callable[[StageOutput], Awaitable[None]],
    streamed: bool,
) -> None:
    """Run ``req`` on ``backend`` (the parent's replica, bound by the caller) with each of its
    companions beside it, each bound to the same replica; return once all ended.

    Checkpoints. A companion's outputs are kept and, once it finished, handed to ``feeds``
    under :func:`companion_key` (those feeds do not stream for a request with companions:
    they wait for every source). A companion that fails fails ``req`` (a
    :class:`StageError` naming its role); one aborted through the replica aborts it. Raises
    what the parent's ``run_request`` raises (then the companions are cancelled first).
    """
    context = req.context
    for comp in context.companions:
        pool.bind_to(comp.request_id, backend)
    parent: outcome.Outcome[None] | None = None
    try:
        async with trio.open_nursery() as nursery:
            for comp in context.companions:
                nursery.start_soon(
                    _run_companion, req, pool, backend, stage_id, feeds, comp, name=comp.request_id
                )
            parent = await outcome.acapture(
                backend.run_request,
                req.request_id,
                inputs,
                req.sampling_params(stage_id),
                emit,
                streamed=streamed,
                context=context,
            )
            if isinstance(parent, outcome.Error):
                nursery.cancel_scope.cancel()  # the parent failed or was cancelled: so are they
    finally:
        for comp in context.companions:
            pool.release(comp.request_id)  # a no-op for those that released already
    assert parent is not None
    parent.unwrap()


async def _run_companion(
    req: Request,
    pool: StagePool,
    backend: StageBackend,
    stage_id: str,
    feeds: Sequence[StageFeed],
    comp: PlannedCompanion,
) -> None:
    outs: list[StageOutput] = []

    async def keep(out: StageOutput) -> None:
        outs.append(out)

    try:
        try:
            await backend.run_request(
                comp.request_id,
                WholeInput(comp.first_input),
                comp.sampling_params,
                keep,
                streamed=False,
                context=req.context,
            )
        finally:
            pool.release(comp.request_id)
    except StageAborted:
        req.request_abort()
        return
    except Exception as exc:
        error = StageError(
            f"companion {comp.role!r} of request {req.request_id!r} failed on stage "
            f"{stage_id!r}: {type(exc).__name__}: {exc}",
            stage_id=stage_id,
            request_id=req.request_id,
        )
        error.__cause__ = exc
        req.fail(stage_id, error)
        return
    key = companion_key(stage_id, comp.role)
    for feed in feeds:
        feed.collect(key, outs)
        feed.finish(key)  # never the last source: the parent's own end comes after


def load_expand_hooks(
    stages: Sequence[tuple[str, str | None]], *, source: str | None = None
) -> dict[str, tuple[ExpandHook, str]]:
    """Import each entry stage's ``prompt_expand`` hook: ``(stage id, dotted path or None)``
    pairs -> ``{stage id: (hook, path)}``. Blocking (imports). Raises ConfigError naming the
    stage's key."""
    hooks: dict[str, tuple[ExpandHook, str]] = {}
    for i, (sid, path) in enumerate(stages):
        if path is not None:
            hook = import_dotted(
                path, what="prompt_expand", where=f"$.stages[{i}].prompt_expand", source=source
            )
            hooks[sid] = (cast(ExpandHook, hook), path)
    return hooks
