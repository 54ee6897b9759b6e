"""What the torch backend runs in its worker threads: loading the module, running one batch.

Everything here is blocking and thread-safe (no trio calls). torch is imported on first use,
so importing this module (and :mod:`omni_trio.backends.torch.backend`) stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import BackendUnavailableError, ConfigError

__all__ = ["ModuleInfo", "WorkItem", "forward_batch", "import_torch", "load_module"]


def import_torch() -> Any:
    """``import torch``, or :class:`BackendUnavailableError` with the install hint."""
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the torch backend needs torch ({exc}); pip install 'omni-trio[torch]'"
        ) from exc
    return torch


@dataclass(frozen=True, slots=True)
class ModuleInfo:
    """A loaded module and what the backend learnt about it (see the module protocol)."""

    module: Any
    torch: Any
    sample_rate: int | None
    hop_length: int | None
    vocab_size: int | None
    context_codes: int
    num_parameters: int
    factory: str
    frame_size: int = 1
    output_delay: int = 0

    def describe(self) -> dict[str, Any]:
        return {
            "sample_rate": self.sample_rate,
            "hop_length": self.hop_length,
            "vocab_size": self.vocab_size,
            "context_codes": self.context_codes,
            "frame_size": self.frame_size,
            "output_delay": self.output_delay,
            "num_parameters": self.num_parameters,
            "factory": self.factory,
            "module": type(self.module).__name__,
        }

    def empty(self) -> Any:
        import numpy as np

        return np.zeros(0, dtype=np.float32)


def _optional_int(module: Any, name: str, factory: str) -> int | None:
    value = getattr(module, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"module from {factory!r}: {name} must be an int >= 0, got {value!r}")
    return value


def load_module(
    factory: str | Callable[[dict[str, Any]], Any],
    options: Mapping[str, Any],
    torch_threads: int | None,
) -> ModuleInfo:
    """Import ``factory`` (``"package.module:callable"``), call it with ``options``, check the
    result against the module protocol with a one-code warm-up run. Blocking.

    Raises :class:`BackendUnavailableError` without torch, :class:`ConfigError` for a factory
    that cannot be imported, fails, or returns something that breaks the protocol.
    """
    torch = import_torch()
    if torch_threads is not None:
        torch.set_num_threads(int(torch_threads))
    if callable(factory):
        fn = factory
        factory = getattr(factory, "__qualname__", repr(factory))
    else:
        module_name, _, attr = factory.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            if isinstance(exc, BackendUnavailableError):
                raise
            raise ConfigError(f"cannot load torch module factory {factory!r}: {exc}") from exc
    try:
        module = fn(dict(options))
    except (ConfigError, BackendUnavailableError):
        raise
    except Exception as exc:
        raise ConfigError(
            f"torch module factory {factory!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(module):
        raise ConfigError(f"torch module factory {factory!r} returned a non-callable {module!r}")
    if hasattr(module, "eval"):
        module.eval()
    hop = _optional_int(module, "hop_length", factory)
    vocab = _optional_int(module, "vocab_size", factory)
    frame = _optional_int(module, "frame_size", factory) or 1
    delay = _optional_int(module, "output_delay", factory) or 0
    context = _optional_int(module, "context_codes", factory) or 0
    if context % frame:
        raise ConfigError(
            f"module from {factory!r}: context_codes={context} is not a whole number of "
            f"frames of frame_size={frame} codes"
        )
    with torch.inference_mode():
        probe = module(torch.zeros((1, frame), dtype=torch.long))
    if not hasattr(module, "hop_length") and probe.dim() >= 2:
        hop = int(probe.shape[1])  # one frame -> hop outputs along dim 1
    if hop is not None and (probe.dim() < 2 or probe.shape[0] != 1 or probe.shape[1] != hop):
        raise ConfigError(
            f"module from {factory!r} maps codes [1, {frame}] to shape {tuple(probe.shape)}; "
            f"the protocol wants [1, hop_length={hop}, ...]"
        )
    if hop is not None and delay >= hop:
        raise ConfigError(
            f"module from {factory!r}: output_delay={delay} must be below hop_length={hop}"
        )
    params = getattr(module, "parameters", None)
    n_params = sum(p.numel() for p in params()) if params is not None else 0
    return ModuleInfo(
        module=module,
        torch=torch,
        sample_rate=_optional_int(module, "sample_rate", factory),
        hop_length=hop,
        vocab_size=vocab,
        context_codes=context,
        num_parameters=n_params,
        factory=factory,
        frame_size=frame,
        output_delay=delay,
    )


#: one work item: (codes window, frames of left context to drop, outputs to drop after them)
WorkItem = tuple[Sequence[int], int, int]


def _run(info: ModuleInfo, items: Sequence[WorkItem]) -> list[Any]:
    torch = info.torch
    longest = max(len(window) for window, _, _ in items)
    codes = torch.zeros((len(items), longest), dtype=torch.long)  # right padding: code 0
    for row, (window, _, _) in enumerate(items):
        codes[row, : len(window)] = torch.tensor(window, dtype=torch.long)
    with torch.inference_mode():
        out = info.module(codes)
    if out.shape[0] != len(items):
        raise RuntimeError(f"module returned {out.shape[0]} rows for a batch of {len(items)}")
    frames = longest // info.frame_size
    if info.hop_length is not None and out.shape[1] != frames * info.hop_length:
        raise RuntimeError(
            f"module returned {out.shape[1]} outputs for {frames} frames; "
            f"hop_length={info.hop_length} wants {frames * info.hop_length}"
        )
    if out.is_floating_point():
        out = out.to(torch.float32)
    results = []
    for row, (window, trim, lead) in enumerate(items):
        if info.hop_length is None:
            part = out[row]
        else:
            end = len(window) // info.frame_size * info.hop_length
            part = out[row, trim * info.hop_length + lead : end]
        # a copy: a view would keep the whole batch's buffer alive
        results.append(part.detach().cpu().numpy().copy())
    return results


def forward_batch(info: ModuleInfo, items: Sequence[WorkItem]) -> list[Any]:
    """Run ``items`` (:data:`WorkItem`) as one padded batch;
    return one numpy array per item, or the exception that item raised. Blocking.

    If the batch fails, each item is retried alone, so one request that breaks the module
    fails only itself.
    """
    try:
        return _run(info, items)
    except Exception as exc:
        if len(items) == 1:
            return [exc]
    results: list[Any] = []
    for item in items:
        try:
            results.extend(_run(info, [item]))
        except Exception as exc:
            results.append(exc)
    return results
