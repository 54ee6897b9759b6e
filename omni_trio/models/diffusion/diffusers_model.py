"""A :class:`~omni_trio.models.diffusion.contract.DenoiseModel` on a diffusers text-to-image
pipeline: the pipeline's own parts (tokenizer and text encoder, UNet, VAE, scheduler) driven
one denoise step at a time, so the ``diffusion`` backend can batch requests by step and stop
one between steps.

A request's result is the one diffusers' own pipeline call gives for the same prompt, seed
(``generator=torch.Generator().manual_seed(seed)``), steps, guidance and size (up to float
rounding when requests share a forward): the prompt is encoded by the pipeline's
``encode_prompt``, the initial latents are drawn as its ``prepare_latents`` draws them, and
each request has its own copy of the scheduler, so requests at different step indices share
one UNet forward (a timestep per row) and each advances its own scheduler.

Pipelines taken: a UNet (``UNet2DConditionModel``) denoiser conditioned on text alone (Stable
Diffusion 1.x/2.x and their fine-tunes), a VAE, a text encoder and tokenizer, a scheduler.
Others (a DiT ``transformer``, SDXL's added conditions, guidance-distilled UNets) are refused
at load, naming what is missing.

Everything here blocks; torch and diffusers are imported when called.
"""

from __future__ import annotations

import importlib.util
import inspect
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import ConfigError, InvalidRequestError
from .contract import ImageRequest
from .tiny import import_diffusers

if TYPE_CHECKING:
    import numpy
    import torch

__all__ = [
    "DiffusersModel",
    "DiffusersState",
    "DiffusionSettings",
    "load_denoise_model",
]


class DiffusionSettings(Protocol):
    """What :func:`load_denoise_model` reads of a diffusion stage's options
    (``omni_trio.config.options.DiffusionOptions`` has these fields)."""

    @property
    def model(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def torch_threads(self) -> int | None: ...
    @property
    def enable_model_cpu_offload(self) -> bool: ...
    @property
    def enable_sequential_cpu_offload(self) -> bool: ...
    @property
    def enable_attention_slicing(self) -> bool: ...
    @property
    def enable_vae_slicing(self) -> bool: ...
    @property
    def enable_vae_tiling(self) -> bool: ...


def _check_accelerate(options: DiffusionSettings, where: str) -> None:
    # the rest of the options is checked at config load
    # (omni_trio.config.options.check_diffusion_options)
    for name in ("enable_model_cpu_offload", "enable_sequential_cpu_offload"):
        if getattr(options, name) and importlib.util.find_spec("accelerate") is None:
            raise ConfigError(
                "diffusers' CPU offload needs accelerate installed", path=f"{where}.{name}"
            )


def load_denoise_model(options: DiffusionSettings, *, where: str = "$") -> DiffusersModel:
    """Load the diffusers pipeline ``options.model`` names (a pipeline directory, or the
    ``tiny:diffusion`` preset, built first if not cached) in ``options.dtype`` on
    ``options.device``, apply ``torch_threads`` (process-wide) and the offload, slicing and
    tiling flags, and wrap it. ``where`` is the options' path in the config (errors name
    ``<where>.<option>``). Blocking (seconds; a first ``tiny:diffusion`` build too). Raises
    :class:`ConfigError` for a directory that is no pipeline, a pipeline this model cannot
    step, or a flag the pipeline does not support; :class:`BackendUnavailableError` without
    diffusers."""
    import torch

    from ..tiny import resolve_model

    _check_accelerate(options, where)
    diffusers = import_diffusers("the diffusion backend")
    if options.torch_threads is not None:
        torch.set_num_threads(options.torch_threads)
    path = resolve_model(options.model)
    if not (Path(path) / "model_index.json").is_file():
        raise ConfigError(
            f"{path!r} is not a diffusers pipeline directory (no model_index.json)",
            path=f"{where}.model",
        )
    try:
        with _quiet_loading(diffusers):
            pipe = diffusers.DiffusionPipeline.from_pretrained(
                path,
                dtype=getattr(torch, options.dtype),
                # without accelerate, the default (True) only logs that it falls back
                low_cpu_mem_usage=importlib.util.find_spec("accelerate") is not None,
            )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"diffusers cannot load {path!r}: {exc}", path=f"{where}.model") from exc
    model = DiffusersModel(pipe, source=path, config_path=f"{where}.model")
    _apply_flags(pipe, options, where)
    return model


@contextmanager
def _quiet_loading(diffusers: Any) -> Iterator[None]:
    """diffusers' and transformers' loading bars off (they would cut into the caller's
    progress display), restored after."""
    transformers: Any = import_module("transformers")
    loggers = [lib.utils.logging for lib in (diffusers, transformers)]
    shown = [log.is_progress_bar_enabled() for log in loggers]
    for log in loggers:
        log.disable_progress_bar()
    try:
        yield
    finally:
        for log, was in zip(loggers, shown, strict=True):
            if was:
                log.enable_progress_bar()


def _apply_flags(pipe: Any, options: DiffusionSettings, where: str) -> None:
    """Place the pipeline (an offload or ``device``) and turn on the memory flags it
    supports; a flag it does not support is a :class:`ConfigError`."""

    def call(owner: Any, method: str, option: str, **kwargs: object) -> None:
        if not callable(getattr(owner, method, None)):
            raise ConfigError(
                f"{type(owner).__name__} has no {method}(); this pipeline does not support "
                "the option",
                path=f"{where}.{option}",
            )
        getattr(owner, method)(**kwargs)

    if options.enable_model_cpu_offload:
        call(pipe, "enable_model_cpu_offload", "enable_model_cpu_offload", device=options.device)
    elif options.enable_sequential_cpu_offload:
        call(
            pipe,
            "enable_sequential_cpu_offload",
            "enable_sequential_cpu_offload",
            device=options.device,
        )
    else:
        try:
            pipe.to(options.device)
        except (RuntimeError, ValueError) as exc:  # torch's words for a device it lacks
            raise ConfigError(
                f"the pipeline cannot move to device {options.device!r}: {exc}",
                path=f"{where}.device",
            ) from exc
    if options.enable_attention_slicing:
        call(pipe, "enable_attention_slicing", "enable_attention_slicing")
    if options.enable_vae_slicing:
        call(pipe.vae, "enable_slicing", "enable_vae_slicing")
    if options.enable_vae_tiling:
        call(pipe.vae, "enable_tiling", "enable_vae_tiling")


@dataclass(eq=False, slots=True)
class DiffusersState:
    """One request being denoised: its prompt embeddings (the negative ones first under
    classifier-free guidance), latents, own scheduler and the step it is at."""

    request: ImageRequest
    seed: int
    scheduler: Any
    timesteps: list[torch.Tensor]
    embeds: torch.Tensor
    latents: torch.Tensor
    guided: bool
    step_kwargs: dict[str, object] = field(default_factory=dict)
    done: int = 0

    def __repr__(self) -> str:
        r = self.request
        return (
            f"<DiffusersState {r.height}x{r.width} seed={self.seed} "
            f"step {self.done}/{len(self.timesteps)}>"
        )


class DiffusersModel:
    """A diffusers text-to-image pipeline stepped one denoise step at a time (see the
    module's docstring). Build it with :func:`load_denoise_model`, or around a loaded
    pipeline. Its methods block and must not run concurrently (the contract's rule)."""

    inline = False

    def __init__(self, pipe: Any, *, source: str = "", config_path: str = "$") -> None:
        """Wrap ``pipe`` (loaded from ``source``). Raises :class:`ConfigError` (at
        ``config_path``) naming what the pipeline lacks for this model to step it."""
        _check_pipeline(pipe, source, config_path)
        self._pipe = pipe
        self._execution_device: torch.device | None = None  # asked of diffusers once
        self._source = source
        unet_config = pipe.unet.config
        self._vae_scale = int(
            getattr(pipe, "vae_scale_factor", 0)
            or 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        )
        size = unet_config.sample_size
        h, w = (size, size) if isinstance(size, int) else (size[0], size[1])
        self.default_size: tuple[int, int] = (h * self._vae_scale, w * self._vae_scale)
        accepted = set(inspect.signature(pipe.scheduler.step).parameters)
        self._takes_eta = "eta" in accepted
        self._takes_generator = "generator" in accepted
        self._forwards = 0
        self._rows = 0
        self._decoded = 0

    def __repr__(self) -> str:
        h, w = self.default_size
        return (
            f"<DiffusersModel {type(self._pipe).__name__} {self._source!r} {h}x{w} "
            f"forwards={self._forwards} rows={self._rows} decoded={self._decoded}>"
        )

    @property
    def pipeline(self) -> Any:
        """The wrapped diffusers pipeline."""
        return self._pipe

    def _device(self) -> torch.device:
        # under a CPU offload, the accelerator the hooks move each part to; asked once (the
        # pipeline is placed before this model is made) since diffusers walks every module's
        # hooks to answer (milliseconds a request)
        device = self._execution_device
        if device is None:
            device = getattr(self._pipe, "_execution_device", self._pipe.device)
            self._execution_device = device
        return device

    def prepare(self, request: ImageRequest) -> DiffusersState:
        """A new state for ``request``: the prompt (and under guidance the negative prompt)
        encoded, the latents drawn from ``torch.Generator().manual_seed(seed)`` (a random
        seed when the request has none) as the pipeline draws them, a copy of the
        pipeline's scheduler set to the request's steps. Raises
        :class:`InvalidRequestError` for a size that is not a multiple of the VAE's scale
        factor or more steps than the scheduler was trained with."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        self._check_request(request)
        pipe = self._pipe
        device = self._device()
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        scheduler.set_timesteps(request.num_inference_steps, device=device)
        guided = request.guidance_scale > 1
        n = request.num_images
        with torch.inference_mode():
            positive, negative = self._encode(request, device, guided)
            embeds = torch.cat([negative, positive]) if guided else positive
            shape = (
                n,
                pipe.unet.config.in_channels,
                request.height // self._vae_scale,
                request.width // self._vae_scale,
            )
            latents = randn_tensor(shape, generator=generator, device=device, dtype=embeds.dtype)
            latents = latents * scheduler.init_noise_sigma
        step_kwargs: dict[str, object] = {}
        if self._takes_eta:
            step_kwargs["eta"] = 0.0
        if self._takes_generator:
            # the stream the latents came from, as the pipeline passes it on
            step_kwargs["generator"] = generator
        return DiffusersState(
            request=request,
            seed=seed,
            scheduler=scheduler,
            timesteps=list(scheduler.timesteps),
            embeds=embeds,
            latents=latents,
            guided=guided,
            step_kwargs=step_kwargs,
        )

    def _check_request(self, request: ImageRequest) -> None:
        scale = self._vae_scale
        if request.height % scale or request.width % scale:
            raise InvalidRequestError(
                f"height and width must be multiples of {scale} (the VAE's scale factor), not "
                f"{request.height}x{request.width}"
            )
        trained = int(self._pipe.scheduler.config.num_train_timesteps)
        if request.num_inference_steps > trained:
            raise InvalidRequestError(
                f"num_inference_steps must be at most {trained} (the scheduler's "
                f"num_train_timesteps), not {request.num_inference_steps}"
            )

    def _encode(
        self, request: ImageRequest, device: torch.device, guided: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt embeddings, negative ones: empty unless ``guided``), one row per image."""
        pipe = self._pipe
        if callable(getattr(pipe, "encode_prompt", None)):
            positive, negative = pipe.encode_prompt(
                prompt=request.prompt,
                device=device,
                num_images_per_prompt=request.num_images,
                do_classifier_free_guidance=guided,
                negative_prompt=request.negative_prompt,
            )
            return positive, negative if guided else positive[:0]
        positive = encode_text(pipe, request.prompt, device).repeat(request.num_images, 1, 1)
        if not guided:
            return positive, positive[:0]
        negative = encode_text(pipe, request.negative_prompt or "", device)
        return positive, negative.repeat(request.num_images, 1, 1)

    def step(self, states: Sequence[DiffusersState]) -> None:
        """Advance each state by one denoise step: one UNet forward over every state's rows
        (unconditional and conditional under guidance), each row at its own state's
        timestep, then each state's own scheduler step. Raises ValueError for a state
        with no steps left or states of different sizes."""
        import torch

        if not states:
            return
        shapes = {tuple(s.latents.shape[1:]) for s in states}
        if len(shapes) > 1:
            raise ValueError(f"states of different latent shapes {sorted(shapes)} in one step")
        for s in states:
            if s.done >= len(s.timesteps):
                raise ValueError(f"{s!r} has no denoise step left")
        with torch.inference_mode():
            inputs, timesteps = [], []
            for s in states:
                t = s.timesteps[s.done]
                x = torch.cat([s.latents] * 2) if s.guided else s.latents
                if hasattr(s.scheduler, "scale_model_input"):
                    x = s.scheduler.scale_model_input(x, t)
                inputs.append(x)
                timesteps.append(t.reshape(1).expand(x.shape[0]))
            noise = self._pipe.unet(
                torch.cat(inputs),
                torch.cat(timesteps),
                encoder_hidden_states=torch.cat([s.embeds for s in states]),
                return_dict=False,
            )[0]
            row = 0
            for s, x in zip(states, inputs, strict=True):
                pred = noise[row : row + x.shape[0]]
                row += x.shape[0]
                if s.guided:
                    uncond, cond = pred.chunk(2)
                    pred = uncond + s.request.guidance_scale * (cond - uncond)
                t = s.timesteps[s.done]
                s.latents = s.scheduler.step(
                    pred, t, s.latents, **s.step_kwargs, return_dict=False
                )[0]
                s.done += 1
        self._forwards += 1
        self._rows += row

    def steps_done(self, state: DiffusersState) -> int:
        """How many denoise steps ``state`` has taken."""
        return state.done

    def decode(self, states: Sequence[DiffusersState]) -> list[numpy.ndarray]:
        """Each state's latents through the VAE, as ``numpy.uint8`` arrays
        ``(num_images, height, width, 3)`` (rounded as diffusers rounds to PIL). States of
        one size are decoded in one VAE call."""
        import torch

        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(tuple(s.latents.shape[1:]), []).append(i)
        out: list[Any] = [None] * len(states)
        vae = self._pipe.vae
        with torch.inference_mode():
            for members in groups.values():
                latents = torch.cat([states[i].latents for i in members])
                image = vae.decode(
                    latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False
                )[0]
                pixels = _to_uint8(self._pipe, image)
                row = 0
                for i in members:
                    n = states[i].latents.shape[0]
                    out[i] = pixels[row : row + n]
                    row += n
        self._decoded += len(states)
        return out

    def describe(self) -> Mapping[str, object]:
        """The pipeline's class, parts, default size, dtype and device."""
        pipe = self._pipe

        def params(module: Any) -> int:
            return sum(p.numel() for p in module.parameters())

        return {
            "backend": "diffusers",
            "model": self._source,
            "pipeline": type(pipe).__name__,
            "denoiser": type(pipe.unet).__name__,
            "scheduler": type(pipe.scheduler).__name__,
            "default_size": list(self.default_size),
            "vae_scale_factor": self._vae_scale,
            "dtype": str(pipe.unet.dtype).removeprefix("torch."),
            "device": str(self._device()),
            "parameters": {
                name: params(getattr(pipe, name)) for name in ("unet", "vae", "text_encoder")
            },
        }


def encode_text(pipe: Any, text: str, device: torch.device) -> torch.Tensor:
    """``text``'s last hidden states from the pipeline's text encoder, padded to the
    tokenizer's length (what ``encode_prompt`` computes for a pipeline that lacks it)."""
    ids = pipe.tokenizer(
        text,
        padding="max_length",
        max_length=pipe.tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    hidden: torch.Tensor = pipe.text_encoder(ids.to(device))[0]
    return hidden.to(device=device, dtype=pipe.text_encoder.dtype)


def _to_uint8(pipe: Any, image: torch.Tensor) -> numpy.ndarray:
    """VAE output ``(N, 3, H, W)`` in [-1, 1] -> ``uint8 (N, H, W, 3)``, rounding as
    diffusers' ``numpy_to_pil`` does."""
    import torch

    processor = getattr(pipe, "image_processor", None)
    if processor is not None:
        image = processor.postprocess(image, output_type="pt")
    else:
        image = (image / 2 + 0.5).clamp(0, 1)
    pixels: numpy.ndarray = (
        (image.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    )
    return pixels


def _check_pipeline(pipe: Any, source: str, config_path: str) -> None:
    """ConfigError naming what ``pipe`` lacks to be stepped here."""
    name = f"{source or type(pipe).__name__}"
    missing = [
        part
        for part in ("tokenizer", "text_encoder", "unet", "vae", "scheduler")
        if getattr(pipe, part, None) is None
    ]
    if missing:
        denoiser = getattr(pipe, "transformer", None)
        hint = (
            f"; its denoiser is a {type(denoiser).__name__} (transformer), and only UNet "
            "pipelines are stepped so far"
            if "unet" in missing and denoiser is not None
            else ""
        )
        raise ConfigError(
            f"{name}: a {type(pipe).__name__} without {missing}; the diffusion model needs a "
            f"text-to-image pipeline with a tokenizer, text_encoder, unet, vae and "
            f"scheduler{hint}",
            path=config_path,
        )
    config = pipe.unet.config
    for key, why in (
        ("addition_embed_type", "added conditions (SDXL's text_time)"),
        ("class_embed_type", "class labels"),
        ("encoder_hid_dim_type", "projected image or text conditions"),
        ("time_cond_proj_dim", "a guidance embedding (guidance-distilled)"),
    ):
        if getattr(config, key, None) is not None:
            raise ConfigError(
                f"{name}: its UNet takes {why} ({key}={getattr(config, key)!r}), which the "
                "diffusion model does not prepare; it steps UNets conditioned on text alone",
                path=config_path,
            )
    for part, method in (("vae", "decode"), ("scheduler", "set_timesteps"), ("scheduler", "step")):
        if not callable(getattr(getattr(pipe, part), method, None)):
            raise ConfigError(f"{name}: its {part} has no {method}()", path=config_path)
