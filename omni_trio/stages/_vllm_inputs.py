"""What a vllm worker makes of a request's input: vLLM sampling params and a rendered prompt.

Both run on the worker's loop, before ``AsyncLLM.add_request``. The prompt is rendered here
(the renderer's ``render_cmpl`` path) so that vLLM never needs its input-processing
executor. ``v`` is the namespace :func:`~._vllm_process.import_vllm` returns.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..errors import InvalidRequestError
from ..outputs import StageInput
from ._vllm_protocol import check_sampling_keys

# dict params -> the SamplingParams built for them (per process; vLLM copies the params it is
# given, which "may be shared across prompts, requests and even engines"): building and
# verifying one costs more than the rest of a request's input handling
_BUILT: dict[tuple[object, ...], Any] = {}
_BUILT_MAX = 256


def sampling_params(v: SimpleNamespace, sp: Any, final_only: bool) -> Any:
    """A vLLM ``SamplingParams`` for one request: ``None`` or a dict (keys checked), or a
    ``SamplingParams``; its output kind DELTA, or FINAL_ONLY when nobody streams the
    outputs. The result may be shared with other requests (vLLM copies it). Raises
    InvalidRequestError for a bad key or type; vLLM raises for bad values."""
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
    key = _key(sp, final_only)
    built = _BUILT.get(key) if key is not None else None
    if built is not None:
        return built
    check_sampling_keys(sp, v.SamplingParams.__struct_fields__)
    built = v.SamplingParams(**{**sp, "output_kind": kind})
    if key is not None:
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.clear()
        _BUILT[key] = built
    return built


def _key(sp: dict[str, Any], final_only: bool) -> tuple[object, ...] | None:
    """A hashable key for dict params, or None when a value is not hashable (a list)."""
    key = (final_only, *sorted(sp.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def render(v: SimpleNamespace, engine: Any, chunk: StageInput) -> Any:
    """The engine's rendered prompt for a stage input: token ids, a text prompt or a prompt
    dict, in that order. Raises InvalidRequestError when the input has none of them."""
    if chunk.token_ids:
        raw: Any = {"prompt_token_ids": list(chunk.token_ids)}
    elif chunk.prompt is not None:
        raw = chunk.prompt
    elif isinstance(chunk.data, dict):
        raw = chunk.data
    else:
        raise InvalidRequestError(
            f"a vllm stage needs a text prompt, token ids or a prompt dict, got {chunk!r}"
        )
    parsed = v.parse_model_prompt(engine.model_config, raw)
    renderer = engine.renderer
    (rendered,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
    return rendered
