"""_output_builder.py's OutputBuilder: the OmniOutput a caller gets for a stage's output, the
same value as one built with keyword arguments."""

import dataclasses

import pytest

from omni_trio.outputs import OmniOutput, StageOutput
from omni_trio.request.output_builder import OutputBuilder

BUILD = OutputBuilder([("thinker", "text"), ("talker", "audio")])


@pytest.mark.parametrize(
    "out",
    [
        StageOutput(),
        StageOutput(token_ids=(1, 2), text="hi "),
        StageOutput(
            data={"wav": b"\0"},
            finished=True,
            finish_reason="length",
            metrics={"output_index": 3},
        ),
    ],
)
def test_the_same_value_as_the_constructor(out):
    built = BUILD("r", "talker", out)
    expected = OmniOutput(
        request_id="r",
        stage_id="talker",
        stage_index=1,
        kind="audio",
        text=out.text,
        token_ids=out.token_ids,
        data=out.data,
        finished=out.finished,
        finish_reason=out.finish_reason,
        metrics=out.metrics,
    )
    assert built == expected
    assert repr(built) == repr(expected)
    assert type(built) is OmniOutput


def test_token_ids_become_a_tuple_and_the_output_is_frozen():
    # a backend that emitted a list still hands the caller an immutable tuple
    built = BUILD("r", "thinker", StageOutput(token_ids=[7, 8]))  # type: ignore[arg-type]
    assert built.token_ids == (7, 8) and type(built.token_ids) is tuple
    assert (built.stage_index, built.kind) == (0, "text")
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.text = "x"  # type: ignore[misc]
    assert hash(built) == hash(BUILD("r", "thinker", StageOutput(token_ids=(7, 8))))


def test_an_unknown_stage_is_a_key_error():
    with pytest.raises(KeyError):
        BUILD("r", "nobody", StageOutput())
