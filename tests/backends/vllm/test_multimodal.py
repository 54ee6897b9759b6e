"""Multimodal UUIDs scoped per replica (issue 10, item 6): the pure parts and the wiring."""

import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio import InvalidRequestError, load_config
from omni_trio.backends.vllm.backend import VllmBackend
from omni_trio.backends.vllm.multimodal import content_hash, replica_scope, scoped_mm_uuids
from omni_trio.backends.vllm.prompts import engine_prompt, split_items
from omni_trio.outputs import StageInput


def image(color=(10, 20, 30)):
    return Image.new("RGB", (8, 8), color)


def test_two_replicas_get_different_uuids_for_the_same_data():
    data = {"image": image()}
    a = scoped_mm_uuids("thinker", 0, data)
    b = scoped_mm_uuids("thinker", 1, data)
    digest = content_hash(image())
    assert a == {"image": [f"thinker:0:{digest}"]}
    assert b == {"image": [f"thinker:1:{digest}"]}
    assert scoped_mm_uuids("talker", 0, data) != a


def test_same_replica_and_same_content_give_the_same_uuid():
    first = scoped_mm_uuids("s", 1, {"image": image(), "audio": (np.ones(160, np.float32), 16000)})
    again = scoped_mm_uuids("s", 1, {"image": image(), "audio": (np.ones(160, np.float32), 16000)})
    assert first == again
    other = scoped_mm_uuids("s", 1, {"image": image((10, 20, 31)), "audio": (np.ones(160), 8000)})
    assert other["image"] != first["image"] and other["audio"] != first["audio"]


def test_given_uuids_are_scoped_and_missing_ones_hashed():
    data = {"image": [image(), image((1, 1, 1))], "video": None}
    uuids = scoped_mm_uuids("s", 2, data, {"image": ["cat", None], "video": "clip-7"})
    assert uuids == {
        "image": ["s:2:cat", f"s:2:{content_hash(image((1, 1, 1)))}"],
        "video": ["s:2:clip-7"],  # cached on the replica already: referred to by uuid alone
    }
    assert scoped_mm_uuids("s", 0, {"image": image()}, {"image": "cat"}) == {"image": ["s:0:cat"]}
    # an item with neither data nor uuid, or a count vLLM will reject, is left for vLLM to name
    assert scoped_mm_uuids("s", 0, {"image": [None, image()]}) == {
        "image": [None, f"s:0:{content_hash(image())}"]
    }
    assert scoped_mm_uuids("s", 0, {"image": [image(), image()]}, {"image": ["x"]}) == {
        "image": ["s:0:x"]
    }


def test_several_items_of_a_modality_get_one_uuid_each():
    images = [image((i, i, i)) for i in range(3)]
    uuids = scoped_mm_uuids("s", 1, {"image": images})["image"]
    assert uuids == [f"s:1:{content_hash(im)}" for im in images]
    assert len(set(uuids)) == 3


def test_content_hash_follows_content_not_identity():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert content_hash(a) == content_hash(a.copy())
    assert content_hash(a.T) == content_hash(np.ascontiguousarray(a.T))
    assert content_hash(a) != content_hash(a.astype(np.float64))  # dtype counts
    assert content_hash(a) != content_hash(a.reshape(4, 3))  # shape counts
    t = torch.arange(6.0).reshape(2, 3)
    assert content_hash(t) == content_hash(t.clone())
    assert content_hash(t) != content_hash(t.to(torch.bfloat16))
    assert content_hash(t.to(torch.bfloat16)) == content_hash(t.clone().to(torch.bfloat16))
    assert content_hash(image()) != content_hash(image().convert("P"))  # mode counts
    assert content_hash((a, 16000)) != content_hash([a, 16000])
    assert content_hash({"x": 1, "y": 2}) == content_hash({"y": 2, "x": 1})
    # an object nothing can serialize never shares a key, not even with itself
    unpicklable = lambda: None  # noqa: E731
    assert content_hash(unpicklable) != content_hash(unpicklable)


def test_replica_scope_only_for_an_entry_stage_with_company():
    assert replica_scope("s", 0, replicas=1, entry=True) is None
    assert replica_scope("s", 0, replicas=2, entry=True) == ("s", 0)
    assert replica_scope("s", 1, replicas=1, entry=True) == ("s", 1)  # added at run time
    assert replica_scope("s", 1, replicas=2, entry=False) is None


def test_engine_prompt_scopes_a_multimodal_prompt_dict_only():
    prompt = {"prompt": "<image> what is this?", "multi_modal_data": {"image": image()}}
    chunk = StageInput(data=prompt)
    scoped = engine_prompt(chunk, ("s", 1))
    assert scoped == {**prompt, "multi_modal_uuids": {"image": [f"s:1:{content_hash(image())}"]}}
    assert "multi_modal_uuids" not in prompt  # the request's own dict is not changed
    assert engine_prompt(chunk) is prompt  # one replica: unchanged
    text_only = StageInput(data={"prompt": "hi"})
    assert engine_prompt(text_only, ("s", 1)) == {"prompt": "hi"}
    assert engine_prompt(StageInput(token_ids=(1, 2)), ("s", 1)) == {"prompt_token_ids": [1, 2]}
    enc_dec = {"encoder_prompt": prompt, "decoder_prompt": "a"}
    assert engine_prompt(StageInput(data=enc_dec), ("s", 0))["encoder_prompt"][
        "multi_modal_uuids"
    ] == {"image": [f"s:0:{content_hash(image())}"]}
    with pytest.raises(InvalidRequestError, match="needs a text prompt, token ids or a prompt"):
        engine_prompt(StageInput(), ("s", 0))


def _config(replicas):
    stage = {
        "id": "thinker",
        "backend": "vllm",
        "engine_args": {"model": "tiny:llama"},
        "replicas": replicas,
    }
    talker = {"id": "talker", "backend": "vllm", "inputs": ["thinker"], "final_output": True}
    return load_config({"stages": [stage, talker]}, check_vllm=False)


def test_vllm_backend_scopes_entry_stage_replicas_when_there_are_several():
    two = _config(2)
    assert VllmBackend(two.stages[0], stage_index=0, replica=1).mm_scope == ("thinker", 1)
    assert VllmBackend(two.stages[1], stage_index=1, replica=0).mm_scope is None
    one = _config(1)
    assert VllmBackend(one.stages[0], stage_index=0, replica=0).mm_scope is None


@pytest.mark.slow
def test_uuids_match_vllms_own_split_of_the_items():
    """Split by vLLM's real parser, the UUIDs pass vLLM's own count check."""
    pytest.importorskip("vllm")
    import vllm  # noqa: F401  (vllm.multimodal needs vllm imported first)
    from vllm.multimodal.parse import MultiModalDataParser, parse_mm_uuids
    from vllm.renderers.base import BaseRenderer

    frames = [np.zeros((4, 4, 3), np.uint8) + i for i in range(3)]
    data = {
        "image": np.zeros((2, 4, 4, 3), np.uint8),  # a batch: two images
        "video": frames,  # frames: one video
        "audio": (np.ones(16, np.float32), 16000),  # (waveform, rate): one clip
    }
    parse = MultiModalDataParser(target_sr=16000).parse_mm_data
    prompt = engine_prompt(
        StageInput(data={"prompt": "x", "multi_modal_data": data}),
        ("s", 1),
        lambda d: split_items(parse, d),
    )
    uuids = prompt["multi_modal_uuids"]
    assert {m: len(u) for m, u in uuids.items()} == {"image": 2, "video": 1, "audio": 1}
    assert uuids["image"][0] == uuids["image"][1]  # two equal images: one key
    assert all(u.startswith("s:1:") for us in uuids.values() for u in us)
    # vLLM's renderer check (it uses nothing of the renderer itself) accepts them
    BaseRenderer._validate_mm_uuids(None, data, parse(data), parse_mm_uuids(uuids))
    # the naive split (no vLLM parser) would miscount the batch, and vLLM would say so
    naive = engine_prompt(StageInput(data={"prompt": "x", "multi_modal_data": data}), ("s", 1))
    with pytest.raises(ValueError, match="must have same length"):
        BaseRenderer._validate_mm_uuids(
            None, data, parse(data), parse_mm_uuids(naive["multi_modal_uuids"])
        )
