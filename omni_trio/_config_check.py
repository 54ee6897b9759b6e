"""Checking a converted pipeline: what its types alone cannot say.

Converting a file to :class:`~omni_trio._config_pipeline.PipelineConfig` checks each key's
type and bounds. :func:`validate` checks the rest and raises at the first
problem: stage ids (non-empty, unique), backends (built-in or a dotted path), each stage's
inputs (not itself, not twice, known), an entry stage, the graph (no cycle), a final output,
the prompt hooks (entry stages only, importable), every backend's ``options``
(:mod:`omni_trio.stages.options`), and the placements (one Ray cluster for all).
:func:`check_vllm_stages` checks vllm stages against vLLM's own fields. Every failure is a
:class:`~omni_trio.errors.ConfigError` naming the source and the value's ``$``-path.
Import these names from :mod:`omni_trio.config`.
"""

from __future__ import annotations

from ._config_pipeline import PipelineConfig
from ._config_stage import BUILTIN_BACKENDS, PLACEMENTS, StageConfig
from ._dotted import import_dotted, is_dotted
from ._stage_graph import some_ids
from .errors import ConfigError

__all__ = ["check_vllm_stages", "validate"]


def check_vllm_stages(cfg: PipelineConfig) -> None:
    """Check every vllm stage's ``engine_args`` and ``default_sampling_params`` against vLLM's
    own fields (when vllm is installed). Blocking: imports vllm (seconds, once per process).
    Raises :class:`ConfigError` naming the path."""
    from .stages._vllm_fields import check_vllm_stage

    for i, st in enumerate(cfg.stages):
        if st.backend == "vllm":
            check_vllm_stage(
                st.engine_args, st.default_sampling_params, f"$.stages[{i}]", cfg.source
            )


def validate(cfg: PipelineConfig, *, check_vllm: bool = True) -> None:
    """Check the stage graph and every stage (see the module docstring). Blocking (imports
    the modules the config names). Raises :class:`ConfigError` at the first problem."""
    from .stages.options import check_stage

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
    for i, st in enumerate(cfg.stages):
        _check_entry_hooks(st, i, src)
        check_stage(st, i, src, check_vllm=check_vllm)
    _check_placements(cfg.stages, src)


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
