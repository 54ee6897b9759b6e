# examples/readme_example.py: python examples/readme_example.py
import trio

import omni_trio
from omni_trio.testing import scripted_pipeline


async def main() -> None:
    # any pipeline: a PipelineConfig, a dict, or a YAML/TOML/JSON file path
    config = scripted_pipeline(["thinker", "talker"], outputs=4, latency_s=0.01)
    async with omni_trio.open_engine(config) as engine:
        async with engine.generate("Hello", sampling_params={"max_tokens": 4}) as stream:
            async for out in stream:  # omni_trio.OmniOutput
                print(out.stage_id, out.token_ids, repr(out.text), out.finished)
        # leaving a stream early aborts the request in every stage, before __aexit__ returns
        async with engine.generate("Bye") as stream:
            first = await stream.receive()
            print("first output of an abandoned request:", first.stage_id, first.text)
        print("requests in flight:", engine.statistics().requests_in_flight)  # 0: none left
        print(await engine.collective_rpc("echo", args=(1,)))


if __name__ == "__main__":  # vLLM stages spawn processes: keep the guard
    trio.run(main)
