"""Multimodal cache keys scoped to one replica of a vLLM stage.

vLLM identifies each multimodal item (an image, an audio clip, ...) by a UUID: the prompt's
``multi_modal_uuids`` when given, else a hash of the item. Its processor cache, encoder cache
and prefix cache all key on it, and a sender that believes an item is cached may send the key
alone. With several replicas of a stage, a key known to one replica says nothing about
another, so the keys of an entry-stage prompt are scoped to the replica it is bound to:
``<stage>:<replica>:<content hash>``, or ``<stage>:<replica>:<given uuid>`` when the user gave
one. A hit can then only ever come from the replica that received the data.

:func:`content_hash` and :func:`scoped_mm_uuids` are pure and import neither vllm nor numpy;
the vllm worker applies them (:func:`omni_trio.backends.vllm.prompts.engine_prompt`) with
vLLM's own split of a modality's data into items.
"""

from __future__ import annotations

import hashlib
import pickle
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["MmUuids", "content_hash", "modality_items", "replica_scope", "scoped_mm_uuids"]

#: ``multi_modal_uuids`` as vLLM takes it: per modality one UUID or one per item (``None``:
#: vLLM hashes that item itself)
MmUuids = Mapping[str, Sequence[str | None] | str]


def _framed(tag: bytes, data: bytes | memoryview) -> Iterator[bytes | memoryview]:
    # a tag and a length before every part: no two different structures feed the same bytes
    yield tag + len(data).to_bytes(8, "little")
    yield data


def _tensor_parts(item: object) -> Iterator[bytes | memoryview] | None:
    """A torch tensor's dtype, shape and bytes (torch tensors have no buffer protocol)."""
    if not type(item).__module__.startswith("torch") or not hasattr(item, "detach"):
        return None
    tensor = item.detach().cpu().contiguous()
    try:
        array = tensor.numpy()
    except TypeError:  # bfloat16 and float8 have no numpy dtype; float32 holds them exactly
        array = tensor.float().numpy()
    meta = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    return iter((*_framed(b"t", meta), *_framed(b"d", memoryview(array).cast("B"))))


def _parts(item: object) -> Iterator[bytes | memoryview]:
    """The bytes that identify ``item``'s content, framed. Raises what pickle raises for an
    object none of the known kinds covers and pickle cannot serialize."""
    if item is None or isinstance(item, (bool, int, float, complex)):
        yield from _framed(b"n", repr(item).encode())  # repr of a float round-trips exactly
    elif isinstance(item, str):
        yield from _framed(b"s", item.encode("utf-8", "surrogatepass"))
    elif isinstance(item, (bytes, bytearray)):
        yield from _framed(b"b", bytes(item))
    elif isinstance(item, Mapping):
        # in the order of the keys' digests: equal mappings hash alike, whatever their order
        entries = sorted(((content_hash(k), v) for k, v in item.items()), key=lambda e: e[0])
        yield from _framed(b"m", len(entries).to_bytes(8, "little"))
        for key, value in entries:
            yield from _framed(b"k", key.encode())
            yield from _parts(value)
    elif isinstance(item, (list, tuple)):
        yield from _framed(
            b"l" if isinstance(item, list) else b"u", len(item).to_bytes(8, "little")
        )
        for element in item:
            yield from _parts(element)
    elif (tensor := _tensor_parts(item)) is not None:
        yield from tensor
    elif all(hasattr(item, a) for a in ("getpalette", "tobytes", "mode", "size")):  # PIL image
        image: Any = item
        yield from _framed(b"i", f"{image.mode}{image.size}{image.getpalette()}".encode())
        yield from _framed(b"d", image.tobytes())
    else:
        try:  # numpy arrays and anything else with the buffer protocol
            view = memoryview(item)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # no buffer, or one of objects (dtype=object)
            yield from _framed(b"p", pickle.dumps(item, protocol=5))
            return
        yield from _framed(b"a", f"{view.format}{view.shape}".encode())
        yield from _framed(b"d", view.cast("B") if view.c_contiguous else view.tobytes())


def content_hash(item: object) -> str:
    """A SHA-256 hex digest of one multimodal item's content: equal content (and type of
    container, dtype, shape, image mode) gives the same digest in every process and run.

    Covers str, bytes, numbers, None, lists, tuples, mappings, numpy arrays and other buffer
    objects, torch tensors and PIL images; anything else is hashed through pickle. Pure.
    An item pickle cannot serialize gets a random digest, so it never hits a cache (a miss
    costs time; a wrong hit would feed the model another item's data).
    """
    digest = hashlib.sha256()
    try:
        for part in _parts(item):
            digest.update(part)
    except Exception:  # an unpicklable object: no stable identity, so no identity shared
        return "unhashable-" + uuid.uuid4().hex
    return digest.hexdigest()


def modality_items(data: object) -> list[object]:
    """The items of one modality's data when vLLM's own split is not at hand: each element
    of a list, else the value as one item (``None``: no items). Pure."""
    if data is None:
        return []
    return list(data) if isinstance(data, list) else [data]


def scoped_mm_uuids(
    stage_id: str,
    replica: int,
    multi_modal_data: Mapping[str, object],
    given_uuids: MmUuids | None = None,
) -> dict[str, list[str | None]]:
    """``multi_modal_uuids`` for a prompt bound to replica ``replica`` of ``stage_id``: per
    modality, one ``"<stage>:<replica>:<key>"`` per item, ``key`` being the user's UUID for
    that item when ``given_uuids`` has one, else the item's :func:`content_hash`.

    ``multi_modal_data`` maps each modality to its data, split into items by
    :func:`modality_items`. An item with neither data nor a given UUID keeps ``None`` (vLLM
    rejects it, naming it), as does a list of given UUIDs whose length differs from the
    items' (vLLM rejects that too). Pure.
    """
    scope = f"{stage_id}:{replica}:"
    given_uuids = given_uuids or {}
    result: dict[str, list[str | None]] = {}
    for modality in (*multi_modal_data, *(m for m in given_uuids if m not in multi_modal_data)):
        items = modality_items(multi_modal_data.get(modality))
        given = given_uuids.get(modality)
        if isinstance(given, str):
            keys: list[str | None] = [given]
        else:
            keys = list(given) if given else [None] * len(items)
        if len(keys) == len(items):
            keys = [
                content_hash(item) if key is None and item is not None else key
                for key, item in zip(keys, items, strict=True)
            ]
        if keys:
            result[modality] = [None if key is None else scope + key for key in keys]
    return result


def replica_scope(
    stage_id: str, replica: int, *, replicas: int, entry: bool
) -> tuple[str, int] | None:
    """The scope of a replica's multimodal UUIDs: ``(stage_id, replica)`` for a replica of an
    entry stage (``entry``: it takes the user's prompt) that has company, else ``None`` (the
    prompts stay as given). Company: ``replicas > 1`` configured, or an index past the
    configured ones (a replica added at run time). Pure."""
    return (stage_id, replica) if entry and (replicas > 1 or replica > 0) else None
