"""Load-time checks of a vllm stage's ``engine_args`` and ``default_sampling_params``.

Keys are checked against ``vllm.AsyncEngineArgs`` fields and ``vllm.SamplingParams`` fields
(and ``engine_args.kv_transfer_config``'s against ``KVTransferConfig``'s),
so a typo fails ``omni-trio validate`` instead of an engine start ~20 s later. Types are checked
where that is cheap and safe: an engine arg whose annotation is made of plain types (int, float,
bool, str, None, literals, lists and dicts of those) is converted with msgspec; sampling params
are converted with ``SamplingParams`` itself (it is a msgspec Struct, whose ``__post_init__``
also checks values). Skipped without a word when vllm is not importable: the stage's start
reports that. The first check imports vllm's ``arg_utils`` and ``sampling_params`` (about 7 s
on a 2-core CPU machine, once per process; an engine start in the same process pays it anyway).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
import threading
import types
import typing
from collections.abc import Mapping
from functools import cache
from types import SimpleNamespace
from typing import Literal, cast

import msgspec

from ..errors import ConfigError
from .pd import kv_transfer_config
from .reading import explain_validation_error, with_value

__all__ = ["VLLM_IMPORT_LOCK", "check_vllm_stage", "engine_arg_types"]

#: held by every import of vllm in this process (the checks here, each vllm replica's
#: worker): two threads importing vllm at once can deadlock on its import cycles
VLLM_IMPORT_LOCK = threading.Lock()

_ATOMS = (int, float, bool, str, type(None))


def _is_plain(tp: object) -> bool:
    """Whether msgspec can check ``tp`` exactly as vLLM means it (no custom classes). Pure."""
    if tp in _ATOMS:
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return all(isinstance(a, (str, int)) for a in args)
    if origin in (typing.Union, types.UnionType, list, dict):
        return bool(args) and all(_is_plain(a) for a in args)
    return False


def _resolve(annotation: object, owner: type) -> object:
    if not isinstance(annotation, str):
        return annotation
    for cls in owner.__mro__:
        module = sys.modules.get(cls.__module__)
        if module is None:
            continue
        try:
            return eval(annotation, vars(module))  # vLLM's own annotation text
        except Exception:
            continue
    return None


@cache
def engine_arg_types(engine_args_cls: type) -> dict[str, object]:
    """Field name -> type to check (``None``: only the key is checked) for AsyncEngineArgs."""
    out: dict[str, object] = {}
    for field in dataclasses.fields(engine_args_cls):
        tp = _resolve(field.type, engine_args_cls)
        # vLLM annotates some fields `int` with a None default: None is always allowed
        out[field.name] = (cast(type, tp) | None) if tp is not None and _is_plain(tp) else None
    return out


def _vllm() -> SimpleNamespace | None:
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        return None
    # only the two modules checked here (not AsyncLLM), under the lock every import of vllm
    # in this process takes
    with VLLM_IMPORT_LOCK:
        try:
            from vllm.config.kv_transfer import KVTransferConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.sampling_params import SamplingParams
        except ImportError:
            return None  # a broken install: the stage's start reports it
    return SimpleNamespace(
        AsyncEngineArgs=AsyncEngineArgs,
        SamplingParams=SamplingParams,
        KVTransferConfig=KVTransferConfig,
    )


def _unknown(kind: str, key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{key!r} is not a vllm {kind} field{hint}"


def _check_kv_transfer_config(
    v: SimpleNamespace, engine_args: Mapping[str, object], where: str, source: str | None
) -> None:
    # its keys against vLLM's KVTransferConfig (a config of another vLLM version may name
    # fields this one does not have: kv_buffer_size, kv_parallel_size); the values are
    # vLLM's to check when the engine starts (config/pd.py checks a pair's)
    kv = kv_transfer_config(engine_args, f"{where}.engine_args", source)
    if kv is None:
        return
    path = f"{where}.engine_args.kv_transfer_config"
    known = [f.name for f in dataclasses.fields(v.KVTransferConfig)]
    for key in kv:
        if key not in known:
            raise ConfigError(
                _unknown("KVTransferConfig", str(key), known), path=f"{path}.{key}", source=source
            )


def check_vllm_stage(
    engine_args: Mapping[str, object],
    sampling_params: Mapping[str, object],
    where: str,
    source: str | None,
) -> None:
    """Check a vllm stage's ``engine_args`` and ``default_sampling_params`` (``where`` is the
    stage's path). Blocking on the first call (imports vllm). Raises :class:`ConfigError`."""
    v = _vllm()
    if v is None:
        return
    fields = engine_arg_types(v.AsyncEngineArgs)
    for key, value in engine_args.items():
        path = f"{where}.engine_args.{key}"
        if key not in fields:
            raise ConfigError(_unknown("AsyncEngineArgs", key, fields), path=path, source=source)
        tp = fields[key]
        if tp is not None:
            try:
                msgspec.convert(value, tp)
            except msgspec.ValidationError as exc:
                reason = with_value(str(exc).split(" - at ", 1)[0], value)
                raise ConfigError(reason, path=path, source=source) from None
    _check_kv_transfer_config(v, engine_args, where, source)
    known = v.SamplingParams.__struct_fields__
    for key in sampling_params:
        if key not in known:
            raise ConfigError(
                _unknown("SamplingParams", key, known),
                path=f"{where}.default_sampling_params.{key}",
                source=source,
            )
    try:
        msgspec.convert(dict(sampling_params), v.SamplingParams)
    except msgspec.ValidationError as exc:
        reason, path = explain_validation_error(exc, dict(sampling_params))
        raise ConfigError(
            reason, path=f"{where}.default_sampling_params{path[1:]}", source=source
        ) from None
    except Exception as exc:  # SamplingParams.__post_init__'s value checks (vLLM's types)
        param = getattr(exc, "parameter", None)
        suffix = f".{param}" if isinstance(param, str) and param in known else ""
        raise ConfigError(
            f"{type(exc).__name__}: {exc}",
            path=f"{where}.default_sampling_params{suffix}",
            source=source,
        ) from None
