"""The remote-replica wire format (``omni_trio.transport.codec``): size and CPU per message.

Encodes and decodes typical messages many times and prints, per message kind, its size in
bytes and the CPU microseconds (process time, so other load on the machine counts less) of
one encode and one decode, next to plain ``pickle`` of the same objects for scale:

- ``step_tokens``: one engine step's outputs of one request (a 1-token delta with metrics);
- ``batch_16``: 16 different such outputs in one message;
- ``audio_1s``: one output carrying 1 s of 24 kHz float32 audio;
- ``input_prompt``: an entry chunk with a 512-token prompt;
- ``sampling``: a sampling-params dict.

    python benchmarks/bench_codec.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_trio.outputs import StageInput, StageOutput
from omni_trio.transport.codec import (
    decode_inputs,
    decode_outputs,
    decode_value,
    encode_inputs,
    encode_outputs,
    encode_value,
)

_STEP = StageOutput(token_ids=(1234,), text=" word", metrics={"output_index": 0})
MESSAGES: dict[str, tuple[Any, Callable[[Any], bytes], Callable[[bytes], Any]]] = {
    "step_tokens": ([_STEP], encode_outputs, decode_outputs),
    "batch_16": (
        [
            StageOutput(token_ids=(1000 + i,), text=f" w{i}", metrics={"output_index": i})
            for i in range(16)
        ],
        encode_outputs,
        decode_outputs,
    ),
    "audio_1s": (
        [StageOutput(data=np.zeros(24_000, dtype=np.float32), finished=True)],
        encode_outputs,
        decode_outputs,
    ),
    "input_prompt": ([StageInput(token_ids=tuple(range(512)))], encode_inputs, decode_inputs),
    "sampling": (
        {"temperature": 0.7, "max_tokens": 256, "stop": ["\n\n"], "seed": 1},
        encode_value,
        decode_value,
    ),
}


def _cpu_us(fn: Callable[[], object], repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat * 1e6


def measure(repeat: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for name, (obj, encode, decode) in MESSAGES.items():
        msg = encode(obj)
        if name != "audio_1s":  # an array's == is elementwise
            assert decode(msg) == obj
        pickled = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        results[name] = {
            "bytes": len(msg),
            "encode_us": round(_cpu_us(lambda o=obj, e=encode: e(o), repeat), 2),
            "decode_us": round(_cpu_us(lambda m=msg, d=decode: d(m), repeat), 2),
            "pickle_bytes": len(pickled),
            "pickle_dumps_us": round(_cpu_us(lambda o=obj: pickle.dumps(o, 5), repeat), 2),
            "pickle_loads_us": round(_cpu_us(lambda p=pickled: pickle.loads(p), repeat), 2),
        }
    return results


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2000, help="encodes/decodes per kind")
    args = parser.parse_args(argv)
    results = measure(args.repeat)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
