"""Prefill/decode pairs in the config (``omni_trio.config.pd``): which stages pair up, and
every check at load, each a ConfigError naming the broken field's path (through
``load_config``, as ``omni-trio validate`` runs it, and the pure functions alone)."""

from __future__ import annotations

import copy

import pytest

from omni_trio import ConfigError, load_config
from omni_trio.cli.main import main
from omni_trio.config.pd import PDPair, check_pd_pair, find_pd_pairs, pd_pairs

from .test_loading import stage
from .test_reading import write as write_config


def kv(role: str, connector: str = "NixlConnector", **more: object) -> dict[str, object]:
    return {"kv_transfer_config": {"kv_connector": connector, "kv_role": role, **more}}


def store(path: str) -> dict[str, object]:
    return {"kv_connector_extra_config": {"shared_storage_path": path}}


def prefill(sid: str = "p", inputs: list[str] | None = None, **kw: object) -> dict[str, object]:
    return stage(
        sid, inputs=inputs or [], is_prefill_only=True, engine_args=kv("kv_producer"), **kw
    )


def decode(sid: str = "d", up: str = "p", **kw: object) -> dict[str, object]:
    kw.setdefault("final_output", True)
    return stage(sid, inputs=[up], is_decode_only=True, engine_args=kv("kv_consumer"), **kw)


def pd(*more: dict[str, object]) -> dict[str, object]:
    """A pipeline: prefill p -> decode d, then ``more`` stages."""
    return {"name": "pd", "stages": [prefill(), decode(), *more]}


def error(data: dict[str, object]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(data, check_vllm=False)
    return info.value


# -- pair detection -----------------------------------------------------------------------


def test_a_pair_is_detected_with_its_connector():
    cfg = load_config(pd())
    assert pd_pairs(cfg.stages, cfg.source) == (
        PDPair("p", "d", 0, 1, "NixlConnector", kv_params_required=True),
    )
    assert pd_pairs(load_config({"stages": [stage("a", final_output=True)]}).stages) == ()


def test_a_connector_that_returns_no_params_makes_them_optional():
    data = pd()
    for st, role in zip(data["stages"], ("kv_producer", "kv_consumer"), strict=True):
        st["engine_args"] = kv(role, "ExampleConnector")
    (pair,) = pd_pairs(load_config(data).stages)
    assert pair.connector == "ExampleConnector" and not pair.kv_params_required


def test_vllm_stages_pair_up():
    data = pd()
    for st in data["stages"]:
        st["backend"] = "vllm"
    cfg = load_config(data, check_vllm=False)
    assert [(p.prefill, p.decode) for p in pd_pairs(cfg.stages)] == [("p", "d")]


def test_several_pairs_each_checked():
    # a chain of two pairs (an LLM split in two, then another), and a branch of its own
    data = {
        "stages": [
            prefill("p1"),
            decode("d1", "p1", final_output=False),
            prefill("p2", inputs=["d1"]),
            decode("d2", "p2"),
            prefill("p3"),
            decode("d3", "p3"),
        ]
    }
    pairs = pd_pairs(load_config(data).stages)
    assert [(p.prefill, p.decode, p.prefill_index, p.decode_index) for p in pairs] == [
        ("p1", "d1", 0, 1),
        ("p2", "d2", 2, 3),
        ("p3", "d3", 4, 5),
    ]
    # the third pair is checked as the first: its mismatch is named at its own path
    data["stages"][5]["engine_args"] = kv("kv_consumer", "MooncakeConnector")
    err = error(data)
    assert err.path == "$.stages[5].engine_args.kv_transfer_config.kv_connector"
    assert "'d3'" in err.reason and "'p3'" in err.reason


# -- every check, with the path it names ---------------------------------------------------


CASES: list[tuple[str, object, str, str]] = [
    # (name, how to break pd(), the path, a phrase of the reason)
    (
        "torch backend",
        lambda d: d["stages"][0].update(backend="torch"),
        "$.stages[0].is_prefill_only",
        "is for vllm stages",
    ),
    (
        "both flags",
        lambda d: d["stages"][0].update(is_decode_only=True),
        "$.stages[0].is_decode_only",
        "both is_prefill_only and is_decode_only",
    ),
    (
        "streamed prefill input",
        lambda d: d["stages"][1].update(stream_input=True),
        "$.stages[1].stream_input",
        "input whole",
    ),
    (
        "prefill as final output",
        lambda d: d["stages"][0].update(final_output=True),
        "$.stages[0].final_output",
        "one throwaway token",
    ),
    (
        "prefill with companions",
        lambda d: d["stages"][0].update(prompt_expand="tests.request.test_companions:expand_mixed"),
        "$.stages[0].prompt_expand",
        "CFG companions",
    ),
    (
        "decode with two inputs",
        lambda d: (
            d["stages"].append(stage("x")),
            d["stages"][1].update(inputs=["p", "x"]),
        ),
        "$.stages[1].inputs",
        "exactly one input",
    ),
    (
        "decode whose input is not a prefill",
        lambda d: (d["stages"][0].update(is_prefill_only=False),),
        "$.stages[1].inputs[0]",
        "not a prefill-only stage",
    ),
    (
        "decode with an input processor",
        lambda d: d["stages"][1].update(input_processor="omni_trio.stages.processors:passthrough"),
        "$.stages[1].input_processor",
        "no input_processor",
    ),
    (
        "prefill without decode",
        lambda d: d["stages"][1].update(is_decode_only=False),
        "$.stages[0].is_prefill_only",
        "no decode-only stage",
    ),
    (
        "two decodes of one prefill",
        lambda d: d["stages"].append(decode("d2")),
        "$.stages[2].inputs[0]",
        "already hands its KV cache to decode stage 'd'",
    ),
    (
        "another stage fed by the prefill",
        lambda d: d["stages"].append(stage("x", inputs=["p"])),
        "$.stages[2].inputs[0]",
        "take it from its decode stage 'd'",
    ),
    (
        "no kv_transfer_config",
        lambda d: d["stages"][1].update(engine_args={}),
        "$.stages[1].engine_args",
        "needs engine_args.kv_transfer_config",
    ),
    (
        "kv_transfer_config not a mapping",
        lambda d: d["stages"][0].update(engine_args={"kv_transfer_config": "nixl"}),
        "$.stages[0].engine_args.kv_transfer_config",
        "must be a mapping",
    ),
    (
        "no connector",
        lambda d: d["stages"][0]["engine_args"]["kv_transfer_config"].pop("kv_connector"),
        "$.stages[0].engine_args.kv_transfer_config.kv_connector",
        "needs a kv_connector",
    ),
    (
        "a consumer as prefill",
        lambda d: d["stages"][0].update(engine_args=kv("kv_consumer")),
        "$.stages[0].engine_args.kv_transfer_config.kv_role",
        "'kv_producer' or 'kv_both', got 'kv_consumer'",
    ),
    (
        "a producer as decode",
        lambda d: d["stages"][1].update(engine_args=kv("kv_producer")),
        "$.stages[1].engine_args.kv_transfer_config.kv_role",
        "'kv_consumer' or 'kv_both', got 'kv_producer'",
    ),
    (
        "mismatched connectors",
        lambda d: d["stages"][1].update(engine_args=kv("kv_consumer", "MooncakeConnector")),
        "$.stages[1].engine_args.kv_transfer_config.kv_connector",
        "uses kv_connector 'MooncakeConnector' but its prefill stage 'p'",
    ),
    (
        "mismatched buffer devices",
        lambda d: (
            d["stages"][0].update(engine_args=kv("kv_producer", kv_buffer_device="cpu")),
            d["stages"][1].update(engine_args=kv("kv_consumer", kv_buffer_device="cuda")),
        ),
        "$.stages[1].engine_args.kv_transfer_config.kv_buffer_device",
        "kv_buffer_device 'cuda' but its prefill stage 'p' ($.stages[0]) has 'cpu'",
    ),
    (
        "mismatched buffer sizes",
        lambda d: (
            d["stages"][0].update(engine_args=kv("kv_producer", kv_buffer_size=1e9)),
            d["stages"][1].update(engine_args=kv("kv_consumer", kv_buffer_size=2e9)),
        ),
        "$.stages[1].engine_args.kv_transfer_config.kv_buffer_size",
        "kv_buffer_size 2000000000.0 but",
    ),
    (
        "ExampleConnector stores in different directories",
        lambda d: (
            d["stages"][0].update(engine_args=kv("kv_producer", "ExampleConnector", **store("a"))),
            d["stages"][1].update(engine_args=kv("kv_consumer", "ExampleConnector", **store("b"))),
        ),
        "$.stages[1].engine_args.kv_transfer_config.kv_connector_extra_config.shared_storage_path",
        "shared_storage_path 'b' but its prefill stage 'p' ($.stages[0]) has 'a'",
    ),
    (
        "ExampleConnector's store set on one side only",
        lambda d: (
            d["stages"][0].update(engine_args=kv("kv_producer", "ExampleConnector")),
            d["stages"][1].update(engine_args=kv("kv_consumer", "ExampleConnector", **store("b"))),
        ),
        "$.stages[1].engine_args.kv_transfer_config.kv_connector_extra_config.shared_storage_path",
        "has unset: ExampleConnector hands the KV cache over in that directory",
    ),
    (
        "mismatched models",
        lambda d: d["stages"][1]["engine_args"].update(model="tiny:talker"),
        "$.stages[1].engine_args.model",
        "model 'tiny:talker' but its prefill stage 'p' ($.stages[0]) has unset",
    ),
    (
        "mismatched block sizes",
        lambda d: (
            d["stages"][0]["engine_args"].update(block_size=32),
            d["stages"][1]["engine_args"].update(block_size=128),
        ),
        "$.stages[1].engine_args.block_size",
        "finds nothing under another block size",
    ),
    (
        "mismatched dtypes",
        lambda d: d["stages"][0]["engine_args"].update(dtype="float32"),
        "$.stages[1].engine_args.dtype",
        "dtype unset but its prefill stage 'p' ($.stages[0]) has 'float32'",
    ),
    (
        "mismatched tensor parallelism",
        lambda d: d["stages"][1]["engine_args"].update(tensor_parallel_size=2),
        "$.stages[1].engine_args.tensor_parallel_size",
        "tensor_parallel_size 2 but its prefill stage 'p' ($.stages[0]) has 1",
    ),
]


@pytest.mark.parametrize(("name", "breaks", "path", "phrase"), CASES, ids=[c[0] for c in CASES])
def test_every_pd_check_names_the_broken_field(name, breaks, path, phrase):
    data = pd()
    breaks(data)
    err = error(data)
    assert err.path == path, err
    assert phrase in err.reason, err


def test_a_store_named_alike_is_one_store_and_other_connectors_ignore_it():
    data = pd()
    data["stages"][0]["engine_args"] = kv("kv_producer", "ExampleConnector", **store("/s/kv/"))
    data["stages"][1]["engine_args"] = kv("kv_consumer", "ExampleConnector", **store("/s/kv"))
    (pair,) = pd_pairs(load_config(data).stages)
    assert pair.connector == "ExampleConnector"
    # a connector that does not meet in a directory: its extra config is its own business
    data["stages"][0]["engine_args"] = kv("kv_producer", **store("/a"))
    data["stages"][1]["engine_args"] = kv("kv_consumer", **store("/b"))
    assert pd_pairs(load_config(data).stages)[0].connector == "NixlConnector"


def test_a_buffer_set_on_one_side_only_is_no_mismatch():
    data = pd()
    data["stages"][0]["engine_args"] = kv("kv_producer", kv_buffer_device="cpu", kv_buffer_size=9)
    data["stages"][1]["engine_args"] = kv("kv_both")  # kv_both serves either side
    (pair,) = pd_pairs(load_config(data).stages)
    assert pair.decode == "d"


def test_the_pure_functions_alone():
    cfg = load_config(pd())
    (found,) = find_pd_pairs(cfg.stages)
    assert found.connector == ""  # the KV transfer is check_pd_pair's
    assert check_pd_pair(cfg.stages, found) == pd_pairs(cfg.stages)[0]
    broken = copy.deepcopy(cfg.stages)
    broken[1].engine_args["tensor_parallel_size"] = 4
    with pytest.raises(ConfigError) as info:
        check_pd_pair(broken, found, "x.yaml")
    assert str(info.value).startswith("x.yaml: $.stages[1].engine_args.tensor_parallel_size: ")


def test_validate_names_the_broken_field_with_its_path(tmp_path, capsys):
    text = """\
name: pd
stages:
  - id: p
    is_prefill_only: true
    engine_args: {kv_transfer_config: {kv_connector: NixlConnector, kv_role: kv_producer}}
  - id: d
    inputs: [p]
    is_decode_only: true
    final_output: true
    engine_args: {kv_transfer_config: {kv_connector: NixlConnector, kv_role: kv_producer}}
"""
    path = write_config(tmp_path, "pd.yaml", text)
    assert main(["validate", str(path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        f"omni-trio: error: ConfigError: {path}: "
        "$.stages[1].engine_args.kv_transfer_config.kv_role: "
    )
    assert "'kv_consumer' or 'kv_both', got 'kv_producer'" in line
    head, _, tail = text.rpartition("kv_producer")
    assert (
        main(["validate", str(write_config(tmp_path, "ok.yaml", head + "kv_consumer" + tail))]) == 0
    )
