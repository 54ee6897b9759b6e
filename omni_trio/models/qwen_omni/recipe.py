"""What the tiny Qwen-Omni recipes share: the build of a whole checkpoint from a family's
tokenizer, config, seeded init and forward check (:mod:`~omni_trio.models.qwen_omni.qwen3`,
:mod:`~omni_trio.models.qwen_omni.qwen25`). Blocking; torch and transformers are imported
when called."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from ..building import save_quietly
from ..progress import report_step
from .tokenizer import FAMILY_TOKENS, build_tokenizer, token_ids

__all__ = ["FamilySpec", "build_checkpoint"]


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """What a tiny Qwen-Omni preset is made of: its family's recipe, the weights' seed and
    dtype. Equal specs build identical files."""

    family: str
    seed: int
    dtype: str = "float32"

    def digest_fields(self) -> dict[str, object]:
        return asdict(self)


def build_checkpoint(
    family: str,
    seed: int,
    dtype: str,
    out: Path,
    *,
    label: str,
    progress: bool,
    model_class: str,
    make_config: Callable[[dict[str, int], int], Any],
    init: Callable[[Any, int], None],
    check: Callable[[Any, dict[str, int]], None],
    parts: Sequence[str],
    float32_parts: Sequence[str] = (),
) -> tuple[Any, dict[str, int]]:
    """Train the family's tokenizer, build ``transformers.<model_class>`` from
    ``make_config(ids, vocab size)``, ``init(model, seed)``, cast to ``dtype`` (but
    ``float32_parts``), ``check(model, ids)``, and save tokenizer, weights and the parameter
    count of each of ``parts`` into ``out``. Returns (model, token ids) for what a family
    saves besides."""
    import torch

    # transformers' classes are untyped: held as Any
    transformers: Any = import_module("transformers")

    report_step(label, 1, 4, "training the tokenizer", echo=progress)
    fast = build_tokenizer(family)
    ids = token_ids(fast, FAMILY_TOKENS[family].specials)
    report_step(label, 2, 4, f"initialising weights (seed {seed})", echo=progress)
    model = getattr(transformers, model_class)(make_config(ids, len(fast))).eval()
    init(model, seed)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], do_sample=False
    )
    model.to(getattr(torch, dtype))
    for part in float32_parts:
        getattr(model, part).float()
    report_step(label, 3, 4, "checking one forward pass", echo=progress)
    check(model, ids)
    report_step(label, 4, 4, f"saving ({dtype})", echo=progress)
    fast.save_pretrained(out)
    save_quietly(transformers, model, out)
    counts = {k: sum(p.numel() for p in getattr(model, k).parameters()) for k in parts}
    (out / "omni_trio_build.json").write_text(json.dumps({"parameters": counts}, indent=1))
    return model, ids
