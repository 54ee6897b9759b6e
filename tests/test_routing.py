"""Stage inputs (routing.py): a stage's whole input behaves like a closed memory channel
holding its one chunk."""

import pytest
import trio
import trio.testing

from omni_trio.outputs import StageInput
from omni_trio.routing import WholeInput

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
