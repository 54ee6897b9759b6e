"""The built-in backends' options, declared as msgspec Structs, and how a stage's options are
read.

A stage's ``options:`` mapping is converted with its backend's Struct when the config is
loaded, so an unknown or ill-typed option is a :class:`~omni_trio.errors.ConfigError` naming
``$.stages[i].options.<key>`` and the file, before any engine starts. Backends read their
typed options with :func:`parse_options` (the config keeps the mapping as written).

A user backend (``backend: "package.module:Factory"``) declares its options the same way: give
the factory an ``Options`` class attribute that is a ``msgspec.Struct`` type (it is then
checked at load; without one, ``options`` is passed through unchecked). A torch factory may do
the same for the options the torch backend hands on to it.

Which Struct a built-in backend's options are checked with is in its registry entry
(:data:`omni_trio.config.backends.BUILTIN_BACKENDS`); the checks run at load
(:func:`omni_trio.config.checks.check_stage`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from ..errors import ConfigError
from .dotted import DOTTED_PATTERN, is_dotted
from .reading import explain_validation_error

__all__ = [
    "DEFAULT_RECORD",
    "DEFAULT_TORCH_FACTORY",
    "DiffusionOptions",
    "check_diffusion_options",
    "ScriptedOptions",
    "TalkerOptions",
    "TorchOptions",
    "VllmLoop",
    "VllmOptions",
    "options_type_of",
    "parse_options",
    "parse_torch_options",
    "split_torch_options",
]

#: the event loop a vllm replica's worker thread runs (the loop host's kinds,
#: :data:`omni_trio.transport.loop_host.LoopKind`: a test keeps the two equal)
VllmLoop = Literal["asyncio", "trio-asyncio"]
#: how many request ids / inputs a scripted replica remembers by default (``record``)
DEFAULT_RECORD = 10_000
DEFAULT_TORCH_FACTORY = "omni_trio.models.vocoder:build_vocoder"
#: stage-level keys that older configs wrote inside ``options``
_MOVED_TO_STAGE = ("shutdown_timeout",)


class ScriptedOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``scripted`` backend (see :mod:`omni_trio.backends.scripted`)."""

    outputs: Annotated[int, Meta(ge=1, description="outputs per request; the last is finished")] = 8
    latency_s: Annotated[float, Meta(ge=0, description="trio-clock seconds before each output")] = (
        0.0
    )
    fail_at_output: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        Meta(description="raise a request-scoped StageError at this output"),
    ] = None
    crash_at_request: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="the replica dies at its n-th request (1-based)"),
    ] = None
    crash_replica: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        Meta(description="only this replica crashes (default: every one)"),
    ] = None
    hang: Annotated[bool, Meta(description="requests never produce an output")] = False
    start_delay_s: Annotated[
        float, Meta(ge=0, description="trio-clock seconds before the replica is ready")
    ] = 0.0
    fail_start: Annotated[bool, Meta(description="start-up raises")] = False
    stop_delay_s: Annotated[float, Meta(ge=0, description="trio-clock seconds to stop")] = 0.0
    abort_delay_s: Annotated[
        float,
        Meta(ge=0, description="trio-clock seconds a request's abort cleanup takes (shielded)"),
    ] = 0.0
    token_offset: Annotated[int, Meta(description="added to every token id per hop")] = 1
    omit_kv_params_at_request: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="a prefill stage's n-th request (1-based) finishes without "
            "kv_transfer_params (a connector that returned none)"
        ),
    ] = None
    malformed_kv_params_at_request: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="a prefill stage's n-th request (1-based) finishes with "
            "kv_transfer_params that are not a mapping"
        ),
    ] = None
    require_kv_params: Annotated[
        bool,
        Meta(
            description="a request whose sampling params bring no kv_transfer_params with "
            "do_remote_prefill fails (a decode engine that must load the KV cache)"
        ),
    ] = False
    audio_samples: Annotated[
        int,
        Meta(ge=0, description="samples (silence) each output carries as audio data; 0: none"),
    ] = 0
    sample_rate: Annotated[
        int, Meta(ge=1, description="the sample rate its audio outputs report (metrics)")
    ] = 16_000
    record: Annotated[
        Annotated[int, Meta(ge=0)] | bool,
        Meta(
            description="how many entries the received/completed/aborted records keep "
            f"(the most recent); false: none, true: the default {DEFAULT_RECORD}"
        ),
    ] = DEFAULT_RECORD

    @property
    def record_limit(self) -> int:
        """``record`` as a count (``false`` -> 0, ``true`` -> the default)."""
        if isinstance(self.record, bool):
            return DEFAULT_RECORD if self.record else 0
        return self.record


class TorchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options of the ``torch`` backend. Keys not listed here go to the factory."""

    factory: Annotated[
        str,
        Meta(
            description="'package.module:callable' that builds the module from the remaining "
            "options",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = DEFAULT_TORCH_FACTORY
    max_batch_size: Annotated[int, Meta(ge=1, description="most requests in one batch")] = 8
    max_batch_delay_s: Annotated[
        float, Meta(ge=0, description="longest wait (seconds) for a batch to fill")
    ] = 0.005
    max_concurrency: Annotated[int, Meta(ge=1, description="batches running at once")] = 1
    chunk_size: Annotated[
        int, Meta(ge=1, description="codes per streamed output chunk (stream_input)")
    ] = 16
    torch_threads: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="torch.set_num_threads (process-wide; default: leave it)"),
    ] = None


class TalkerOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``talker`` backend (see :mod:`omni_trio.backends.talker.backend`)."""

    model: Annotated[
        str,
        Meta(
            description="the Qwen-Omni checkpoint: a directory, or a tiny: preset "
            "(tiny:qwen3-omni, tiny:qwen2.5-omni)",
            min_length=1,
        ),
    ]
    speaker: Annotated[
        str, Meta(description="the voice when a request names none (sampling param speaker)")
    ] = "ethan"
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"], Meta(description="the talker's weights' dtype")
    ] = "float32"
    device: Annotated[
        str,
        Meta(
            description="the torch device the talker runs on (cpu, cuda, cuda:1, ...)",
            min_length=1,
        ),
    ] = "cpu"
    max_batch_size: Annotated[int, Meta(ge=1, description="most requests decoded in one step")] = 8
    max_concurrency: Annotated[
        int, Meta(ge=1, description="decode steps running at once (worker threads)")
    ] = 1
    torch_threads: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="torch.set_num_threads (process-wide; default: leave it)"),
    ] = None


class DiffusionOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``diffusion`` backend (see :mod:`omni_trio.backends.diffusion.backend`)."""

    model: Annotated[
        str,
        Meta(
            description="a diffusers pipeline directory (model_index.json), the tiny:diffusion "
            "preset, or scripted (a model-free step function for tests: "
            "omni_trio.testing.diffusion)",
            min_length=1,
        ),
    ]
    execution: Annotated[
        Literal["request", "step"],
        Meta(
            description="request: a batch runs all its steps before the next batch starts; "
            "step: every tick runs one denoise step for the running requests of one "
            "compatibility key, new requests join at the next tick"
        ),
    ] = "step"
    max_batch_size: Annotated[
        int, Meta(ge=1, description="most requests denoised in one step (one forward)")
    ] = 4
    preview_every: Annotated[
        int, Meta(ge=0, description="a decoded preview image every N steps (0: none)")
    ] = 0
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"], Meta(description="the pipeline's dtype")
    ] = "float32"
    device: Annotated[
        str, Meta(description="the torch device (cpu, cuda, cuda:1, ...)", min_length=1)
    ] = "cpu"
    torch_threads: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="torch.set_num_threads (process-wide; default: leave it)"),
    ] = None
    enable_model_cpu_offload: Annotated[
        bool, Meta(description="diffusers' model CPU offload (needs an accelerator device)")
    ] = False
    enable_sequential_cpu_offload: Annotated[
        bool, Meta(description="diffusers' sequential CPU offload (needs an accelerator device)")
    ] = False
    enable_attention_slicing: Annotated[
        bool, Meta(description="diffusers' attention slicing (the pipeline must support it)")
    ] = False
    enable_vae_slicing: Annotated[
        bool, Meta(description="decode a batch's images one at a time in the VAE")
    ] = False
    enable_vae_tiling: Annotated[bool, Meta(description="decode an image in VAE tiles")] = False
    scripted_step_s: Annotated[
        float, Meta(ge=0, description="model scripted only: trio-clock seconds a step takes")
    ] = 0.0
    scripted_fail_at_step: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="model scripted only: a request's step that raises (from 1)"),
    ] = None


_OFFLOADS = ("enable_model_cpu_offload", "enable_sequential_cpu_offload")
_SCRIPTED_ONLY = ("scripted_step_s", "scripted_fail_at_step")


def check_diffusion_options(
    options: DiffusionOptions, where: str, given: Mapping[str, object] | None = None
) -> None:
    """What can be checked of a diffusion stage's options without its model: the CPU
    offloads exclude each other and need an accelerator ``device``; the ``scripted_*``
    options (``given``: the options as written) belong to ``model: scripted``. ``where`` is
    the options' path (``$.stages[1].options``). Pure. Raises :class:`ConfigError` naming
    the option."""
    for name in _SCRIPTED_ONLY:
        if options.model != "scripted" and name in (given or {}):
            raise ConfigError(
                f"{name} applies to model scripted only, not {options.model!r}",
                path=f"{where}.{name}",
            )
    chosen = [name for name in _OFFLOADS if getattr(options, name)]
    if len(chosen) > 1:
        raise ConfigError(
            "diffusers' model and sequential CPU offloads exclude each other; enable one",
            path=f"{where}.{chosen[1]}",
        )
    if chosen and options.device.split(":")[0] == "cpu":
        raise ConfigError(
            "a CPU offload keeps the weights on the CPU and moves them to an accelerator when "
            f"used; it needs an accelerator device (cuda, xpu...), not device {options.device!r}",
            path=f"{where}.{chosen[0]}",
        )


class VllmOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``vllm`` backend (see :mod:`omni_trio.backends.vllm.backend`)."""

    cpu_bind: Annotated[
        str | int | list[str | int] | None,
        Meta(
            description="VLLM_CPU_OMP_THREADS_BIND for this engine only (a list: one per "
            "replica, cycled)"
        ),
    ] = None
    core_shutdown_grace_s: Annotated[
        float, Meta(ge=0, description="seconds the EngineCore gets to exit before SIGKILL")
    ] = 10.0
    output_buffer: Annotated[
        int, Meta(ge=1, le=1_000_000, description="per-request bridge window (outputs)")
    ] = 64
    abort_timeout_s: Annotated[
        float, Meta(gt=0, description="bound on waiting for the engine to confirm an abort")
    ] = 10.0
    loop: Annotated[
        VllmLoop,
        Meta(
            description="the event loop of the engine's worker thread: a plain asyncio loop, "
            "or trio.run with trio_asyncio.open_loop() (needs the trio-asyncio extra; "
            "measured at 1.3-1.4x the frontend CPU per request)"
        ),
    ] = "asyncio"


S = TypeVar("S", bound=msgspec.Struct)


def parse_options(
    options_type: type[S],
    options: Mapping[str, object],
    *,
    where: str,
    source: str | None = None,
    backend: str = "",
) -> S:
    """Convert a stage's ``options`` mapping with ``options_type`` (strict: no string to
    number coercion). ``where`` is the options' path (``$.stages[2].options``). Pure.

    Raises :class:`ConfigError` naming the key: unknown (with the known ones), ill-typed or
    out of range (with the value), a non-finite number, or a key that belongs on the stage.
    """
    label = f"{backend} option" if backend else "option"
    known = options_type.__struct_fields__
    for key in _MOVED_TO_STAGE:
        if key in options and key not in known:
            raise ConfigError(
                f"{key} is a stage key, not a {label}: write it beside `options:`",
                path=f"{where}.{key}",
                source=source,
            )
    if options_type.__struct_config__.forbid_unknown_fields:
        for key in options:
            if key not in known:
                raise ConfigError(
                    f"unknown {label} {key!r}; known: {', '.join(sorted(known))}",
                    path=f"{where}.{key}",
                    source=source,
                )
    try:
        parsed = msgspec.convert(dict(options), options_type)
    except msgspec.ValidationError as exc:
        reason, path = explain_validation_error(exc, dict(options), options_type)
        raise ConfigError(reason, path=where + path[1:], source=source) from None
    for key in known:
        value = getattr(parsed, key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"must be a finite number, got {value!r}", path=f"{where}.{key}", source=source
            )
    return parsed


def split_torch_options(
    options: Mapping[str, object],
) -> tuple[dict[str, object], dict[str, object], Callable[[dict[str, object]], object] | None]:
    """A torch stage's options as (the backend's keys, the factory's keys, a factory given as
    a callable in a config built in Python, else None). Pure."""
    own = {k: v for k, v in options.items() if k in TorchOptions.__struct_fields__}
    rest = {k: v for k, v in options.items() if k not in own}
    factory = own.get("factory")
    if callable(factory):
        del own["factory"]
        return own, rest, factory
    return own, rest, None


def options_type_of(factory: object) -> type[msgspec.Struct] | None:
    """The ``Options`` Struct a user factory declares, or None. Pure."""
    declared = getattr(factory, "Options", None)
    if isinstance(declared, type) and issubclass(declared, msgspec.Struct):
        return declared
    return None


def parse_torch_options(
    options: Mapping[str, object], *, stage_index: int = 0, source: str | None = None
) -> tuple[TorchOptions, dict[str, object]]:
    """Split a torch stage's options into the backend's (a validated :class:`TorchOptions`)
    and the factory's (every other key). Pure. Raises :class:`ConfigError` naming the option's
    path. A factory given as a callable is left out: see :func:`split_torch_options`."""
    where = f"$.stages[{stage_index}].options"
    own, factory_options, given = split_torch_options(options)
    opts = parse_options(TorchOptions, own, where=where, source=source, backend="torch")
    if given is None and not is_dotted(opts.factory):
        raise ConfigError(
            f"factory must be 'package.module:callable', got {opts.factory!r}",
            path=f"{where}.factory",
            source=source,
        )
    return opts, factory_options
