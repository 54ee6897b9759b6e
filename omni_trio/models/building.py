"""What the tiny-model builders share: the corpus their tokenizers are trained on, and saving
a transformers model quietly. Blocking helpers; transformers is imported by the caller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CORPUS_WORDS", "save_quietly"]

#: the words of the tiny tokenizers' training corpus (English-like: enough distinct pairs
#: for a few hundred BPE merges)
CORPUS_WORDS: tuple[str, ...] = tuple(
    (
        "the a an of to in and is it that for on with as was by at be this from or have "
        "not are but had they you he she we his her one all there their which were when "
        "sound voice speech audio model stage token stream think talk answer question "
        "hello world tiny omni trio nursery engine request output input wave signal word "
        "time day night sun moon river light music song story city road tree water fire"
    ).split()
)


def save_quietly(transformers: Any, model: Any, out: Path) -> None:
    """``model.save_pretrained(out)`` (safetensors) without transformers' own "Writing model
    shards" bar, which would cut into the caller's progress display."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
