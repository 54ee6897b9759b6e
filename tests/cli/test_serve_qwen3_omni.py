"""``omni-trio serve qwen3-omni`` as a real process: the tiny Qwen3-Omni thinker on vLLM, its
talker and code2wav answer an OpenAI chat with text and audio (a WAV, and streamed PCM16),
in the voice asked for; an unknown voice is a 400 naming the voices."""

from __future__ import annotations

import base64
import io
import signal
import wave

import pytest

from ..conftest import engine_seconds
from .test_serve import Server, iter_queue, openai_client

MODEL = "qwen3-omni"
MESSAGES = [{"role": "user", "content": "Tell me about the weather."}]
RATE = 24_000
#: code2wav: a frame of 16 codes is 1920 samples, and an utterance's last 555 samples need
#: a next frame: T frames decode to 1920 T - 555 samples
FRAME_SAMPLES, TAIL = 1920, 555
#: the shipped talker's max_tokens is 40: the 40th code 0 ends the decode without a frame
MAX_FRAMES = 39


def frames_of(samples: int) -> int:
    """The talker frames ``samples`` of code2wav's audio came from; fails if none match."""
    frames, rest = divmod(samples + TAIL, FRAME_SAMPLES)
    assert rest == 0, f"{samples} samples are not 1920 T - 555 for any whole T"
    return frames


@pytest.mark.vllm
@pytest.mark.slow
def test_serve_qwen3_omni_answers_a_chat_with_text_and_audio_in_the_voice_asked():
    import openai

    server = Server([MODEL, "--grace-period", "5", "--log-stats"])
    try:
        port = server.wait_for_port(timeout=600)
        kids = server.children()
        client = openai_client(port, 300)
        resp = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio={"voice": "chelsie", "format": "wav"},
        )
        audio = resp.choices[0].message.audio
        assert audio is not None and audio.transcript  # the thinker's text
        with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
            samples = w.getnframes()
        assert 1 <= frames_of(samples) <= MAX_FRAMES

        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio={"voice": "aiden", "format": "pcm16"},
            stream=True,
        )
        transcript, pcm = [], b""
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            got = getattr(delta, "audio", None)
            transcript.append(getattr(got, "transcript", None) or "")
            pcm += base64.b64decode(getattr(got, "data", None) or "")
        assert "".join(transcript)
        assert 1 <= frames_of(len(pcm) // 2) <= MAX_FRAMES  # 16-bit mono

        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
            )
        assert err.value.status_code == 400
        message = err.value.body["message"]  # type: ignore[index]
        assert "'alloy' is not a voice" in message
        assert "voices are ['aiden', 'chelsie', 'ethan']" in message

        text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert text.choices[0].message.content and text.choices[0].message.audio is None
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(engine_seconds(120))
    finally:
        server.kill()
    err_text, left = server.leftovers(kids)
    assert rc == 0, err_text[-3000:]
    assert "Traceback" not in err_text
    assert not left
    # three requests ran and finished (the 400 never reached the engine); none in flight
    out = "".join(iter_queue(server.lines))
    assert "engine: 3 requests: 3 finished, 0 aborted, 0 failed, 0 in flight" in out
