"""The worker side of vLLM streaming input, without an engine (plain asyncio)."""

import asyncio
from types import SimpleNamespace

from omni_trio.backends.vllm.protocol import to_stage_output
from omni_trio.backends.vllm.streaming import collect_segments, is_empty, segment_stream, streamable
from omni_trio.outputs import StageInput

FINAL_ONLY, DELTA = "final_only", "delta"


def params(n=1, stop=None, kind=DELTA):
    return SimpleNamespace(n=n, stop=stop, output_kind=kind)


def test_streamable_follows_vllms_rules():
    assert streamable(params(), FINAL_ONLY)
    assert not streamable(params(n=2), FINAL_ONLY)
    assert not streamable(params(stop=["."]), FINAL_ONLY)
    assert not streamable(params(kind=FINAL_ONLY), FINAL_ONLY)


def test_is_empty():
    assert is_empty(StageInput(final=True))
    assert not is_empty(StageInput(token_ids=(1,)))
    assert not is_empty(StageInput(prompt="x"))
    assert not is_empty(StageInput(data={"a": 1}))


def test_segment_stream_yields_each_segment_until_the_end():
    async def main():
        queue = asyncio.Queue()
        for chunk in (
            StageInput(token_ids=(2,), final=False),
            StageInput(final=False),  # nothing in it: skipped
            StageInput(token_ids=(3,), final=True),  # a final chunk with content ends it
        ):
            queue.put_nowait(chunk)
        queue.put_nowait(StageInput(token_ids=(99,)))  # never read
        gen = segment_stream(
            lambda prompt: ("SI", prompt), "first", queue, lambda c: list(c.token_ids)
        )
        return [item async for item in gen], queue.qsize()

    items, left = asyncio.run(main())
    assert items == [("SI", "first"), ("SI", [2]), ("SI", [3])]
    assert left == 1


def test_segment_stream_ends_on_none():
    async def main():
        queue = asyncio.Queue()
        queue.put_nowait(StageInput(prompt="b", final=False))
        queue.put_nowait(None)
        return [x async for x in segment_stream(lambda prompt: prompt, "a", queue, str)]

    assert len(asyncio.run(main())) == 2


def test_collect_segments_merges_them_for_params_vllm_cannot_stream():
    async def main():
        queue = asyncio.Queue()
        queue.put_nowait(StageInput(prompt=" world", token_ids=(2,), final=False))
        queue.put_nowait(None)
        return await collect_segments(
            StageInput(prompt="hello", token_ids=(1,), final=False), queue
        )

    merged = asyncio.run(main())
    assert (merged.prompt, merged.token_ids, merged.final) == ("hello world", (1, 2), True)


def test_vllms_stream_finished_marker_is_a_finished_output():
    marker = SimpleNamespace(outputs=[], finished=True)
    out = to_stage_output(marker)
    assert out.finished and out.finish_reason == "stop" and out.token_ids == ()
