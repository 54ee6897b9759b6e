"""The service levels of an audio stream, as a listener hears it: pure functions and one
small accumulator (:class:`AudioStream`), fed the times the packets came.

- **time to first audio packet**: from the request's admission to the first output of an
  audio stage that carries samples;
- **audio seconds**: what the packets carry (samples / sample rate);
- **underruns**: a packet that came later after the one before than that one's audio lasts
  (``gap > previous packet's seconds``): a player that started on the first packet ran dry;
- **real-time factor**: the seconds from admission to the last packet over the audio
  seconds produced; below 1 the stream is made faster than it plays.

Nothing here checkpoints or imports numpy or torch (their arrays are read by attribute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AudioStream", "audio_samples", "is_underrun", "real_time_factor"]


def audio_samples(data: object) -> int:
    """How many samples an audio stage's output carries: a numpy array's or torch tensor's
    element count, a flat sequence's length (nested ones summed), 0 for ``None``, bytes,
    text or anything else. Pure."""
    if data is None or isinstance(data, (str, bytes, bytearray)):
        return 0
    numel = getattr(data, "numel", None)
    if callable(numel):  # a torch tensor
        return int(numel())
    size = getattr(data, "size", None)
    if isinstance(size, int):  # a numpy array
        return size
    if isinstance(data, Sequence):
        if data and isinstance(data[0], (int, float)):
            return len(data)
        return sum(audio_samples(item) for item in data)
    return 0


def is_underrun(gap_s: float, previous_packet_s: float) -> bool:
    """Whether a packet that came ``gap_s`` seconds after the previous one, which carried
    ``previous_packet_s`` seconds of audio, is an underrun. Pure."""
    return gap_s > previous_packet_s


def real_time_factor(admitted: float, last_packet: float, audio_s: float) -> float | None:
    """Seconds from admission to the last packet per second of audio produced; ``None``
    without audio. Pure."""
    if audio_s <= 0:
        return None
    return max(0.0, last_packet - admitted) / audio_s


@dataclass(slots=True)
class AudioStream:
    """One request's stream from one audio stage: fed each packet's arrival and length."""

    admitted: float
    first_packet: float | None = None
    last_packet: float | None = None
    last_packet_s: float = 0.0
    audio_s: float = 0.0
    packets: int = 0
    underruns: int = 0

    def add(self, t: float, seconds: float) -> bool:
        """A packet of ``seconds`` of audio came at ``t``; whether it is an underrun.
        A packet without samples is not a packet."""
        if seconds <= 0:
            return False
        underrun = False
        if self.last_packet is None:
            self.first_packet = t
        else:
            underrun = is_underrun(t - self.last_packet, self.last_packet_s)
            self.underruns += underrun
        self.last_packet, self.last_packet_s = t, seconds
        self.audio_s += seconds
        self.packets += 1
        return underrun

    @property
    def time_to_first_packet(self) -> float | None:
        return None if self.first_packet is None else self.first_packet - self.admitted

    @property
    def real_time_factor(self) -> float | None:
        if self.last_packet is None:
            return None
        return real_time_factor(self.admitted, self.last_packet, self.audio_s)
