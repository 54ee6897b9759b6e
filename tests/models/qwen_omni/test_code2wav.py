"""Qwen3-Omni's code2wav as a torch-backend module (:mod:`omni_trio.models.qwen_omni.code2wav`):
the module protocol, batches that equal single runs, and a stream through the torch backend
that equals the one-shot decode (generate()'s waveform)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio.config.stage import StageConfig
from omni_trio.errors import ConfigError, StageError
from omni_trio.outputs import StageInput, StageOutput

pytestmark = pytest.mark.slow

FACTORY = "omni_trio.models.qwen_omni.code2wav:build_code2wav"


@pytest.fixture(scope="module")
def module(qwen3_path: Path) -> Any:
    import torch

    from omni_trio.models.qwen_omni.code2wav import build_code2wav

    torch.set_num_threads(1)
    return build_code2wav({"model": str(qwen3_path)})


def flat(codes: Any) -> list[int]:
    """[16, T] codes -> the talker's stream: frame after frame, 16 codes each."""
    return [int(c) for c in codes.T.reshape(-1)]


def test_protocol_attributes(module: Any) -> None:
    assert (module.frame_size, module.hop_length, module.sample_rate) == (16, 1920, 24000)
    assert module.output_delay == 555 and module.vocab_size == 64
    assert module.context_codes == 25 * 16


def test_bad_options_are_named(qwen3_path: Path) -> None:
    from omni_trio.models.qwen_omni.code2wav import build_code2wav

    with pytest.raises(ConfigError, match=r"unknown options \['weights'\]"):
        build_code2wav({"model": str(qwen3_path), "weights": "x"})
    with pytest.raises(ConfigError, match="options.model"):
        build_code2wav({})
    with pytest.raises(ConfigError, match="left_context must be an int >= 1"):
        build_code2wav({"model": str(qwen3_path), "left_context": 0})


def test_a_padded_batch_row_equals_its_single_run(module: Any) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 64, (1, 16 * 9), generator=g)
    b = torch.randint(0, 64, (1, 16 * 4), generator=g)
    padded = torch.cat((b, torch.zeros((1, 16 * 5), dtype=torch.long)), dim=1)
    with torch.no_grad():
        both = module(torch.cat((a, padded)))
        alone_a, alone_b = module(a), module(b)
    assert both.shape == (2, 9 * 1920)
    # (a longer input runs other kernels: equal up to float32 rounding, ~1e-5)
    assert torch.allclose(both[0], alone_a[0], atol=1e-4)
    # causal: the padding frames change nothing before them
    assert torch.allclose(both[1, : 4 * 1920], alone_b[0], atol=1e-4)


async def stream(config: StageConfig, codes: list[int], per_chunk: int) -> list[StageOutput]:
    from omni_trio.backends.torch.backend import TorchBackend

    backend = TorchBackend(config, stage_index=2)
    send, receive = trio.open_memory_channel[StageInput](len(codes))
    for i in range(0, len(codes), per_chunk):
        piece = tuple(codes[i : i + per_chunk])
        send.send_nowait(StageInput(token_ids=piece, final=i + per_chunk >= len(codes)))
    send.close()
    outs: list[StageOutput] = []

    async def emit(out: StageOutput) -> None:
        outs.append(out)

    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        with trio.fail_after(120):
            await backend.run_request("r", receive, None, emit)
        nursery.cancel_scope.cancel()
    return outs


def c2w_config(path: Path, **options: Any) -> StageConfig:
    opts = {"factory": FACTORY, "model": str(path), **options}
    return StageConfig(id="code2wav", backend="torch", stream_input=True, options=opts)


async def test_streamed_chunks_are_the_one_shot_waveform(qwen3_path: Path, reference: Any) -> None:
    codes = flat(reference.codes)
    n_frames = reference.codes.shape[1]
    # left context covering the utterance: each chunk decodes as the one-shot run does
    config = c2w_config(qwen3_path, chunk_size=16 * 10, left_context=n_frames)
    outs = await stream(config, codes, per_chunk=16)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert len(outs) == -(-n_frames // 10)
    wav = np.concatenate([o.data for o in outs])
    # one-shot length: 1920 T - 555 (the last frame's tail needs a next frame)
    assert wav.shape == reference.wav.shape == (1920 * n_frames - 555,)
    assert np.abs(wav - reference.wav).max() < 1e-4
    assert all(o.metrics is not None and o.metrics["sample_rate"] == 24000 for o in outs)


async def test_an_input_that_ends_inside_a_frame_fails(qwen3_path: Path) -> None:
    bad = pytest.RaisesExc(StageError, match=r"ended inside a frame \(20 codes; frames are 16")
    with pytest.RaisesGroup(bad, flatten_subgroups=True):
        await stream(c2w_config(qwen3_path, chunk_size=16), [1] * 20, per_chunk=20)


async def test_a_chunk_size_that_is_not_whole_frames_fails_the_start(qwen3_path: Path) -> None:
    bad = pytest.RaisesExc(ConfigError, match="chunk_size=20 is not a whole number of frames")
    with pytest.RaisesGroup(bad, flatten_subgroups=True):
        await stream(c2w_config(qwen3_path, chunk_size=20), [1] * 16, per_chunk=16)
