"""Checking a converted pipeline: what its types alone cannot say.

Converting a file to :class:`~omni_trio.config.pipeline.PipelineConfig` checks each key's
type and bounds. :func:`validate` checks the rest and raises at the first
problem: stage ids (non-empty, unique), backends (built-in or a dotted path), each stage's
inputs (not itself, not twice, known), an entry stage, the graph (no cycle), a final output,
the prompt hooks (entry stages only, importable), the prefill/decode pairs
(:mod:`omni_trio.config.pd`), every backend's ``options``
(:mod:`omni_trio.config.options`), the placements (one Ray cluster for all), and the
stages' ``resources`` against the ``capacities`` (:mod:`omni_trio.config.resources`).
:func:`check_vllm_stages` checks vllm stages against vLLM's own fields. Every failure is a
:class:`~omni_trio.errors.ConfigError` naming the source and the value's ``$``-path.

:func:`check_stage` is everything about one stage that can be known without starting it:
its options (against its backend's Struct: :mod:`omni_trio.config.options`), the dotted paths
it names (imported; a backend path must name a backend factory,
:func:`omni_trio.config.backends.check_factory`), a torch weights file, and, when vllm is
importable, ``engine_args`` against ``AsyncEngineArgs`` and ``default_sampling_params``
against ``SamplingParams``. Importing this module imports neither torch nor vllm; vllm is
imported on the first check of a vllm stage (several seconds, once per process).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..errors import BackendUnavailableError, ConfigError
from .backends import BUILTIN_BACKENDS, check_factory
from .dotted import import_dotted, is_dotted
from .graph import some_ids
from .options import (
    DiffusionOptions,
    check_diffusion_options,
    options_type_of,
    parse_options,
    parse_torch_options,
    split_torch_options,
)
from .pd import pd_pairs
from .pipeline import PipelineConfig
from .resources import check_resources
from .stage import PLACEMENTS, StageConfig
from .vllm_fields import check_vllm_stage

__all__ = ["check_stage", "check_vllm_stages", "validate"]


def check_vllm_stages(cfg: PipelineConfig) -> None:
    """Check every vllm stage's ``engine_args`` and ``default_sampling_params`` against vLLM's
    own fields (when vllm is installed). Blocking: imports vllm (seconds, once per process).
    Raises :class:`ConfigError` naming the path."""
    for i, st in enumerate(cfg.stages):
        if st.backend == "vllm":
            check_vllm_stage(
                st.engine_args, st.default_sampling_params, f"$.stages[{i}]", cfg.source
            )


def validate(cfg: PipelineConfig, *, check_vllm: bool = True) -> None:
    """Check the stage graph and every stage (see the module docstring). Blocking (imports
    the modules the config names). Raises :class:`ConfigError` at the first problem."""
    src = cfg.source
    if not cfg.stages:
        raise ConfigError("a pipeline needs at least one stage", path="$.stages", source=src)
    seen: dict[str, int] = {}
    for i, st in enumerate(cfg.stages):
        where = f"$.stages[{i}]"
        if not st.id or not st.id.strip():
            raise ConfigError("stage id must be a non-empty name", path=f"{where}.id", source=src)
        if st.id in seen:
            raise ConfigError(
                f"duplicate stage id {st.id!r} (also $.stages[{seen[st.id]}])",
                path=f"{where}.id",
                source=src,
            )
        seen[st.id] = i
        if st.backend not in BUILTIN_BACKENDS and not is_dotted(st.backend):
            raise ConfigError(
                f"unknown backend {st.backend!r}; use one of {', '.join(BUILTIN_BACKENDS)} "
                f"or a 'package.module:Factory' path",
                path=f"{where}.backend",
                source=src,
            )
        for j, up in enumerate(st.inputs):
            if up == st.id:
                raise ConfigError(
                    f"stage {st.id!r} lists itself as an input",
                    path=f"{where}.inputs[{j}]",
                    source=src,
                )
        if len(set(st.inputs)) != len(st.inputs):
            raise ConfigError("an input stage is listed twice", path=f"{where}.inputs", source=src)
    for i, st in enumerate(cfg.stages):
        for j, up in enumerate(st.inputs):
            if up not in seen:
                raise ConfigError(
                    f"unknown input stage {up!r}; {some_ids(list(seen))}",
                    path=f"$.stages[{i}].inputs[{j}]",
                    source=src,
                )
    if not cfg.entry_stages:
        raise ConfigError(
            "no entry stage: every stage has inputs, so no stage can take the prompt",
            path="$.stages",
            source=src,
        )
    cfg.__dict__.pop("_graph_cache", None)
    cfg.graph()  # unknown inputs, cycles
    if not cfg.final_output_stages:
        raise ConfigError(
            "no stage has final_output: true, so callers would receive nothing",
            path="$.stages",
            source=src,
        )
    pd_pairs(cfg.stages, src)  # prefill/decode pairs (config/pd.py)
    for i, st in enumerate(cfg.stages):
        _check_entry_hooks(st, i, src)
        check_stage(st, i, src, check_vllm=check_vllm)
    _check_placements(cfg.stages, src)
    check_resources(cfg)


#: the hooks only an entry stage may name (they act on the request's prompt)
_ENTRY_HOOKS = ("prompt_transform", "prompt_expand")


def _check_entry_hooks(st: StageConfig, index: int, source: str | None) -> None:
    # Blocking: imports the hook's module. Raises ConfigError naming the key's path.
    for key in _ENTRY_HOOKS:
        path: str | None = getattr(st, key)
        if path is None:
            continue
        where = f"$.stages[{index}].{key}"
        if st.inputs:
            raise ConfigError(
                f"{key} is for entry stages (stages without inputs): it acts on the "
                f"caller's prompt, and stage {st.id!r} takes its input from {st.inputs}",
                path=where,
                source=source,
            )
        import_dotted(path, what=key, where=where, source=source)


def _check_placements(stages: list[StageConfig], source: str | None) -> None:
    # Pure. A process holds one Ray connection, so all Ray stages share one address.
    first: tuple[int, str | None] | None = None
    for i, st in enumerate(stages):
        if st.placement is None:
            continue
        where = f"$.stages[{i}].placement"
        if st.placement.ray is None:
            raise ConfigError(
                f"a placement names where the replicas run: one of {', '.join(PLACEMENTS)} "
                "(e.g. placement: {ray: {num_cpus: 1}}); leave placement out to run them here",
                path=where,
                source=source,
            )
        address = st.placement.ray.address
        if first is None:
            first = (i, address)
        elif address != first[1]:
            raise ConfigError(
                f"stage {st.id!r} is placed on Ray at {_ray_address(address)} but stage "
                f"{stages[first[0]].id!r} ($.stages[{first[0]}]) at "
                f"{_ray_address(first[1])}: an engine connects to one Ray cluster, so every "
                "Ray stage must name the same address",
                path=f"{where}.ray.address",
                source=source,
            )


def _ray_address(address: str | None) -> str:
    return "a local Ray (no address)" if address is None else repr(address)


def check_stage(
    stage: StageConfig, index: int, source: str | None, *, check_vllm: bool = True
) -> None:
    """Check one stage as far as possible without starting it (see the module docstring).

    Imports the modules its dotted paths name (and vllm, for a vllm stage, when installed).
    Raises :class:`ConfigError` naming the path.
    """
    where = f"$.stages[{index}]"
    if stage.input_processor is not None:
        import_dotted(
            stage.input_processor,
            what="input_processor",
            where=f"{where}.input_processor",
            source=source,
        )
    opts_where = f"{where}.options"
    if stage.backend == "torch":
        _check_torch(stage.options, index, source)
    elif stage.backend in BUILTIN_BACKENDS:
        parsed = parse_options(
            BUILTIN_BACKENDS[stage.backend].options,
            stage.options,
            where=opts_where,
            source=source,
            backend=stage.backend,
        )
        if isinstance(parsed, DiffusionOptions):
            try:
                check_diffusion_options(parsed, opts_where, stage.options)
            except ConfigError as exc:
                raise ConfigError(exc.reason, path=exc.path, source=source) from None
    else:
        factory = import_dotted(
            stage.backend, what="backend", where=f"{where}.backend", source=source
        )
        check_factory(factory, stage.backend, where=f"{where}.backend", source=source)
        declared = options_type_of(factory)
        if declared is not None:
            parse_options(declared, stage.options, where=opts_where, source=source)
    if stage.backend == "vllm" and check_vllm:
        check_vllm_stage(stage.engine_args, stage.default_sampling_params, where, source)
    elif stage.backend == "scripted":
        # the one sampling param a scripted stage reads, as vLLM would: an int >= 1
        max_tokens = stage.default_sampling_params.get("max_tokens")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ConfigError(
                f"max_tokens must be an integer >= 1, got {max_tokens!r}",
                path=f"{where}.default_sampling_params.max_tokens",
                source=source,
            )


def _check_torch(options: Mapping[str, object], index: int, source: str | None) -> None:
    where = f"$.stages[{index}].options"
    opts, rest = parse_torch_options(options, stage_index=index, source=source)
    factory: object = split_torch_options(options)[2]
    if factory is None:
        try:
            factory = import_dotted(
                opts.factory, what="torch factory", where=f"{where}.factory", source=source
            )
        except BackendUnavailableError:
            pass  # torch is not installed here: starting the stage says so
    declared = options_type_of(factory)
    if declared is not None:
        parse_options(declared, rest, where=where, source=source)
    weights = rest.get("weights")
    if isinstance(weights, str) and not weights.startswith("tiny:"):
        if not Path(weights).expanduser().is_file():
            raise ConfigError(
                f"weights file {weights!r} does not exist (relative paths are taken from the "
                f"working directory, {str(Path.cwd())!r})",
                path=f"{where}.weights",
                source=source,
            )
