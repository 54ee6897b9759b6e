"""The ``talker`` backend: a Qwen-Omni talker (:mod:`omni_trio.models.qwen_omni.talker`) as
a stage, streaming codec frames as they are decoded.

Input: the thinker's prompt and reply token ids, as
:func:`omni_trio.models.qwen_omni.handoff.thinker_to_talker` builds them from the thinker's
finished output (``token_ids`` = the reply, ``data = {"prompt_token_ids": [...]}``). The stage
waits for that finished input (the talker's prompt holds the whole assistant turn's first
rows and one reply row per step; a talker fed while the thinker still runs is not this one).

Output: one :class:`~omni_trio.outputs.StageOutput` per decode step, ``token_ids`` = that
step's frame (Qwen3-Omni: 16 codes, code group 0 then the 15 residual codes; Qwen2.5-Omni:
one code), so a ``torch`` code2wav stage with ``stream_input: true`` decodes audio while the
talker runs (Qwen2.5-Omni's token2wav takes the whole utterance instead). The last output is
``finished`` with ``finish_reason`` ``"stop"`` (the codec EOS) or ``"length"``
(``max_tokens``) and ``metrics`` ``{frames, compute_s}``. A reply shorter than 2 tokens has
nothing to say: the request finishes at once with no frame (transformers' generate() raises
there).

Sampling params (the talker stage's, vLLM names): ``temperature`` (0: greedy), ``top_k``,
``top_p``, ``repetition_penalty``, ``max_tokens``, ``seed`` (a per-request generator: the
same seed gives the same codes), and ``speaker`` (a voice of the checkpoint; default
``options.speaker``). Options: :class:`~omni_trio.config.options.TalkerOptions`.

Decoding is batched step by step (continuous batching): every request that wants its next
frame waits in a FIFO; whenever a worker slot is free (``max_concurrency``, a
``trio.CapacityLimiter``) a batcher task takes up to ``max_batch_size`` of them as one decode
step in a worker thread (:func:`~omni_trio.models.qwen_omni.talker.decode_step`): the talker's
forward per request (their KV caches differ in length), then the code predictor, 15 forwards,
for all of them at once. Requests join at the next step and leave when they finish; none
waits for another to finish. A request's codes do not depend on its batch (its own sampling
and generator), up to float rounding.

Cancellation (an abort, a cancelled request, the engine closing): the request stops at once.
One waiting for a step leaves the queue and never runs; one whose step is running gets
nothing further: the step ends in its thread (it cannot be interrupted; at most one step),
the others in it get their frames, and its state is dropped with the step. Stopping the
replica waits for the running step, so no thread outlives it.

Errors: a request whose input is not what the talker takes (no prompt ids, no assistant
turn, a token outside the vocabulary, an unknown speaker, bad sampling params) fails with a
:class:`~omni_trio.errors.StageError` naming the problem, that request only; a failure inside
a step fails the requests of that step (they shared its forward), each with a StageError
naming the step. A checkpoint the talker cannot run fails the replica's start
(:class:`~omni_trio.errors.ConfigError`).

``collective_rpc`` methods: ``describe`` (model, family, speakers, parameters, requests
decoding now, frames decoded so far), ``speakers``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ...config.options import TalkerOptions, parse_options
from ...config.stage import StageConfig
from ...errors import BackendUnavailableError, StageError
from ...outputs import SamplingParams, StageInput, StageOutput
from ...stages.backend import StageBackend
from ...stages.emit import Emit
from ...stages.input_stream import InputStream

if TYPE_CHECKING:
    from ...models.qwen_omni.talker import Talker

__all__ = ["TalkerBackend", "talker_request"]

_INSTALL_HINT = "pip install 'omni-trio[torch]' and transformers"


def talker_request(
    chunk: StageInput, sampling_params: SamplingParams, default_speaker: str
) -> tuple[list[int], list[int], str, Mapping[str, object]]:
    """(prompt ids, reply ids, speaker, sampling mapping) of a talker request's input. Pure.
    Raises ValueError naming what is missing or ill-typed."""
    data = chunk.data
    if not isinstance(data, Mapping) or "prompt_token_ids" not in data:
        raise ValueError(
            "a talker takes the thinker's reply as token_ids and its prompt as "
            "data={'prompt_token_ids': [...]} (input_processor "
            "omni_trio.models.qwen_omni.handoff:thinker_to_talker)"
        )
    prompt = data["prompt_token_ids"]
    if not isinstance(prompt, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise ValueError(f"prompt_token_ids must be a list of ints, got {type(prompt).__name__}")
    params: Mapping[str, object] = sampling_params if isinstance(sampling_params, Mapping) else {}
    speaker = params.get("speaker", default_speaker)
    if not isinstance(speaker, str):
        raise ValueError(f"speaker must be a string, got {speaker!r}")
    return list(prompt), list(chunk.token_ids), speaker, params


@dataclass(eq=False)
class _Step:
    """One request waiting for (or in) a decode step."""

    state: object
    done: trio.Event = field(default_factory=trio.Event)
    result: list[int] | str | None = None
    error: BaseException | None = None
    abandoned: bool = False


class TalkerBackend(StageBackend):
    """One replica of a talker stage. See the module docstring."""

    backend_name = "talker"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
            raise BackendUnavailableError(
                f"stage {config.id!r}: the talker backend needs torch; {_INSTALL_HINT}"
            )
        self.options: TalkerOptions = parse_options(
            TalkerOptions,
            config.options,
            where=f"$.stages[{stage_index}].options",
            backend="talker",
        )
        self._model: Talker | None = None
        self._limiter = trio.CapacityLimiter(self.options.max_concurrency)
        self._pending: list[_Step] = []
        self._arrived = trio.Event()
        self._decoding = 0
        self._frames = 0
        self._steps = 0
        self._largest_step = 0
        self._steps_s = 0.0

    async def _start(self) -> None:
        self._model = await trio.to_thread.run_sync(self._load)
        self.mark_phase("model_loaded")

    def _load(self) -> Talker:
        from ...models.qwen_omni.talker import load_talker
        from ...models.tiny import resolve_model

        if self.options.torch_threads is not None:
            import torch

            torch.set_num_threads(self.options.torch_threads)
        return load_talker(
            resolve_model(self.options.model), self.options.dtype, self.options.device
        )

    async def _serve_forever(self) -> None:
        async with trio.open_nursery() as nursery:
            await self._batcher(nursery)

    async def _batcher(self, nursery: trio.Nursery) -> None:
        while True:
            while not self._pending:
                self._arrived = trio.Event()
                await self._arrived.wait()
            token = object()
            # hold a worker slot first: while every slot is busy, requests gather for the
            # next step, which then decodes them together
            await self._limiter.acquire_on_behalf_of(token)
            if not self._pending:  # the waiting requests were cancelled meanwhile
                self._limiter.release_on_behalf_of(token)
                continue
            size = self.options.max_batch_size
            batch, self._pending = self._pending[:size], self._pending[size:]
            nursery.start_soon(self._run_step, batch, token)

    async def _run_step(self, batch: list[_Step], token: object) -> None:
        model = self._model
        assert model is not None
        started = time.perf_counter()
        try:
            # not abandoned on cancel: the replica's stop waits for the step to end, so no
            # thread outlives the replica
            results = await trio.to_thread.run_sync(model.step, [s.state for s in batch])
        except Exception as exc:
            for step in batch:
                step.error = exc
                step.done.set()
            return
        finally:
            self._limiter.release_on_behalf_of(token)
            self._steps += 1
            self._largest_step = max(self._largest_step, len(batch))
            self._steps_s += time.perf_counter() - started
        for step, result in zip(batch, results, strict=True):
            step.result = result
            step.done.set()

    async def _next(self, state: object) -> list[int] | str:
        step = _Step(state)
        self._pending.append(step)
        self._arrived.set()
        try:
            await step.done.wait()
        finally:
            if not step.done.is_set():
                step.abandoned = True
                if step in self._pending:
                    self._pending.remove(step)  # never runs
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    async def _stop(self) -> None:
        self._model = None
        await trio.lowlevel.checkpoint()

    def _invalid(self, request_id: str, exc: Exception) -> StageError:
        return StageError(
            f"stage {self.name}: request {request_id!r}: invalid talker input: {exc}",
            stage_id=self.stage_id,
            request_id=request_id,
        )

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        from ...models.qwen_omni.talker import talker_sampling

        model = self._model
        assert model is not None
        chunk = None
        async for received in inputs:
            chunk = received  # the finished thinker output: one chunk
        if chunk is None:
            raise self._invalid(request_id, ValueError("no input arrived"))
        try:
            prompt, reply, speaker, params = talker_request(
                chunk, sampling_params, self.options.speaker
            )
            sampling = talker_sampling(params)
            prepared = await trio.to_thread.run_sync(
                model.prepare, prompt, reply, speaker, limiter=self._limiter
            )
        except ValueError as exc:
            raise self._invalid(request_id, exc) from exc
        if prepared is None:
            await emit(StageOutput(finished=True, finish_reason="stop", metrics={"frames": 0}))
            return
        await self._decode(request_id, model.start(prepared, sampling), emit)

    async def _decode(self, request_id: str, state: object, emit: Emit) -> None:
        n = 0
        compute_s = 0.0
        self._decoding += 1
        try:
            while True:
                started = time.perf_counter()
                try:
                    frame = await self._next(state)
                except Exception as exc:
                    raise StageError(
                        f"stage {self.name}: request {request_id!r}: the talker failed at "
                        f"step {n}: {type(exc).__name__}: {exc}",
                        stage_id=self.stage_id,
                        request_id=request_id,
                    ) from exc
                compute_s += time.perf_counter() - started
                if isinstance(frame, str):
                    reason = frame
                    break
                n += 1
                self._frames += 1
                await emit(StageOutput(token_ids=tuple(frame)))
        finally:
            self._decoding -= 1
        await emit(
            StageOutput(
                finished=True,
                finish_reason=reason,
                metrics={"frames": n, "compute_s": compute_s},
            )
        )

    async def _rpc(
        self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        model = self._model
        assert model is not None
        if method == "speakers":
            return list(model.speakers)
        if method == "describe":
            return {
                "model": self.options.model,
                "family": model.family,
                "device": model.device,
                "speakers": list(model.speakers),
                "num_parameters": model.num_parameters(),
                "codes_per_frame": model.codes_per_frame,
                "decoding": self._decoding,
                "frames": self._frames,
                "steps": self._steps,
                "largest_step": self._largest_step,
                "steps_s": self._steps_s,
            }
        return await super()._rpc(method, args, kwargs)

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        return (
            f"{base} decoding={self._decoding} waiting={len(self._pending)} "
            f"frames={self._frames} steps={self._steps}>"
        )
