"""Streaming input into a vLLM engine: a request whose input arrives in segments.

vLLM (0.32) takes, in place of a prompt, an async generator of ``StreamingInput``: a
*resumable* request. Observed on the CPU build with the tiny model: the engine generates after
each segment as after a turn (up to ``max_tokens`` new tokens, ``finish_reason="length"`` and
``finished=False`` per segment), extends the request's prompt with the next segment when it
comes, and finishes only once the generator ends (its last output, or vLLM's own empty
``STREAM_FINISHED`` marker when the engine had nothing pending). So the first output comes
before the input has ended. vLLM refuses streaming input for ``n > 1``, stop strings and
``FINAL_ONLY`` outputs: :func:`streamable` says which params fit; for the others the worker
collects every segment first and submits one ordinary request (the behaviour before).

Everything here runs on the worker's asyncio loop, in its thread: segments come from the
backend as ``Segment`` commands and wait in one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from ...outputs import StageInput
from ...stages.input_stream import merge_inputs

__all__ = ["collect_segments", "is_empty", "segment_stream", "streamable"]

#: what a request's segments wait in; ``None`` ends its input
Segments = asyncio.Queue[StageInput | None]


def is_empty(chunk: StageInput) -> bool:
    """Whether a chunk carries no input (a bare end marker). Pure."""
    return chunk.prompt is None and not chunk.token_ids and chunk.data is None


def streamable(params: Any, final_kind: Any) -> bool:
    """Whether vLLM takes streaming input with these SamplingParams (see the module
    docstring). Pure."""
    return params.n == 1 and not params.stop and params.output_kind != final_kind


async def segment_stream(
    streaming_input: Callable[..., Any],
    first: Any,
    segments: Segments,
    render: Callable[[StageInput], Any],
) -> AsyncIterator[Any]:
    """The async generator vLLM reads a resumable request's input from: the first segment
    (``first``, rendered already: a bad prompt fails the request before it is added), then
    each queued one, rendered as an ordinary prompt, until ``None`` or a final chunk."""
    yield streaming_input(prompt=first)
    while True:
        chunk = await segments.get()
        if chunk is None:
            return
        if not is_empty(chunk):
            yield streaming_input(prompt=render(chunk))
        if chunk.final:
            return


async def collect_segments(first: StageInput, segments: Segments) -> StageInput:
    """Every segment of a request merged into one input (for params vLLM cannot stream)."""
    chunks = [first]
    chunk: StageInput | None = first
    while chunk is not None and not chunk.final:
        chunk = await segments.get()
        if chunk is not None:
            chunks.append(chunk)
    return merge_inputs(chunks)
