"""The ``diffusion`` backend: a denoising model (text to image) as a stage, stepped by the
engine one denoise step at a time, requests batched step by step, cancelled between steps.

Input: a text prompt (the entry prompt, or an upstream stage's text as its input processor
makes it). Sampling params (diffusers' pipeline-call names, see
:func:`~omni_trio.models.diffusion.contract.image_request`): ``num_inference_steps``,
``guidance_scale`` (> 1: classifier-free guidance against ``negative_prompt``), ``seed`` (the
same seed gives the same image, alone or in any batch, in either mode, up to float rounding),
``negative_prompt``, ``height``, ``width``, ``num_images_per_prompt``.

Output: the image as ``data``, a ``numpy.uint8`` array ``(num_images, height, width, 3)``
(pixels: a downstream stage computes on them, and encoding a file format is the edges'
job: the CLI and ``/v1/images/generations`` write PNG). With ``preview_every: N`` every N-th
step's latents are decoded and sent as a non-final output (``metrics``: ``preview`` true,
``step``); the last output is ``finished`` (``finish_reason`` ``"stop"``, ``metrics``:
``steps``, ``compute_s``).

Scheduling (:func:`~omni_trio.backends.diffusion.scheduling.plan_tick`): a ticker task owns
the replica's *waiting* and *running* requests; each tick admits requests (FIFO), prepares
them (prompt encoded, seeded latents, their own scheduler), runs one denoise step for a batch
of running requests that share a compatibility key (resolution, steps, guidance, output
count), decodes the finished ones and the previews due, and hands each request its outputs.
``execution: step`` lets new requests join at every tick; ``execution: request`` runs a batch
to its end before the next starts. At most ``max_batch_size`` requests run (hold latents);
the rest wait, holding nothing but their parameters. The model's calls run in a worker
thread one at a time (a model that says ``inline``, the scripted one, runs on trio's thread).

Cancellation (an abort, a cancelled request, the engine closing): a waiting request leaves
the queue and never runs; a running one leaves at the next step boundary and never runs
another step: when its step is running it finishes in its thread (a step cannot be
interrupted), the others of that step get their results (one that finished in that step
keeps its image), and its latents are dropped with it. Stopping the replica waits for the
running step, so no thread outlives it.

Errors: a request the model cannot take (bad sampling params, no text prompt) fails with
:class:`~omni_trio.errors.InvalidRequestError` naming the problem, that request only; a failure in a
step fails the requests of that step (they shared its forward), each with a StageError
naming the step; a failed prepare fails that request only.

``collective_rpc`` methods: ``describe`` (the model's description, the options, requests
running and waiting, ticks that ran a step, steps summed over requests, the largest batch,
images made).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ...config.options import DiffusionOptions, check_diffusion_options, parse_options
from ...config.stage import StageConfig
from ...errors import (
    BackendUnavailableError,
    InvalidRequestError,
    OmniTrioError,
    StageError,
)
from ...outputs import SamplingParams, StageOutput
from ...stages.backend import StageBackend
from ...stages.emit import Emit
from ...stages.input_stream import InputStream
from .scheduling import plan_tick

if TYPE_CHECKING:
    from ...models.diffusion.contract import DenoiseModel, ImageRequest

__all__ = ["DiffusionBackend"]

_INSTALL_HINT = "pip install 'omni-trio[diffusion]'"
#: a request's outbox carries ("preview", image, step), ("final", image, steps) or
#: ("error", exception, steps)
_Event = tuple[str, Any, int]


@dataclass(eq=False)
class _Job:
    """One request on this replica, from its arrival to its end."""

    request_id: str
    request: ImageRequest
    outbox: trio.MemorySendChannel[_Event]
    state: object = None  # the model's, from admission on
    abandoned: bool = False  # its request ended (cancelled, aborted): drop it
    stepping: bool = False  # in the step running now
    compute_s: float = 0.0
    steps: int = 0
    arrived: float = field(default_factory=time.perf_counter)


class DiffusionBackend(StageBackend):
    """One replica of a diffusion stage. See the module docstring."""

    backend_name = "diffusion"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        where = f"$.stages[{stage_index}].options"
        self.options: DiffusionOptions = parse_options(
            DiffusionOptions, config.options, where=where, backend="diffusion"
        )
        scripted = self.options.model == "scripted"
        needs = ("numpy",) if scripted else ("numpy", "torch", "diffusers")
        missing = [m for m in needs if m not in sys.modules and importlib.util.find_spec(m) is None]
        if missing:
            raise BackendUnavailableError(
                f"stage {config.id!r}: the diffusion backend needs {missing}; {_INSTALL_HINT}"
            )
        given = config.options if isinstance(config.options, Mapping) else {}
        check_diffusion_options(self.options, where, given)
        self._model: DenoiseModel | None = None
        self._lock = trio.Lock()  # the model's calls, one at a time
        self._waiting: list[_Job] = []
        self._running: list[_Job] = []
        self._arrived = trio.Event()
        self._steps = 0  # ticks that ran a step
        self._request_steps = 0  # denoise steps taken, summed over requests
        self._largest_batch = 0
        self._images = 0

    # -- the model -----------------------------------------------------------------------------
    async def _start(self) -> None:
        if self.options.model == "scripted":  # model-free: made on trio's thread
            await trio.lowlevel.checkpoint()
            self._model = self._load()
        else:
            self._model = await trio.to_thread.run_sync(self._load)
        self.mark_phase("model_loaded")

    def _load(self) -> DenoiseModel:
        if self.options.model == "scripted":
            from ...models.diffusion.scripted import ScriptedDenoise

            return ScriptedDenoise(fail_at_step=self.options.scripted_fail_at_step)
        from ...models.diffusion.diffusers_model import load_denoise_model

        model: DenoiseModel = load_denoise_model(self.options)
        return model

    async def _call(self, model: DenoiseModel, fn: Any, *args: Any) -> Any:
        """Run one model call (one at a time). Not abandoned on cancel: the replica's stop
        waits for the call, so no thread outlives the replica."""
        async with self._lock:
            if model.inline:
                await trio.sleep(self.options.scripted_step_s)
                return fn(*args)
            return await trio.to_thread.run_sync(fn, *args)

    async def _stop(self) -> None:
        self._model = None
        await trio.lowlevel.checkpoint()

    # -- the ticker ----------------------------------------------------------------------------
    async def _serve_forever(self) -> None:
        while True:
            tick = plan_tick(
                self.options.execution,
                [job.request.key for job in self._running],
                [job.request.key for job in self._waiting],
                self.options.max_batch_size,
            )
            if not tick.batch:
                self._arrived = trio.Event()
                await self._arrived.wait()
                continue
            admitted = [self._waiting[i] for i in tick.admit]
            for job in admitted:
                self._waiting.remove(job)
            self._running.extend(admitted)
            batch = [self._running[i] for i in tick.batch]
            await self._tick(admitted, batch)

    async def _tick(self, admitted: list[_Job], batch: list[_Job]) -> None:
        model = self._model
        assert model is not None
        for job in batch:
            job.stepping = True
        started = time.perf_counter()
        try:
            failed, done = await self._call(model, self._work, model, admitted, batch)
        except Exception as exc:
            for job in batch:
                self._fail(job, self._step_error(job, exc))
            return
        finally:
            for job in batch:
                job.stepping = False
                if job.abandoned:
                    job.state = None
            elapsed = time.perf_counter() - started
            for job in batch:
                job.compute_s += elapsed
        self._steps += 1
        self._request_steps += len(batch)
        self._largest_batch = max(self._largest_batch, len(batch))
        for job, error in failed:
            self._fail(job, self._prepare_error(job, error))
        for job, kind, image in done:
            if job.abandoned:
                continue
            if kind == "final":
                self._running.remove(job)  # not abandoned: still running
                job.state = None
                self._images += 1
            job.outbox.send_nowait((kind, image, job.steps))

    def _work(
        self, model: DenoiseModel, admitted: list[_Job], batch: list[_Job]
    ) -> tuple[list[tuple[_Job, BaseException]], list[tuple[_Job, str, Any]]]:
        """One tick's model calls (in the worker thread): prepare the admitted requests, one
        step for the batch, decode what is due."""
        failed: list[tuple[_Job, BaseException]] = []
        for job in admitted:
            try:
                job.state = model.prepare(job.request)
            except Exception as exc:  # that request fails, the others go on
                failed.append((job, exc))
        stepping = [job for job in batch if job.state is not None]
        if not stepping:
            return failed, []
        model.step([job.state for job in stepping])
        due: list[tuple[_Job, str]] = []
        every = self.options.preview_every
        for job in stepping:
            job.steps = model.steps_done(job.state)
            if job.steps >= job.request.num_inference_steps:
                due.append((job, "final"))
            elif every and job.steps % every == 0:
                due.append((job, "preview"))
        images = model.decode([job.state for job, _ in due]) if due else []
        return failed, [(job, kind, image) for (job, kind), image in zip(due, images, strict=True)]

    def _fail(self, job: _Job, exc: BaseException) -> None:
        if job in self._running:
            self._running.remove(job)
        job.state = None
        if not job.abandoned:
            job.outbox.send_nowait(("error", exc, job.steps))

    def _prepare_error(self, job: _Job, exc: BaseException) -> OmniTrioError:
        error: OmniTrioError
        if isinstance(exc, InvalidRequestError):  # what the model cannot take (its sizes)
            error = self._invalid(job.request_id, exc)
            error.__cause__ = exc
            return error
        error = StageError(
            f"stage {self.name}: request {job.request_id!r}: the model could not prepare "
            f"it: {type(exc).__name__}: {exc}",
            stage_id=self.stage_id,
            request_id=job.request_id,
        )
        error.__cause__ = exc
        return error

    def _step_error(self, job: _Job, exc: BaseException) -> StageError:
        error = StageError(
            f"stage {self.name}: request {job.request_id!r}: the denoise step "
            f"{job.steps + 1} failed: {type(exc).__name__}: {exc}",
            stage_id=self.stage_id,
            request_id=job.request_id,
        )
        error.__cause__ = exc
        return error

    # -- a request -----------------------------------------------------------------------------
    def _invalid(self, request_id: str, exc: Exception) -> InvalidRequestError:
        return InvalidRequestError(
            f"stage {self.name}: request {request_id!r}: invalid diffusion input: {exc}"
        )

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        from ...models.diffusion.contract import image_request

        model = self._model
        assert model is not None
        parts: list[str] = []
        async for chunk in inputs:
            if chunk.prompt is not None:
                parts.append(chunk.prompt)
            elif chunk.token_ids:
                raise self._invalid(
                    request_id,
                    ValueError("a diffusion stage takes a text prompt, not token ids"),
                )
        try:
            params = sampling_params if isinstance(sampling_params, Mapping) else None
            if params is None:
                raise ValueError(
                    "sampling params must be a mapping of diffusers' call arguments, not "
                    f"{type(sampling_params).__name__}"
                )
            request = image_request("".join(parts), params, default_size=model.default_size)
        except ValueError as exc:
            raise self._invalid(request_id, exc) from exc
        outbox, inbox = trio.open_memory_channel[_Event](math.inf)
        job = _Job(request_id, request, outbox)
        self._waiting.append(job)
        self._arrived.set()
        try:
            # closed with no checkpoint before `abandoned` is set below: else the ticker may
            # run in between and send to the closed inbox (BrokenResourceError kills it)
            with inbox:
                async for kind, payload, step in inbox:
                    if kind == "error":
                        raise payload
                    if kind == "preview":
                        await emit(
                            StageOutput(data=payload, metrics={"preview": True, "step": step})
                        )
                        continue
                    await emit(
                        StageOutput(
                            data=payload,
                            finished=True,
                            finish_reason="stop",
                            metrics={"steps": step, "compute_s": job.compute_s},
                        )
                    )
                    return
        finally:
            # it leaves now; in a running step, its latents go when the step ends
            job.abandoned = True
            if job in self._waiting:
                self._waiting.remove(job)
            if job in self._running:
                self._running.remove(job)
            if not job.stepping:
                job.state = None
            self._arrived.set()  # a request-mode batch may have room now

    async def _rpc(
        self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        if method == "describe":
            model = self._model
            assert model is not None
            return {
                **dict(model.describe()),
                "execution": self.options.execution,
                "max_batch_size": self.options.max_batch_size,
                "running": len(self._running),
                "waiting": len(self._waiting),
                "steps": self._steps,
                "request_steps": self._request_steps,
                "largest_batch": self._largest_batch,
                "images": self._images,
            }
        return await super()._rpc(method, args, kwargs)

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        return (
            f"{base} running={len(self._running)} waiting={len(self._waiting)} "
            f"steps={self._steps} images={self._images}>"
        )
