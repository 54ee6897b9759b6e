"""A stage's input: the stream of :class:`~omni_trio.outputs.StageInput` chunks a backend reads.

:data:`InputStream` is what ``run_request`` hands a backend (one chunk unless the stage has
``stream_input``); :func:`collect_input` reads it to the end for backends that cannot start
on partial input, and :func:`merge_inputs` is the pure rule that turns chunks into one input.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ..outputs import StageInput

__all__ = ["InputStream", "collect_input", "merge_inputs"]

#: a stage's input chunks (a memory channel, or the orchestrator's one-chunk WholeInput)
InputStream = trio.abc.ReceiveChannel[StageInput]


async def collect_input(inputs: InputStream) -> StageInput:
    """Merge every chunk of a (possibly streamed) input into one final ``StageInput``.

    For backends that cannot start on partial input. Checkpoints; returns when the
    upstream sends its final chunk or closes.
    """
    chunks: list[StageInput] = []
    async for chunk in inputs:
        chunks.append(chunk)
        if chunk.final:
            break
    return merge_inputs(chunks)


def merge_inputs(chunks: Sequence[StageInput]) -> StageInput:
    """Several input chunks as one final ``StageInput``: texts and token ids concatenated,
    data payloads listed (one alone stays itself), the last source. Pure."""
    prompt: str | None = None
    tokens: list[int] = []
    datas: list[object] = []
    source: str | None = None
    for chunk in chunks:
        if chunk.prompt is not None:
            prompt = (prompt or "") + chunk.prompt
        tokens.extend(chunk.token_ids)
        if chunk.data is not None:
            datas.append(chunk.data)
        source = chunk.source or source
    data: object = None if not datas else datas[0] if len(datas) == 1 else datas
    return StageInput(prompt=prompt, token_ids=tuple(tokens), data=data, final=True, source=source)
