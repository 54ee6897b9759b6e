"""Loading one part of a Qwen-Omni checkpoint (the talker, the vocoder) without the rest.

A Qwen-Omni checkpoint holds the thinker, the talker and the vocoder in one set of
safetensors files. A stage that runs one part loads only that part's tensors: building the
whole model would cost the thinker's weights (the largest part, which the vllm stage already
holds) in every talker and vocoder replica. Checkpoints keep mixture-of-experts weights one
expert at a time (``experts.N.{gate,up,down}_proj.weight``) while transformers' modules hold
them fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``):
``from_pretrained`` converts them on load, so loading a part alone converts them here.

Everything here is blocking; torch and safetensors are imported when called.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import ConfigError

__all__ = [
    "checkpoint_tensors",
    "fuse_experts",
    "load_part",
    "module_checkpoint",
    "read_config",
]

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def read_config(path: str | Path) -> Any:
    """The checkpoint's top-level transformers config. Raises :class:`ConfigError` when the
    directory holds no config transformers knows."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a model checkpoint transformers can read: {exc}") from exc


def module_checkpoint(
    owner: str, options: Mapping[str, Any], allowed: set[str], model_type: str
) -> tuple[str, Any]:
    """(path, config) of the checkpoint a torch-backend module factory's ``options["model"]``
    names (a directory, or a ``tiny:`` preset, built if needed). Blocking. Raises
    :class:`ConfigError`, prefixed with ``owner``, for an option not in ``allowed``, a missing
    ``model`` or a checkpoint of another ``model_type``."""
    from ..tiny import resolve_model

    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"{owner}: unknown options {unknown}; options are {sorted(allowed)}")
    if "model" not in options:
        raise ConfigError(
            f"{owner}: options.model (a checkpoint directory or tiny: preset) is required"
        )
    path = resolve_model(str(options["model"]))
    config = read_config(path)
    found = getattr(config, "model_type", None)
    if found != model_type:
        raise ConfigError(f"{owner}: {path} is model_type {found!r}, not a {model_type} checkpoint")
    return path, config


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ConfigError(f"{path}: no safetensors weights in the checkpoint directory")
    return shards


def checkpoint_tensors(path: str | Path, prefix: str) -> dict[str, Any]:
    """Every tensor whose name starts with ``prefix``, keyed by the rest of its name."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for shard in _shards(Path(path)):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = f.get_tensor(key)
    if not out:
        raise ConfigError(f"{path}: the checkpoint has no tensor named {prefix}*")
    return out


def fuse_experts(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Per-expert MoE weights fused the way transformers' modules hold them; every other
    tensor unchanged. Pure (builds new tensors)."""
    import torch

    groups: dict[str, dict[tuple[int, str], Any]] = {}
    out: dict[str, Any] = {}
    for key, value in tensors.items():
        m = _EXPERT.match(key)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
        else:
            out[key] = value
    for base, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat((parts[e, "gate_proj"], parts[e, "up_proj"]), 0) for e in range(n)]
        )
        out[f"{base}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(n)])
    return out


def load_part(cls: Any, sub_config: Any, path: str | Path, prefix: str, dtype: Any) -> Any:
    """Build ``cls`` from ``sub_config`` and load its weights (``prefix``) strictly from the
    checkpoint at ``path``; returns it in eval mode. Raises :class:`ConfigError` naming the
    tensors when the checkpoint and the config disagree."""
    import torch

    with torch.device("meta"):
        module = cls._from_config(sub_config, dtype=dtype)
    tensors = fuse_experts(checkpoint_tensors(path, prefix))
    buffers = dict(module.named_buffers())
    missing, unexpected = module.load_state_dict(
        {k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True
    )
    missing = [m for m in missing if m not in buffers]
    if missing or unexpected:
        raise ConfigError(
            f"{path}: the checkpoint's {prefix}* tensors do not fit {cls.__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    # non-persistent buffers (rotary frequencies, code offsets) are not in checkpoints
    meta = [n for n, b in module.named_buffers() if b.is_meta]
    if meta:
        fresh = dict(cls._from_config(sub_config, dtype=dtype).named_buffers())
        for name in meta:
            owner, _, leaf = name.rpartition(".")
            (module.get_submodule(owner) if owner else module)._buffers[leaf] = fresh[name]
    return module.eval()
