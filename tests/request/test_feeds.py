"""Stage inputs (routing.py): a stage's whole input behaves like a closed memory channel
holding its one chunk; a feed's input processor failures keep their type or become the
stage's StageError."""

import pytest
import trio
import trio.testing

from omni_trio.errors import InvalidRequestError, StageError
from omni_trio.observer import ObserverSet
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.request.feeds import StageFeed, WholeInput

CHUNK = StageInput(token_ids=(1, 2, 3))


async def test_whole_input_gives_its_chunk_then_ends():
    inputs = WholeInput(CHUNK)
    assert [chunk async for chunk in inputs] == [CHUNK]
    with pytest.raises(trio.EndOfChannel):
        await inputs.receive()
    with pytest.raises(trio.EndOfChannel):
        await WholeInput(None).receive()


def test_whole_input_receive_nowait_gives_its_chunk_then_ends():
    # never WouldBlock: the input is whole
    inputs = WholeInput(CHUNK)
    assert inputs.receive_nowait() is CHUNK
    with pytest.raises(trio.EndOfChannel):
        inputs.receive_nowait()
    inputs.close()
    with pytest.raises(trio.ClosedResourceError):
        inputs.receive_nowait()


async def test_whole_input_receive_is_a_checkpoint():
    # like a memory channel's receive: a schedule point when it returns the chunk
    with trio.testing.assert_checkpoints():
        await WholeInput(CHUNK).receive()


async def test_a_cancelled_receive_keeps_the_chunk():
    inputs = WholeInput(CHUNK)
    with trio.CancelScope() as scope:
        scope.cancel()
        await inputs.receive()
        pytest.fail("a cancelled receive returned")  # pragma: no cover
    assert scope.cancelled_caught
    assert await inputs.receive() is CHUNK


async def test_a_closed_whole_input_refuses_to_receive():
    with WholeInput(CHUNK) as inputs:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await inputs.receive()
    inputs = WholeInput(CHUNK)
    with trio.testing.assert_checkpoints():
        await inputs.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await inputs.receive()


def _feed(processor) -> StageFeed:
    return StageFeed(
        "talker",
        ("thinker",),
        stream=False,
        processor=processor,
        options={},
        send=None,
        request_id="r",
        observers=ObserverSet(),
    )


def test_a_processor_rejecting_the_input_keeps_its_type_and_names_the_stage():
    def picky(upstream, *, final, options, context=None):
        raise InvalidRequestError("no voice named 'x'")

    feed = _feed(picky)
    feed.collect("thinker", [StageOutput(token_ids=(1,), finished=True)])
    assert feed.finish("thinker")
    with pytest.raises(InvalidRequestError) as info:
        feed.final_chunk()
    assert not isinstance(info.value, StageError)
    assert str(info.value) == (
        "the input processor of stage 'talker' rejected request 'r': no voice named 'x'"
    )
    assert isinstance(info.value.__cause__, InvalidRequestError)


def test_a_processor_bug_is_a_stage_error_of_its_stage():
    def buggy(upstream, *, final, options, context=None):
        raise ValueError("not a request's fault")

    feed = _feed(buggy)
    assert feed.finish("thinker")
    with pytest.raises(StageError, match="input processor of stage 'talker' failed") as info:
        feed.final_chunk()
    assert info.value.stage_id == "talker" and isinstance(info.value.__cause__, ValueError)
