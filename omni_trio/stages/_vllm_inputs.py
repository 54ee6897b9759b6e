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


def sampling_params(v: SimpleNamespace, sp: Any, final_only: bool) -> Any:
    """A vLLM ``SamplingParams`` for one request: ``None`` or a dict (keys checked), or a
    ``SamplingParams`` (copied); its output kind DELTA, or FINAL_ONLY when nobody streams
    the outputs. Raises InvalidRequestError for a bad key or type; vLLM raises for values."""
    kind = v.FINAL_ONLY if final_only else v.DELTA
    if isinstance(sp, v.SamplingParams):
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
    check_sampling_keys(sp, v.SamplingParams.__struct_fields__)
    return v.SamplingParams(**{**sp, "output_kind": kind})


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
