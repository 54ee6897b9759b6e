"""Prefill/decode disaggregation per request: the sampling rewrite and the KV handoff.

A request whose route runs a prefill/decode pair (:mod:`omni_trio.config.pd`) goes like
this. When it is made (:func:`pd_request_params`), the pair's sampling params are checked
(a mapping; ``n`` 1; no logprobs and no structured output; the decode greedy or seeded, so
that its answer is the one a single engine would give) and the prefill's are rewritten
(:func:`prefill_sampling_params`): one token (``max_tokens`` and ``min_tokens`` 1, so it
ends by length, which is when a connector hands the cache over), no stop lists, and
``extra_args.kv_transfer_params`` asking for a remote decode with a transfer id. The prefill
stage runs it; the ``kv_transfer_params`` its engine returned come back in its finished
output's ``metrics`` (:func:`kv_transfer_params_of`). The decode stage then starts with the
prefill's own input (the same prompt: :func:`decode_input`) and the request's params plus
those ``kv_transfer_params`` (:func:`decode_sampling_params`), so its engine loads the
cache instead of recomputing the prompt. Missing or malformed ones fail that request with a
:class:`~omni_trio.errors.StageError` naming the pair. :class:`~omni_trio.request.run.
StageRunner` does the run-time part. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real

from ..config.pd import PDPair
from ..errors import InvalidRequestError, StageError
from ..outputs import SamplingParams, StageInput, StageOutput
from .planning import RequestPlan

__all__ = [
    "KV_TRANSFER_PARAMS",
    "NOT_ON_A_PAIR",
    "check_pair_params",
    "decode_input",
    "decode_sampling_params",
    "kv_transfer_params_of",
    "pd_request_params",
    "prefill_sampling_params",
    "transfer_id",
]

#: where vLLM reads a request's KV transfer params (``SamplingParams.extra_args``) and where
#: its finished output carries them (``RequestOutput.kv_transfer_params``; a stage's finished
#: output's ``metrics``)
KV_TRANSFER_PARAMS = "kv_transfer_params"
#: sampling params a pair cannot honour: the prefill's logprobs and grammar state stay in
#: its engine, and the decode's would miss the prompt (vLLM's names, older ones included)
NOT_ON_A_PAIR = (
    "logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "prompt_logprob_token_ids",
    "structured_outputs",
    "guided_decoding",
)


def transfer_id(request_id: str) -> str:
    """The transfer id of a request's KV handoff. Pure."""
    return f"xfer-{request_id}"


def check_pair_params(
    params: SamplingParams, stage_id: str, pair: PDPair, *, decode: bool
) -> Mapping[str, object]:
    """``params`` of stage ``stage_id`` (a half of ``pair``), checked: a mapping, ``n`` 1,
    none of :data:`NOT_ON_A_PAIR`, and for the decode greedy (``temperature`` 0) or seeded
    (a ``seed``). Pure. Raises :class:`InvalidRequestError` naming the param and the pair."""
    what = f"stage {stage_id!r} ({'decode' if decode else 'prefill'} half of {pair.label})"
    if not isinstance(params, Mapping):
        raise InvalidRequestError(
            f"the sampling params of {what} must be a mapping of vLLM SamplingParams fields "
            f"(the engine rewrites them for the KV handoff), not {type(params).__name__}"
        )
    n = params.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise InvalidRequestError(
            f"sampling param 'n' of {what} must be 1, got {n!r}: a pair hands over the KV "
            "cache of one sequence"
        )
    for key in NOT_ON_A_PAIR:
        if params.get(key) is not None:
            raise InvalidRequestError(
                f"sampling param {key!r} is not supported on {what}: logprobs and structured "
                "output need the prompt's state, which stays in the prefill engine"
            )
    extra = params.get("extra_args")
    if extra is not None and not (
        isinstance(extra, Mapping) and isinstance(extra.get(KV_TRANSFER_PARAMS) or {}, Mapping)
    ):
        raise InvalidRequestError(
            f"sampling param 'extra_args' of {what} must be a mapping whose "
            f"{KV_TRANSFER_PARAMS!r} (if any) is a mapping, got {extra!r}"
        )
    if decode:
        temperature = params.get("temperature")
        greedy = isinstance(temperature, Real) and not isinstance(temperature, bool)
        if not (greedy and temperature == 0) and params.get("seed") is None:
            raise InvalidRequestError(
                f"{what} needs greedy (temperature: 0) or seeded (seed: an int) sampling, so "
                f"that its answer is the one a single engine would give; got temperature "
                f"{temperature!r} and no seed"
            )
    return params


def _with_kv_params(params: Mapping[str, object], kv: Mapping[str, object]) -> dict[str, object]:
    # a copy of params whose extra_args' kv_transfer_params are the given ones merged over
    # the params' own (check_pair_params checked their shapes)
    extra = params.get("extra_args")
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    own = extra.get(KV_TRANSFER_PARAMS)
    extra[KV_TRANSFER_PARAMS] = {**(own if isinstance(own, Mapping) else {}), **kv}
    return {**params, "extra_args": extra}


def prefill_sampling_params(params: Mapping[str, object], request_id: str) -> dict[str, object]:
    """The prefill stage's params for a request (from its checked ``params``): one token
    (``max_tokens`` and ``min_tokens`` 1: it ends by length, as a connector needs to hand
    the cache over), no stop lists, and ``extra_args.kv_transfer_params`` with
    ``do_remote_decode`` and the request's :func:`transfer_id`. Pure; ``params`` is not
    changed."""
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    out = _with_kv_params(params, {**kv, "transfer_id": transfer_id(request_id)})
    out.update(max_tokens=1, min_tokens=1, stop=[], stop_token_ids=[])
    out.pop("include_stop_str_in_output", None)
    return out


def decode_sampling_params(
    params: Mapping[str, object], kv: Mapping[str, object] | None, request_id: str
) -> dict[str, object]:
    """The decode stage's params for a request: its checked ``params`` with
    ``extra_args.kv_transfer_params`` set to what the prefill returned (``kv``; None for a
    connector that returns none) marked ``do_remote_prefill``, with a :func:`transfer_id`
    unless ``kv`` has one. Pure; ``params`` is not changed."""
    merged: dict[str, object] = {"transfer_id": transfer_id(request_id), **(kv or {})}
    merged.update(do_remote_prefill=True, do_remote_decode=False)
    return _with_kv_params(params, merged)


def kv_transfer_params_of(
    outputs: Sequence[StageOutput], pair: PDPair, request_id: str
) -> Mapping[str, object] | None:
    """The ``kv_transfer_params`` the prefill stage of ``pair`` returned for a request, from
    its ``outputs`` (its finished output's ``metrics``); None when it has none and the
    pair's connector returns none (``pair.kv_params_required`` false). Pure. Raises
    :class:`StageError` (of the decode stage, naming the pair) when they are missing or are
    not a mapping with string keys."""
    last = outputs[-1] if outputs else None
    if last is None or not last.finished:
        raise StageError(
            f"{pair.label}: prefill stage {pair.prefill!r} ended request {request_id!r} "
            "without a finished output: no kv_transfer_params for the decode stage",
            stage_id=pair.decode,
            request_id=request_id,
        )
    metrics = last.metrics
    kv = metrics.get(KV_TRANSFER_PARAMS) if isinstance(metrics, Mapping) else None
    if kv is None:
        if not pair.kv_params_required:
            return None
        raise StageError(
            f"{pair.label}: prefill stage {pair.prefill!r} finished request {request_id!r} "
            f"(finish_reason {last.finish_reason!r}) without kv_transfer_params, so decode "
            f"stage {pair.decode!r} has no KV cache to load (connector {pair.connector!r} "
            "returns them for a prefill that ended by length)",
            stage_id=pair.decode,
            request_id=request_id,
        )
    if not isinstance(kv, Mapping) or not all(isinstance(k, str) for k in kv):
        raise StageError(
            f"{pair.label}: prefill stage {pair.prefill!r} returned malformed "
            f"kv_transfer_params for request {request_id!r}: a mapping with string keys is "
            f"needed, got {type(kv).__name__} {kv!r:.200}",
            stage_id=pair.decode,
            request_id=request_id,
        )
    return kv


def decode_input(prefill_input: StageInput, prefill_metrics: object, pair: PDPair) -> StageInput:
    """The decode stage's whole input: the prompt its prefill stage computed the KV cache
    of. That is the ``prompt_token_ids`` the prefill's finished output reports (``metrics``:
    the prompt as its engine tokenized it, templates and ``tokenization_kwargs`` applied, so
    the decode gets exactly those tokens) when its input was text or token ids; otherwise
    (a prompt dict, which may carry multimodal data the decode needs too, or no ids
    reported) the prefill's input itself. Pure."""
    ids = prefill_metrics.get("prompt_token_ids") if isinstance(prefill_metrics, Mapping) else None
    if (
        not isinstance(prefill_input.data, Mapping)
        and isinstance(ids, (tuple, list))
        and ids
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        return StageInput(None, tuple(ids), prefill_input.data, True, pair.prefill)
    chunk = prefill_input
    return StageInput(chunk.prompt, chunk.token_ids, chunk.data, True, pair.prefill)


def pd_request_params(
    pairs: Sequence[PDPair],
    plan: RequestPlan,
    params: Mapping[str, SamplingParams],
    request_id: str,
    *,
    streaming_input: bool = False,
    lora_request: object = None,
) -> dict[str, SamplingParams]:
    """Every stage's params for a request on route ``plan``: for each pair on it, both
    halves' checked (:func:`check_pair_params`) and the prefill's rewritten
    (:func:`prefill_sampling_params`); the other stages' as given. Pure. Raises
    :class:`InvalidRequestError`: a bad param, a route that runs a prefill stage without its
    decode stage, ``streaming_input`` into a prefill stage (it needs the whole prompt), or a
    ``lora_request`` with an entry prefill stage (only entry stages take it, so its decode
    stage would decode without the adapter the cache was computed with)."""
    out = dict(params)
    active = set(plan.active)
    for pair in pairs:
        if pair.prefill not in active:
            continue
        if pair.decode not in active:
            raise InvalidRequestError(
                f"the route runs prefill stage {pair.prefill!r} of {pair.label} without its "
                f"decode stage {pair.decode!r}, which must take the KV cache it hands over "
                "(choose final_stage_id / output stages at or after the decode stage)"
            )
        if streaming_input and pair.prefill in plan.entries:
            raise InvalidRequestError(
                f"streaming_input cannot feed prefill stage {pair.prefill!r} of {pair.label}: "
                "a prefill computes the KV cache of the whole prompt at once"
            )
        if lora_request is not None and pair.prefill in plan.entries:
            raise InvalidRequestError(
                f"lora_request is not supported on {pair.label}: only entry stages take it, "
                f"so decode stage {pair.decode!r} would decode without the adapter its KV "
                "cache was computed with"
            )
        check_pair_params(out[pair.decode], pair.decode, pair, decode=True)
        prefill = check_pair_params(out[pair.prefill], pair.prefill, pair, decode=False)
        out[pair.prefill] = prefill_sampling_params(prefill, request_id)
    return out
