"""Prompt hooks: an entry stage's ``prompt_transform``, and the directories it leaves behind.

An entry stage may name ``prompt_transform: "package.module:function"``, called as
``fn(prompt, request_id)`` by ``Engine.generate()`` before the prompt is checked. It returns
the prompt to use, or ``(prompt, artifact_dirs)``: a path or an iterable of absolute paths of
directories it made for this request (a decoded image, a downloaded audio file...). The
transformed prompt is the request's prompt everywhere: every entry stage's input and
:attr:`RequestContext.prompt <omni_trio.context.RequestContext.prompt>`, which input
processors and ``prompt_expand`` see. With ``streaming_input`` it transforms the first
segment only.

Several entry stages with a hook: there is one prompt per request, so the hooks of the entry
stages on the request's route run in config order, each on the previous one's prompt.

The hook is a plain function that runs synchronously on the event loop inside
``generate()`` (itself synchronous): it must not block for long. Do slow I/O (a download)
before calling ``generate()``; writing a small file is fine.

A hook that raises, or returns something that is not a prompt or ``(prompt, dirs)``, fails
only that request: ``generate()`` raises :class:`~omni_trio.errors.InvalidRequestError`
naming the hook and its stage (``from`` the hook's exception); the engine and every other
request go on.

**Artifact directories are deleted, once, when the request ends for any reason**:

- the request ran (finished, failed or aborted, the engine's close included): its task
  deletes them before the request counts as ended, so once ``async with stream`` (or
  ``engine.abort``) returned, they are gone;
- ``generate()`` failed after the hook (a later hook raised, the prompt it returned is bad);
- its stream was refused admission (``EngineOverloadedError``, ``DuplicateRequestError``,
  ``EngineClosedError``) or cancelled while it waited for it; such a stream is spent (entering
  it again raises :class:`InvalidRequestError`): call ``generate()`` again;
- its stream was never entered: when the stream (its request context) is garbage-collected,
  deleted by the next deletion of any request's directories, and at the latest when the
  engine closes.

Deleting runs ``shutil.rmtree`` in a worker thread (never on the event loop), shielded from
cancellation (bounded by the file system), except on ``generate()``'s own failure paths,
which are synchronous like the hook that just made the directories. A directory already
gone is fine; one that cannot be deleted (permissions, a symlink: ``rmtree`` does not follow
them) is logged as an error, since the request it belonged to has ended.
"""

from __future__ import annotations

import logging
import os
import shutil
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import trio

from ..config.dotted import import_dotted
from ..config.pipeline import PipelineConfig
from ..errors import InvalidRequestError
from ..outputs import Prompt, StageInput
from .planning import prompt_to_input

if TYPE_CHECKING:
    from ..context import RequestContext

__all__ = [
    "ArtifactKeeper",
    "Artifacts",
    "PromptHooks",
    "remove_artifacts",
    "remove_dirs",
    "split_hook_result",
]

logger = logging.getLogger(__name__)

#: ``fn(prompt, request_id) -> prompt | (prompt, artifact_dirs)``
PromptTransform = Callable[[Prompt, str], object]


def _artifact_dir(item: object) -> str:
    if isinstance(item, bytes) or not isinstance(item, (str, os.PathLike)):
        raise TypeError(f"an artifact dir must be a str or os.PathLike path, not {item!r}")
    path = os.fspath(item)
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"an artifact dir must be an absolute path, not {path!r}")
    if os.path.dirname(os.path.normpath(path)) == os.path.normpath(path):
        raise ValueError(f"refusing a file system root as an artifact dir: {path!r}")
    return path


def split_hook_result(result: object) -> tuple[object, tuple[str, ...], str | None]:
    """What a ``prompt_transform`` returned: ``(prompt, dirs, problem)``. Pure.

    ``(prompt, artifact_dirs)`` is a 2-tuple whose second item is not an int (a prompt of
    two token ids is a prompt); ``artifact_dirs`` is one path or an iterable of paths.
    ``problem`` says what is wrong with the dirs (``None`` when nothing is); ``dirs`` holds
    the valid ones even then, so they can be deleted.
    """
    if not (isinstance(result, tuple) and len(result) == 2 and not isinstance(result[1], int)):
        return result, (), None
    prompt, raw = result
    items: Iterable[object]
    if isinstance(raw, (str, os.PathLike)):
        items = (raw,)
    elif isinstance(raw, Iterable) and not isinstance(raw, (bytes, dict)):
        items = raw
    else:
        return prompt, (), f"artifact_dirs must be a path or an iterable of paths, not {raw!r}"
    dirs: list[str] = []
    problems: list[str] = []
    for item in items:
        try:
            dirs.append(_artifact_dir(item))
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    return prompt, tuple(dict.fromkeys(dirs)), "; ".join(problems) or None


def remove_dirs(dirs: Sequence[str]) -> None:
    """Delete each directory tree; one already gone is fine, one that cannot be deleted is
    logged (its request has ended: there is nobody to raise to). Blocking."""
    for path in dirs:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.error("could not delete the artifact directory %s: %r", path, exc)


class Artifacts:
    """The artifact directories of one request. Deleted once (see the module docstring)."""

    __slots__ = ("_keeper", "dirs", "request_id")

    def __init__(self, keeper: ArtifactKeeper, request_id: str, dirs: tuple[str, ...]) -> None:
        self._keeper = keeper
        self.request_id = request_id
        self.dirs = dirs

    @property
    def removed(self) -> bool:
        """Whether they were deleted (or their deletion has begun)."""
        return id(self) not in self._keeper._held

    def take(self) -> list[str]:
        """The directories to delete, once: later calls get ``[]``. Synchronous."""
        return self._keeper._take(self)

    def remove_nowait(self) -> None:
        """Delete them now, on this thread (``generate()``'s failure paths). Blocking."""
        remove_dirs(self.take())

    def __repr__(self) -> str:
        state = " removed" if self.removed else ""
        return f"<Artifacts {self.request_id!r} dirs={list(self.dirs)}{state}>"


class ArtifactKeeper:
    """Every artifact set not deleted yet, of one engine: so that none outlives it."""

    def __init__(self) -> None:
        self._held: dict[int, Artifacts] = {}
        # sets whose stream was collected unentered; appended from a GC finalizer (any
        # thread: list.append is atomic), swept by the next deletion. ``_held`` stays the
        # truth: a set lost from this list is still deleted at close.
        self._orphans: list[Artifacts] = []

    def hold(self, request_id: str, dirs: tuple[str, ...]) -> Artifacts:
        """Keep ``dirs`` until they are deleted. Synchronous."""
        artifacts = Artifacts(self, request_id, dirs)
        self._held[id(artifacts)] = artifacts
        return artifacts

    def watch(self, context: RequestContext) -> None:
        """Delete ``context``'s artifacts if it is garbage-collected before they were (a
        stream never entered). The admitted request holds this very context until it ended,
        so it cannot be collected while the request runs. Synchronous."""
        artifacts = context.artifacts
        # a context's artifacts are always a keeper's (RequestMaker makes them with hold())
        if isinstance(artifacts, Artifacts) and not artifacts.removed:
            finalizer = weakref.finalize(context, self._orphaned, artifacts)
            finalizer.atexit = False  # at exit the engine is gone: close deleted them

    def _orphaned(self, artifacts: Artifacts) -> None:
        if not artifacts.removed:
            self._orphans.append(artifacts)

    def _take(self, artifacts: Artifacts | None) -> list[str]:
        # the dirs to delete now: ``artifacts``' and every orphan's, each set once
        orphans, self._orphans = self._orphans, []
        dirs: list[str] = []
        for each in (artifacts, *orphans):
            if each is not None and self._held.pop(id(each), None) is not None:
                dirs.extend(each.dirs)
        return dirs

    @property
    def held(self) -> int:
        """How many artifact sets are not deleted yet."""
        return len(self._held)

    async def aclose(self) -> None:
        """Delete every set still held (streams never entered; every admitted request has
        deleted its own by the time the engine closes). Always checkpoints; shielded."""
        dirs = [d for each in self._held.values() for d in each.dirs]
        self._held.clear()
        self._orphans = []
        if not dirs:  # the usual case: no worker thread
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(remove_dirs, dirs)


async def remove_artifacts(context: RequestContext) -> None:
    """Delete the artifact directories of ``context``'s request (and of collected, unentered
    streams), once: later calls delete nothing. Always checkpoints; never raises (not even
    ``Cancelled``: the deletion is shielded, in a worker thread)."""
    artifacts = context.artifacts
    dirs = [] if artifacts is None else artifacts.take()
    if not dirs:
        await trio.lowlevel.cancel_shielded_checkpoint()
        return
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(remove_dirs, dirs)


def check_not_spent(context: RequestContext) -> None:
    """Refuse a stream whose artifacts were deleted: its admission was refused before, or
    the engine closed (then entering it would be refused anyway). Pure. Raises
    :class:`InvalidRequestError`."""
    if context.artifacts is not None and context.artifacts.removed:
        raise InvalidRequestError(
            f"request {context.request_id!r}: its prompt_transform artifacts were deleted "
            "(this stream was refused admission before, or the engine closed); call "
            "generate() again"
        )


class PromptHooks:
    """The ``prompt_transform`` hooks of a pipeline's entry stages, loaded once, and the
    keeper of their artifacts."""

    def __init__(self, config: PipelineConfig) -> None:
        #: stage id -> (dotted path, hook), entry stages with a hook, in config order
        self.hooks: dict[str, tuple[str, PromptTransform]] = {}
        for i, st in enumerate(config.stages):
            if st.prompt_transform is not None and not st.inputs:
                hook = import_dotted(
                    st.prompt_transform,
                    what="prompt_transform",
                    where=f"$.stages[{i}].prompt_transform",
                    source=config.source,
                )
                assert callable(hook)  # import_dotted checked it
                self.hooks[st.id] = (st.prompt_transform, hook)
        self.keeper = ArtifactKeeper()

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def apply(
        self, prompt: Prompt, request_id: str, route: Iterable[str]
    ) -> tuple[Prompt, StageInput, Artifacts | None]:
        """Run the hooks of the entry stages in ``route`` (config order), then check the
        prompt: ``(prompt, first input, artifacts or None)``. Synchronous: runs the hooks.
        Raises :class:`InvalidRequestError` naming the hook and stage that raised or
        returned something bad; the artifact dirs returned so far are deleted first."""
        active = set(route)
        dirs: list[str] = []
        current: Prompt = prompt
        first: StageInput | None = None
        try:
            for sid, (path, hook) in self.hooks.items():
                if sid not in active:
                    continue
                where = f"prompt_transform {path!r} of stage {sid!r}"
                try:
                    result = hook(current, request_id)
                except Exception as exc:
                    raise InvalidRequestError(
                        f"{where} failed for request {request_id!r}: {type(exc).__name__}: {exc}"
                    ) from exc
                returned, more, problem = split_hook_result(result)
                dirs.extend(more)
                if problem is not None:
                    raise InvalidRequestError(f"{where} returned bad artifact_dirs: {problem}")
                try:
                    first = prompt_to_input(returned)
                except InvalidRequestError as exc:
                    raise InvalidRequestError(f"{where} returned a bad prompt: {exc}") from exc
                current = cast(Prompt, returned)  # prompt_to_input took it
        except InvalidRequestError:
            remove_dirs(dirs)
            raise
        if first is None:  # no hook on this route: the caller's prompt as it is
            first = prompt_to_input(prompt)
        unique = tuple(dict.fromkeys(dirs))
        artifacts = self.keeper.hold(request_id, unique) if unique else None
        return current, first, artifacts
