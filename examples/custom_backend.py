"""A pipeline made of a custom stage backend and a custom input processor.

Run it from anywhere: ``python examples/custom_backend.py``. Python puts the script's own
directory on ``sys.path``, so the config can name ``shout_backend`` (examples/shout_backend.py)
by its module path, like any installed package.
"""

import trio

import omni_trio

CONFIG = {
    "name": "shouting",
    "stages": [
        {
            "id": "shout",
            "backend": "shout_backend:ShoutBackend",  # "package.module:Factory"
            "options": {"delay_s": 0.01},  # the backend's own options
            "final_output": True,
        },
        {
            "id": "reverse",
            "backend": "shout_backend:ShoutBackend",
            "inputs": ["shout"],
            "input_processor": "shout_backend:reversed_words",
            "processor_options": {"prefix": "echo:"},
            "final_output": True,
        },
    ],
}


async def main() -> None:
    async with omni_trio.open_engine(CONFIG) as engine:
        async with engine.generate("structured concurrency for inference") as stream:
            async for out in stream:
                print(f"{out.stage_id:>8}: {out.text!r} finished={out.finished}")
        # sampling params reach each stage's _run; a dict keyed by stage id sets one stage's
        params = {"shout": {"max_tokens": 2}}
        async with engine.generate("one two three four", sampling_params=params) as stream:
            texts = [out.text async for out in stream if out.stage_id == "reverse"]
        print("reverse, shout capped at 2 words:", repr("".join(texts)))
        print("words shouted per replica:", await engine.collective_rpc("words_shouted"))
        print("requests in flight:", engine.statistics().requests_in_flight)


if __name__ == "__main__":
    trio.run(main)
