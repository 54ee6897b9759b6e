"""How a Qwen-Omni talker picks its codes: a request's sampling params (vLLM's names) as
:class:`TalkerSampling`, and the logits processors and the pick generate() uses for them.
Shared by the families' talkers (:mod:`~omni_trio.models.qwen_omni.talker`,
:mod:`~omni_trio.models.qwen_omni.qwen25_talker`). Pure but for the processors and the pick,
which run torch (blocking)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TalkerSampling", "logits_processors", "pick", "talker_sampling"]

#: transformers hard-codes these for the code predictor's sampling
_PREDICTOR_TOP_K = 50
_PREDICTOR_TOP_P = 0.8


@dataclass(frozen=True, slots=True)
class TalkerSampling:
    """How the talker picks codes. ``do_sample=False`` is greedy (the golden path);
    the defaults are generate()'s talker defaults."""

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    max_new_tokens: int = 4096
    seed: int | None = None


_SAMPLING_KEYS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "repetition_penalty": float,
    "max_tokens": int,
    "seed": int,
}


def talker_sampling(params: Mapping[str, object] | None) -> TalkerSampling:
    """A request's talker sampling from its stage sampling params (vLLM's names:
    ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``repetition_penalty``,
    ``max_tokens``, ``seed``). Pure. Raises ValueError naming a key of the wrong type or range;
    keys it does not use are ignored (a stage's defaults may carry vLLM-only ones)."""
    given: dict[str, Any] = {}
    for key, kind in _SAMPLING_KEYS.items():
        value = (params or {}).get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"talker sampling param {key} must be a number, got {value!r}")
        if kind is int and not float(value).is_integer():
            raise ValueError(f"talker sampling param {key} must be an integer, got {value!r}")
        given[key] = kind(value)
    if given.get("temperature", 1.0) < 0:
        raise ValueError(f"talker temperature must be >= 0, got {given['temperature']}")
    if given.get("max_tokens", 1) < 1:
        raise ValueError(f"talker max_tokens must be >= 1, got {given['max_tokens']}")
    if not 0 < given.get("top_p", 1.0) <= 1:
        raise ValueError(f"talker top_p must be in (0, 1], got {given['top_p']}")
    if given.get("repetition_penalty", 1.0) <= 0:
        raise ValueError(
            f"talker repetition_penalty must be > 0, got {given['repetition_penalty']}"
        )
    base = TalkerSampling()
    temperature = given.get("temperature", base.temperature)
    return TalkerSampling(
        do_sample=temperature > 0,
        top_k=given.get("top_k", base.top_k),
        top_p=given.get("top_p", base.top_p),
        temperature=temperature if temperature > 0 else 1.0,
        repetition_penalty=given.get("repetition_penalty", base.repetition_penalty),
        max_new_tokens=given.get("max_tokens", base.max_new_tokens),
        seed=given.get("seed"),
    )


def logits_processors(
    sampling: TalkerSampling, suppress: list[int] | None, device: str = "cpu"
) -> Any:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if suppress is not None:  # the talker's first codebook
        if sampling.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(penalty=sampling.repetition_penalty))
        procs.append(SuppressTokensLogitsProcessor(suppress, device=device))
        top_k, top_p, temperature = sampling.top_k, sampling.top_p, sampling.temperature
    else:  # the code predictor
        top_k, top_p, temperature = _PREDICTOR_TOP_K, _PREDICTOR_TOP_P, 1.0
    if sampling.do_sample:
        if temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if top_k:
            procs.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=top_p))
    return procs


def pick(scores: Any, sample: bool, gen: Any) -> Any:
    import torch

    if sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen)[:, 0]
    return scores.argmax(dim=-1)
