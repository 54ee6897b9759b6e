"""Stage-to-stage input processors: upstream outputs -> the next stage's input.

A processor is a plain function (pure: no I/O, no checkpoints)::

    def processor(upstream: Mapping[str, Sequence[StageOutput]], *, final: bool,
                  options: Mapping[str, object],
                  context: StageContext | None = None) -> StageInput | None

``upstream`` maps each upstream stage id (in the stage's ``inputs`` order) to outputs:
all of them, once, when the stage waits for finished input (``stream_input: false``), or the
new deltas when it streams (``stream_input: true``; then it is called once per upstream
delta). ``final`` is true when every upstream stage has finished. Returning ``None`` sends
nothing for that call (a processor may buffer in ``options``-driven ways; the built-ins do
not). ``options`` is the stage's ``processor_options``. ``context`` is optional: only a
processor whose signature has a ``context`` keyword (or ``**kwargs``) receives it, a
:class:`StageContext` with the request's original prompt and the target stage's own
sampling params (the engine always passes it; ``None`` only when a feed is built without a
request context, as in unit tests). The signature is inspected once, when the processor is
loaded, so processors written before ``context`` existed keep working unchanged.
:func:`original_prompt` is the built-in for a stage that takes the user's prompt rather than
its upstream's tokens (an image stage after an LLM).

Configure one with ``input_processor: "package.module:function"``; without it, the default
is :func:`token_handoff`, which between two LLM stages hands the upstream token ids on as the
next prompt's token ids.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, SupportsInt, cast

from ..config.dotted import import_dotted
from ..outputs import Prompt, SamplingParams, StageInput, StageOutput

if TYPE_CHECKING:
    from ..context import RequestContext

__all__ = [
    "InputProcessor",
    "StageContext",
    "load_processor",
    "map_tokens",
    "original_prompt",
    "passthrough",
    "reads_text",
    "token_handoff",
]

InputProcessor = Callable[..., StageInput | None]  # type: ignore[explicit-any]


@dataclass(frozen=True, slots=True)
class StageContext:
    """What an input processor knows of its request besides the upstream outputs: one per
    request and downstream stage. Immutable."""

    request_id: str
    #: the stage the processor builds the input of
    stage_id: str
    #: the request's original prompt, as the caller gave it (after any prompt_transform)
    prompt: Prompt
    #: the target stage's own sampling params (stage defaults merged), or None
    sampling_params: SamplingParams
    #: the whole request context (priority, every stage's sampling params, ...)
    request: RequestContext

    @classmethod
    def of(cls, request: RequestContext, stage_id: str) -> StageContext:
        """The view of ``request`` for stage ``stage_id``. Pure."""
        return cls(
            request.request_id,
            stage_id,
            request.prompt,
            request.sampling_params.get(stage_id),
            request,
        )

    def __repr__(self) -> str:
        return f"<StageContext {self.request_id!r} -> {self.stage_id!r}>"


def map_tokens(
    token_ids: Sequence[int],
    *,
    offset: int = 0,
    mapping: Mapping[int, int] | None = None,
    vocab_size: int | None = None,
) -> tuple[int, ...]:
    """Map upstream token ids into the downstream vocabulary (pure).

    Each id goes through ``mapping`` (ids missing from it pass unchanged), then ``+ offset``,
    then ``% vocab_size`` when given (so a talker with a smaller vocabulary never receives an
    id it cannot embed).
    """
    out = []
    for t in token_ids:
        v = mapping.get(t, t) if mapping else t
        v += offset
        if vocab_size:
            v %= vocab_size
        out.append(v)
    return tuple(out)


def token_handoff(
    upstream: Mapping[str, Sequence[StageOutput]],
    *,
    final: bool,
    options: Mapping[str, object] | None = None,
    context: StageContext | None = None,
) -> StageInput | None:
    """The default processor: upstream token ids (concatenated in ``inputs`` order) become
    the next stage's prompt token ids; upstream ``data`` payloads travel along.

    ``processor_options``: ``offset`` (int), ``mapping`` ({int: int}), ``vocab_size`` (int),
    ``include_text`` (bool: also hand the upstream text on as ``prompt``, for stages that
    take text, default false). A request's CFG companions (``"<stage>:<role>"`` beside
    ``"<stage>"``, see :mod:`omni_trio.request.companions`) are left out: they are for processors
    written for them.
    """
    opts = options or {}
    tokens: list[int] = []
    texts: list[str] = []
    datas: list[object] = []
    sources = []
    for source, outs in upstream.items():
        if ":" in source and source.rpartition(":")[0] in upstream:
            continue  # a companion's outputs
        sources.append(source)
        for out in outs:
            tokens.extend(out.token_ids)
            if out.text:
                texts.append(out.text)
            if out.data is not None:
                datas.append(out.data)
    if "mapping" not in opts and "offset" not in opts and "vocab_size" not in opts:
        mapped = tuple(tokens)  # nothing to map (the usual case): no work per token
    else:
        # the config's values as given: a wrong one raises its TypeError or ValueError here
        mapping = cast("Mapping[SupportsInt, SupportsInt] | None", opts.get("mapping"))
        mapped = map_tokens(
            tokens,
            offset=int(cast(SupportsInt, opts.get("offset", 0))),
            mapping=None if mapping is None else {int(k): int(v) for k, v in mapping.items()},
            vocab_size=cast("int | None", opts.get("vocab_size")),
        )
    if not mapped and not datas and not final and not texts:
        return None
    data: object = None if not datas else datas[0] if len(datas) == 1 else datas
    prompt = "".join(texts) if opts.get("include_text") and texts else None
    return StageInput(
        prompt=prompt,
        token_ids=mapped,
        data=data,
        final=final,
        source=",".join(sources) or None,
    )


def passthrough(
    upstream: Mapping[str, Sequence[StageOutput]],
    *,
    final: bool,
    options: Mapping[str, object] | None = None,
    context: StageContext | None = None,
) -> StageInput | None:
    """Hand everything on unchanged: token ids, text (as ``prompt``) and data."""
    return token_handoff(upstream, final=final, options={**(options or {}), "include_text": True})


def original_prompt(
    upstream: Mapping[str, Sequence[StageOutput]],
    *,
    final: bool,
    options: Mapping[str, object] | None = None,
    context: StageContext | None = None,
) -> StageInput | None:
    """The stage takes the request's original prompt, not its upstream's tokens
    (vLLM-Omni's LLM -> diffusion case: the image stage renders what the user asked for).

    Sends one chunk, once every upstream finished (``final``; streamed deltas send nothing):
    the prompt as the entry stage got it (text as ``prompt``, token ids as ``token_ids``, a
    prompt dict as ``data``). ``processor_options``: ``include_upstream_text`` (bool: append
    the upstream text to a text prompt, separated by ``separator``, default ``"\n"``).
    Upstream ``data`` payloads travel along when the prompt is not a dict. Raises ValueError
    without a context (a feed built without a request).
    """
    if not final:
        return None
    if context is None:
        raise ValueError("original_prompt needs the request context (context=None)")
    opts = options or {}
    prompt = context.prompt
    datas = [o.data for outs in upstream.values() for o in outs if o.data is not None]
    data: object = None if not datas else datas[0] if len(datas) == 1 else datas
    source = ",".join(upstream) or None
    if isinstance(prompt, str):
        text = prompt
        if opts.get("include_upstream_text"):
            extra = "".join(o.text for outs in upstream.values() for o in outs)
            if extra:
                text = f"{text}{opts.get('separator', chr(10))}{extra}"
        return StageInput(prompt=text, data=data, final=True, source=source)
    if isinstance(prompt, Mapping):
        return StageInput(data=dict(prompt), final=True, source=source)
    return StageInput(token_ids=tuple(prompt), data=data, final=True, source=source)


def reads_text(processor: InputProcessor, options: Mapping[str, object] | None) -> bool:
    """Whether ``processor`` (with its stage's ``processor_options``) may read its upstream
    outputs' text. Pure. False only for the built-ins that do not: :func:`token_handoff`
    without ``include_text`` and :func:`original_prompt` without ``include_upstream_text``;
    any other processor is taken to read it."""
    opts = options or {}
    if processor is token_handoff:
        return bool(opts.get("include_text"))
    if processor is original_prompt:
        return bool(opts.get("include_upstream_text"))
    return True


def accepts_context(func: Callable[..., object]) -> bool:  # type: ignore[explicit-any]
    """Whether ``func`` takes a ``context`` keyword (or ``**kwargs``). Pure; a callable
    whose signature cannot be read is taken not to."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (
            p.name == "context"
            and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        )
        for p in params
    )


def _without_context(func: Callable[..., StageInput | None]) -> InputProcessor:  # type: ignore[explicit-any]
    # a processor written before `context` existed: called as it always was
    @functools.wraps(func)
    def call(
        upstream: Mapping[str, Sequence[StageOutput]],
        *,
        final: bool,
        options: Mapping[str, object],
        context: StageContext | None = None,
    ) -> StageInput | None:
        return func(upstream, final=final, options=options)

    return call


def load_processor(
    path: str | None, *, where: str = "$", source: str | None = None
) -> InputProcessor:
    """Resolve ``"package.module:function"`` (or ``None`` for the default). Blocking (imports
    the module). The result always takes ``context=``: a function that does not declare it
    is wrapped once here, so it is called as before (see the module docstring). Raises
    ConfigError naming ``where``: a malformed or relative path, a module that cannot be
    imported, no such function."""
    if path is None:
        return token_handoff
    func = import_dotted(path, what="input_processor", where=where, source=source)
    assert callable(func)  # import_dotted checked it
    return func if accepts_context(func) else _without_context(func)
