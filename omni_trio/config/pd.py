"""Prefill/decode disaggregation in the config: which stages pair up, checked at load.

A stage marked ``is_prefill_only`` and the stage marked ``is_decode_only`` that lists it as
its one input form a :class:`PDPair`: the prefill engine computes the prompt's KV cache (one
token of output, thrown away), its KV connector hands the cache over, and the decode engine,
given the same prompt and the prefill's ``kv_transfer_params``, loads it instead of
recomputing it (:mod:`omni_trio.request.pd` does that per request). A pipeline may hold
several pairs (two LLM stages each split in two, or two branches); each is checked alone.

:func:`pd_pairs` finds the pairs and checks them, every failure a
:class:`~omni_trio.errors.ConfigError` naming the ``$``-path of the broken field:

- the flags: on ``vllm`` stages (and ``scripted`` ones, vLLM's model-free stand-in in
  tests), not both on one stage;
- the graph: a decode stage's one input is a prefill stage; every prefill stage feeds
  exactly one decode stage and no other stage (its output is one throwaway token); neither
  takes streamed input; a prefill stage is no ``final_output`` and makes no CFG companions;
  a decode stage has no ``input_processor`` (its input is its prefill's, unchanged);
- the KV transfer: both stages set ``engine_args.kv_transfer_config`` (vLLM's
  ``KVTransferConfig`` fields: it goes to vLLM unchanged), with the same ``kv_connector``,
  roles that produce (``kv_producer``/``kv_both``) and consume
  (``kv_consumer``/``kv_both``), equal ``kv_buffer_device`` and ``kv_buffer_size`` where
  both set them, and the same ``model``, ``dtype``, ``kv_cache_dtype``, ``block_size`` and
  ``tensor_parallel_size`` in their ``engine_args`` (set alike, or both unset); for
  ``ExampleConnector``, which hands the cache over in a directory, the same
  ``kv_connector_extra_config.shared_storage_path``.

``kv_transfer_config`` lives in ``engine_args`` rather than beside them: it is an
``AsyncEngineArgs`` field that vLLM reads as it is, so it is written once, reaches the
engine unchanged, and ``omni-trio validate`` checks its keys against vLLM's own
(:mod:`omni_trio.config.vllm_fields`). Pure functions; nothing here imports vllm.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .stage import StageConfig

__all__ = [
    "KV_CONSUMER_ROLES",
    "KV_PARAMS_OPTIONAL_CONNECTORS",
    "KV_PRODUCER_ROLES",
    "PD_BACKENDS",
    "PDPair",
    "check_pd_pair",
    "find_pd_pairs",
    "kv_transfer_config",
    "pd_pairs",
]

#: the backends a stage of a pair may have: vLLM's, and the scripted stand-in of tests
PD_BACKENDS = ("vllm", "scripted")
#: the ``kv_role`` values that let an engine hand its KV cache over / take it in (vLLM's)
KV_PRODUCER_ROLES = ("kv_producer", "kv_both")
KV_CONSUMER_ROLES = ("kv_consumer", "kv_both")
#: connectors that find the KV cache by the prompt's content (a shared directory keyed by
#: the tokens' hash) and return no ``kv_transfer_params`` from the prefill: a pair on one
#: of them runs without them; every other connector must return them
KV_PARAMS_OPTIONAL_CONNECTORS = frozenset({"ExampleConnector"})
#: the keys of ``kv_transfer_config`` whose values the two halves must agree on, where both
#: set them (``kv_buffer_size`` is an older vLLM's; the current one has no such field)
_MATCHED_KEYS = ("kv_buffer_device", "kv_buffer_size")
#: connectors whose halves meet in a directory, ``kv_connector_extra_config.
#: shared_storage_path`` (vLLM's default when unset): a decode looking in another one finds
#: nothing and silently recomputes the prompt
_SHARED_STORE_CONNECTORS = frozenset({"ExampleConnector"})
_STORE_KEY = "shared_storage_path"
#: the engine args both halves must give alike (unset counts as the default given), and why
_SAME_ENGINE_ARGS: dict[str, tuple[object, str]] = {
    "model": (None, "the decode loads the KV cache the prefill's model computed"),
    "dtype": (None, "the KV cache is handed over in the prefill's dtype"),
    "kv_cache_dtype": (None, "the KV cache is handed over in the prefill's cache dtype"),
    "block_size": (
        None,
        "the KV cache is handed over in blocks (a connector keyed by the prompt's tokens, as "
        "ExampleConnector is, finds nothing under another block size and recomputes)",
    ),
    "tensor_parallel_size": (
        1,
        "the KV cache is sharded by tensor parallelism, so both halves need the same",
    ),
}


def _shown(value: object) -> str:
    return "unset" if value is None else repr(value)


@dataclass(frozen=True, slots=True)
class PDPair:
    """One prefill/decode pair: its two stages (ids and indexes), the connector they share,
    and whether the prefill's finished output must carry ``kv_transfer_params``."""

    prefill: str
    decode: str
    prefill_index: int
    decode_index: int
    connector: str
    kv_params_required: bool = True

    @property
    def label(self) -> str:
        """``prefill/decode pair 'p' -> 'd'``, for messages."""
        return f"prefill/decode pair {self.prefill!r} -> {self.decode!r}"


def pd_pairs(stages: Sequence[StageConfig], source: str | None = None) -> tuple[PDPair, ...]:
    """Every prefill/decode pair of ``stages``, checked (:func:`find_pd_pairs`, then
    :func:`check_pd_pair` for each), in the decode stages' order. Pure. Raises
    :class:`ConfigError` naming the first broken field's path."""
    return tuple(check_pd_pair(stages, pair, source) for pair in find_pd_pairs(stages, source))


def find_pd_pairs(stages: Sequence[StageConfig], source: str | None = None) -> list[PDPair]:
    """The pairs the flags and the inputs make, with the graph checks of the module
    docstring; the KV transfer is not looked at (``connector`` is left empty). Stage ids are
    unique and inputs known (the graph checks ran). Pure. Raises :class:`ConfigError`."""
    index = {st.id: i for i, st in enumerate(stages)}
    for i, st in enumerate(stages):
        _check_flags(st, i, source)
    pairs: list[PDPair] = []
    decode_of: dict[str, int] = {}  # prefill id -> the index of its decode stage
    for i, st in enumerate(stages):
        if not st.is_decode_only:
            continue
        where = f"$.stages[{i}]"
        if len(st.inputs) != 1:
            raise ConfigError(
                f"decode-only stage {st.id!r} takes exactly one input, its prefill-only stage "
                f"(it decodes that stage's prompt); it lists {st.inputs}",
                path=f"{where}.inputs",
                source=source,
            )
        (up,) = st.inputs
        p = index[up]
        if not stages[p].is_prefill_only:
            raise ConfigError(
                f"decode-only stage {st.id!r} takes its input from {up!r} "
                f"($.stages[{p}]), which is not a prefill-only stage "
                "(is_prefill_only: true): a decode stage loads the KV cache its prefill "
                "stage computed",
                path=f"{where}.inputs[0]",
                source=source,
            )
        if up in decode_of:
            raise ConfigError(
                f"prefill-only stage {up!r} already hands its KV cache to decode stage "
                f"{stages[decode_of[up]].id!r} ($.stages[{decode_of[up]}]); a prefill "
                "stage feeds one decode stage",
                path=f"{where}.inputs[0]",
                source=source,
            )
        decode_of[up] = i
        if st.input_processor is not None:
            raise ConfigError(
                f"decode-only stage {st.id!r} takes the same input as its prefill stage "
                f"{up!r} (the prompt whose KV cache it loads): it has no input_processor",
                path=f"{where}.input_processor",
                source=source,
            )
        pairs.append(PDPair(up, st.id, p, i, ""))
    for i, st in enumerate(stages):
        if st.is_prefill_only and st.id not in decode_of:
            raise ConfigError(
                f"prefill-only stage {st.id!r} has no decode-only stage (is_decode_only: "
                "true) listing it as its input: its KV cache would go nowhere",
                path=f"$.stages[{i}].is_prefill_only",
                source=source,
            )
        for j, up in enumerate(st.inputs):
            if up in decode_of and not st.is_decode_only:
                raise ConfigError(
                    f"stage {st.id!r} takes its input from prefill-only stage {up!r}, whose "
                    "output is the one token a prefill makes (thrown away); take it from "
                    f"its decode stage {stages[decode_of[up]].id!r} instead",
                    path=f"$.stages[{i}].inputs[{j}]",
                    source=source,
                )
    return pairs


def _check_flags(st: StageConfig, i: int, source: str | None) -> None:
    # Pure: the flags of one stage, and what a stage of a pair may not have.
    if not (st.is_prefill_only or st.is_decode_only):
        return
    flag = "is_prefill_only" if st.is_prefill_only else "is_decode_only"
    prefill = st.is_prefill_only
    rules = (  # (broken, the key to name, why)
        (
            st.backend not in PD_BACKENDS,
            flag,
            f"{flag} is for vllm stages (a vLLM engine with a KV connector; scripted stages "
            f"stand in for them in tests); stage {st.id!r} has backend {st.backend!r}",
        ),
        (
            prefill and st.is_decode_only,
            "is_decode_only",
            f"stage {st.id!r} is marked both is_prefill_only and is_decode_only; a stage is "
            "one half of a pair (a stage that does both needs neither flag)",
        ),
        (
            st.stream_input,
            "stream_input",
            f"{flag} stage {st.id!r} takes its input whole: the prefill computes the whole "
            "prompt's KV cache, and the decode starts once the prefill finished",
        ),
        (
            prefill and st.final_output,
            "final_output",
            f"prefill-only stage {st.id!r} outputs one throwaway token; mark its decode "
            "stage final_output instead",
        ),
        (
            prefill and st.prompt_expand is not None,
            "prompt_expand",
            f"prefill-only stage {st.id!r} cannot make CFG companions: each would need a "
            "decode of its own",
        ),
    )
    for broken, key, reason in rules:
        if broken:
            raise ConfigError(reason, path=f"$.stages[{i}].{key}", source=source)


def check_pd_pair(stages: Sequence[StageConfig], pair: PDPair, source: str | None = None) -> PDPair:
    """Check the KV transfer of ``pair`` (see the module docstring); the pair with its
    connector and whether it needs ``kv_transfer_params``. Pure. Raises
    :class:`ConfigError` naming the broken field (the decode stage's, for a mismatch)."""
    p, d = pair.prefill_index, pair.decode_index
    p_cfg = _kv_config(stages[p], p, "prefill", KV_PRODUCER_ROLES, source)
    d_cfg = _kv_config(stages[d], d, "decode", KV_CONSUMER_ROLES, source)
    d_where = f"$.stages[{d}].engine_args"
    p_conn, d_conn = p_cfg["kv_connector"], d_cfg["kv_connector"]
    if p_conn != d_conn:
        raise ConfigError(
            f"decode stage {pair.decode!r} uses kv_connector {d_conn!r} but its prefill stage "
            f"{pair.prefill!r} ($.stages[{p}]) uses {p_conn!r}: a pair hands the KV cache "
            "over through one connector",
            path=f"{d_where}.kv_transfer_config.kv_connector",
            source=source,
        )
    for key in _MATCHED_KEYS:
        p_val, d_val = p_cfg.get(key), d_cfg.get(key)
        if p_val is not None and d_val is not None and p_val != d_val:
            raise ConfigError(
                f"decode stage {pair.decode!r} has {key} {d_val!r} but its prefill stage "
                f"{pair.prefill!r} ($.stages[{p}]) has {p_val!r}: both ends of the transfer "
                "must buffer the KV cache alike",
                path=f"{d_where}.kv_transfer_config.{key}",
                source=source,
            )
    if p_conn in _SHARED_STORE_CONNECTORS:
        p_store, d_store = _store_of(p_cfg), _store_of(d_cfg)
        if p_store != d_store:
            raise ConfigError(
                f"decode stage {pair.decode!r} has {_STORE_KEY} {_shown(d_store)} but its "
                f"prefill stage {pair.prefill!r} ($.stages[{p}]) has {_shown(p_store)}: "
                f"{p_conn} hands the KV cache over in that directory (set it alike on both, "
                "or on neither), and a decode looking elsewhere silently recomputes",
                path=f"{d_where}.kv_transfer_config.kv_connector_extra_config.{_STORE_KEY}",
                source=source,
            )
    p_args, d_args = stages[p].engine_args, stages[d].engine_args
    for key, (default, why) in _SAME_ENGINE_ARGS.items():
        p_val, d_val = p_args.get(key, default), d_args.get(key, default)
        if p_val != d_val:
            raise ConfigError(
                f"decode stage {pair.decode!r} has {key} {_shown(d_val)} but its prefill "
                f"stage {pair.prefill!r} ($.stages[{p}]) has {_shown(p_val)}: {why}",
                path=f"{d_where}.{key}",
                source=source,
            )
    assert isinstance(p_conn, str)  # _kv_config checked it
    return PDPair(
        pair.prefill,
        pair.decode,
        p,
        d,
        p_conn,
        kv_params_required=p_conn not in KV_PARAMS_OPTIONAL_CONNECTORS,
    )


def _store_of(cfg: Mapping[str, object]) -> object:
    # Pure: the directory a connector's extra config names (a path normalised), or None.
    extra = cfg.get("kv_connector_extra_config")
    store = extra.get(_STORE_KEY) if isinstance(extra, Mapping) else None
    return os.path.normpath(store) if isinstance(store, str) and store else store


def kv_transfer_config(
    engine_args: Mapping[str, object], where: str, source: str | None
) -> Mapping[str, object] | None:
    """A stage's ``engine_args.kv_transfer_config`` (``where``: its engine_args' path), or
    None when it has none. Pure. Raises :class:`ConfigError` when it is not a mapping."""
    cfg = engine_args.get("kv_transfer_config")
    if cfg is not None and not isinstance(cfg, Mapping):
        raise ConfigError(
            f"kv_transfer_config must be a mapping of vLLM KVTransferConfig fields, not "
            f"{type(cfg).__name__}",
            path=f"{where}.kv_transfer_config",
            source=source,
        )
    return cfg


def _kv_config(
    st: StageConfig, i: int, half: str, roles: tuple[str, ...], source: str | None
) -> Mapping[str, object]:
    # Pure: one half's kv_transfer_config, checked alone.
    where = f"$.stages[{i}].engine_args"
    cfg = kv_transfer_config(st.engine_args, where, source)
    if cfg is None:
        raise ConfigError(
            f"{half} stage {st.id!r} needs engine_args.kv_transfer_config: the vLLM KV "
            f"connector that hands the cache over (kv_connector, kv_role: {' or '.join(roles)})",
            path=where,
            source=source,
        )
    where += ".kv_transfer_config"
    connector = cfg.get("kv_connector")
    if not isinstance(connector, str) or not connector:
        raise ConfigError(
            f"{half} stage {st.id!r} needs a kv_connector (the name of a vLLM KV connector, "
            f"e.g. NixlConnector), got {connector!r}",
            path=f"{where}.kv_connector",
            source=source,
        )
    role = cfg.get("kv_role")
    if role not in roles:
        raise ConfigError(
            f"the {half} stage's kv_role must be {' or '.join(repr(r) for r in roles)}, "
            f"got {role!r}",
            path=f"{where}.kv_role",
            source=source,
        )
    return cfg
