"""What a vllm worker makes of a request's input: vLLM sampling params and a rendered prompt.

Both run on the worker's loop, before ``AsyncLLM.add_request``. The prompt is rendered here
(the renderer's ``render_cmpl`` path) so that vLLM never needs its input-processing
executor. ``v`` is the namespace :func:`~._vllm_process.import_vllm` returns. A replica of
an entry stage with company scopes its prompts' multimodal UUIDs to itself (:mod:`.multimodal`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from ...errors import InvalidRequestError
from ...outputs import StageInput
from .multimodal import scoped_mm_uuids
from .protocol import check_sampling_keys

# dict params -> the SamplingParams built for them (per process; vLLM copies the params it is
# given, which "may be shared across prompts, requests and even engines"): building and
# verifying one costs more than the rest of a request's input handling
_BUILT: dict[tuple[object, ...], Any] = {}
_BUILT_MAX = 256


def sampling_params(v: SimpleNamespace, sp: Any, final_only: bool, text: bool = True) -> Any:
    """A vLLM ``SamplingParams`` for one request: ``None`` or a dict (keys checked), or a
    ``SamplingParams``; its output kind DELTA, or FINAL_ONLY when nobody streams the
    outputs. Without ``text`` (nobody reads the outputs' text) dict params ask vLLM not to
    detokenize, unless they set ``detokenize`` or have stop strings (matched on the text); a
    ``SamplingParams`` is taken as it is. The result may be shared with other requests
    (vLLM copies it). Raises InvalidRequestError for a bad key or type; vLLM raises for bad
    values."""
    kind = v.FINAL_ONLY if final_only else v.DELTA
    if isinstance(sp, v.SamplingParams):
        if sp.output_kind == kind:
            return sp
        params = sp.clone()
        params.output_kind = kind
        return params
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise InvalidRequestError(
            f"sampling_params must be None, a dict or a vllm SamplingParams, "
            f"not {type(sp).__name__}"
        )
    detokenize = text or "detokenize" in sp or bool(sp.get("stop"))
    key = _key(sp, final_only, detokenize)
    built = _BUILT.get(key) if key is not None else None
    if built is not None:
        return built
    check_sampling_keys(sp, v.SamplingParams.__struct_fields__)
    extra = {"output_kind": kind} if detokenize else {"output_kind": kind, "detokenize": False}
    built = v.SamplingParams(**{**sp, **extra})
    if key is not None:
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.clear()
        _BUILT[key] = built
    return built


def _key(sp: dict[str, Any], final_only: bool, detokenize: bool) -> tuple[object, ...] | None:
    """A hashable key for dict params, or None when a value is not hashable (a list)."""
    key = (final_only, detokenize, *sorted(sp.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


#: a prompt's ``multi_modal_data`` split into its items, per modality
SplitItems = Callable[[Mapping[str, object]], Mapping[str, object]]


def split_items(
    parse: Callable[[Mapping[str, object]], Mapping[str, Any]], data: Mapping[str, object]
) -> dict[str, list[object]]:
    """``data``'s items per modality as vLLM counts and hashes them, ``parse`` being a vLLM
    ``parse_mm_data`` (a batched array is several images, a list of frames one video).
    Raises what ``parse`` raises (``ValueError`` for an unsupported modality)."""
    return {modality: items.get_all_items_for_hash() for modality, items in parse(data).items()}


def _engine_split(engine: Any) -> SplitItems:
    def split(data: Mapping[str, object]) -> Mapping[str, object]:
        try:
            processor = engine.renderer.get_mm_processor()
        except ValueError:  # a text-only model: vLLM rejects the data itself, naming it
            return data
        return split_items(processor.info.parse_mm_data, data)

    return split


def _scoped(prompt: Any, scope: tuple[str, int], split: SplitItems | None) -> Any:
    """``prompt`` with its multimodal UUIDs scoped (a new dict), or itself when it carries
    no multimodal data. An encoder-decoder prompt carries it in its ``encoder_prompt``."""
    if not isinstance(prompt, dict):
        return prompt
    if isinstance(prompt.get("encoder_prompt"), dict):
        return {**prompt, "encoder_prompt": _scoped(prompt["encoder_prompt"], scope, split)}
    data = prompt.get("multi_modal_data")
    if not data:
        return prompt
    items = data if split is None else split(data)
    uuids = scoped_mm_uuids(*scope, items, prompt.get("multi_modal_uuids"))
    return {**prompt, "multi_modal_uuids": uuids}


def engine_prompt(
    chunk: StageInput, mm_scope: tuple[str, int] | None = None, split: SplitItems | None = None
) -> Any:
    """What vLLM is given for a stage input: token ids, a text prompt or a prompt dict, in
    that order. With ``mm_scope`` (stage id, replica index), a prompt dict carrying
    ``multi_modal_data`` gets ``multi_modal_uuids`` scoped to that replica
    (:func:`~._vllm_mm.scoped_mm_uuids`), its items as ``split`` finds them (default: each
    element of a list, else the value). The input's own dict is never changed. Pure apart from
    ``split``. Raises InvalidRequestError when the input has none of them."""
    if chunk.token_ids:
        return {"prompt_token_ids": list(chunk.token_ids)}
    if chunk.prompt is not None:
        return chunk.prompt
    if isinstance(chunk.data, dict):
        return chunk.data if mm_scope is None else _scoped(chunk.data, mm_scope, split)
    raise InvalidRequestError(
        f"a vllm stage needs a text prompt, token ids or a prompt dict, got {chunk!r}"
    )


def render(
    v: SimpleNamespace,
    engine: Any,
    chunk: StageInput,
    mm_scope: tuple[str, int] | None = None,
    tokenization_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """The engine's rendered prompt for a stage input (:func:`engine_prompt`, multimodal
    items split as the engine's processor does), tokenized with the renderer's defaults
    updated by ``tokenization_kwargs`` (e.g. ``truncate_prompt_tokens``,
    ``add_special_tokens``). Raises InvalidRequestError when the input has no prompt; vLLM
    raises for a prompt or a tokenization argument it rejects."""
    raw = engine_prompt(chunk, mm_scope, _engine_split(engine))
    parsed = v.parse_model_prompt(engine.model_config, raw)
    renderer = engine.renderer
    tok_params = renderer.default_cmpl_tok_params
    if tokenization_kwargs:
        tok_params = tok_params.with_kwargs(**tokenization_kwargs)
    (rendered,) = renderer.render_cmpl([parsed], tok_params)
    return rendered
