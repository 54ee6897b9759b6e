"""Stage-to-stage input processors: upstream outputs -> the next stage's input.

A processor is a plain function (pure: no I/O, no checkpoints)::

    def processor(upstream: Mapping[str, Sequence[StageOutput]], *, final: bool,
                  options: Mapping[str, Any]) -> StageInput | None

``upstream`` maps each upstream stage id (in the stage's ``inputs`` order) to outputs:
all of them, once, when the stage waits for finished input (``stream_input: false``), or the
new deltas when it streams (``stream_input: true``; then it is called once per upstream
delta). ``final`` is true when every upstream stage has finished. Returning ``None`` sends
nothing for that call (a processor may buffer in ``options``-driven ways; the built-ins do
not). ``options`` is the stage's ``processor_options``.

Configure one with ``input_processor: "package.module:function"``; without it, the default
is :func:`token_handoff`, which between two LLM stages hands the upstream token ids on as the
next prompt's token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from .._dotted import import_dotted
from ..outputs import StageInput, StageOutput

__all__ = ["InputProcessor", "load_processor", "map_tokens", "passthrough", "token_handoff"]

InputProcessor = Callable[..., StageInput | None]


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
    options: Mapping[str, Any] | None = None,
) -> StageInput | None:
    """The default processor: upstream token ids (concatenated in ``inputs`` order) become
    the next stage's prompt token ids; upstream ``data`` payloads travel along.

    ``processor_options``: ``offset`` (int), ``mapping`` ({int: int}), ``vocab_size`` (int),
    ``include_text`` (bool: also hand the upstream text on as ``prompt``, for stages that
    take text, default false).
    """
    opts = options or {}
    tokens: list[int] = []
    texts: list[str] = []
    datas: list[Any] = []
    sources = []
    for source, outs in upstream.items():
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
        mapping = opts.get("mapping")
        mapped = map_tokens(
            tokens,
            offset=int(opts.get("offset", 0)),
            mapping=None if mapping is None else {int(k): int(v) for k, v in mapping.items()},
            vocab_size=opts.get("vocab_size"),
        )
    if not mapped and not datas and not final and not texts:
        return None
    data: Any = None if not datas else datas[0] if len(datas) == 1 else datas
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
    options: Mapping[str, Any] | None = None,
) -> StageInput | None:
    """Hand everything on unchanged: token ids, text (as ``prompt``) and data."""
    return token_handoff(upstream, final=final, options={**(options or {}), "include_text": True})


def load_processor(
    path: str | None, *, where: str = "$", source: str | None = None
) -> InputProcessor:
    """Resolve ``"package.module:function"`` (or ``None`` for the default). Blocking (imports
    the module). Raises ConfigError naming ``where``: a malformed or relative path, a module
    that cannot be imported, no such function."""
    if path is None:
        return token_handoff
    func = import_dotted(path, what="input_processor", where=where, source=source)
    return cast(InputProcessor, func)
