"""An anyio application on the trio backend, embedding an omni-trio engine.

omni-trio is trio-native, and anyio code runs on trio unchanged: ``open_engine`` is an async
context manager like any other, its streams are async iterators, and anyio's cancel scopes
are trio's. This program is a small job queue built from anyio parts: a producer sends
prompts into a memory object stream, three workers in a task group each take a prompt,
stream its answer from the engine and send the result on, and the main task prints results
as they come. Then a deadline (``anyio.move_on_after``) cuts one request short: leaving the
stream aborts it in every stage.

Run: ``python examples/anyio_app.py``
"""

import anyio
import sniffio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

import omni_trio
from omni_trio.testing import scripted_pipeline

PROMPTS = ["first question", "second question", "third", "fourth", "fifth"]


async def produce(jobs: ObjectSendStream[str]) -> None:
    async with jobs:  # closing it tells the workers there is no more work
        for prompt in PROMPTS:
            await jobs.send(prompt)  # blocks while every worker is busy: backpressure


async def work(
    name: str,
    engine: omni_trio.Engine,
    jobs: ObjectReceiveStream[str],
    results: ObjectSendStream[tuple[str, str, str]],
) -> None:
    async with jobs, results:
        async for prompt in jobs:
            async with engine.generate(prompt, sampling_params={"max_tokens": 3}) as stream:
                answer = "".join([out.text async for out in stream])
            await results.send((name, prompt, answer))


async def main() -> None:
    print("async library:", sniffio.current_async_library())
    # scripted stages stand in for models; the talker starts on the thinker's partial output
    config = scripted_pipeline(["thinker", "talker"], outputs=50, latency_s=0.02, stream_input=True)
    async with omni_trio.open_engine(config) as engine:
        job_send, job_receive = anyio.create_memory_object_stream[str](max_buffer_size=0)
        result_send, result_receive = anyio.create_memory_object_stream[tuple[str, str, str]](
            max_buffer_size=4
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, job_send)
            async with job_receive, result_send:  # the workers hold clones
                for i in range(3):
                    tg.start_soon(
                        work, f"worker-{i}", engine, job_receive.clone(), result_send.clone()
                    )
            async with result_receive:
                async for name, prompt, answer in result_receive:
                    print(f"{name}: {prompt!r} -> {answer!r}")

        # A deadline on reading one request's answer: leaving the stream's block before the
        # answer is complete aborts the request in every stage.
        received = 0
        async with engine.generate("a long answer") as stream:
            with anyio.move_on_after(0.1) as scope:
                async for _ in stream:
                    received += 1
        print(f"deadline hit: {scope.cancel_called}, outputs before it: {received}")
        stats = engine.statistics()
        print(
            f"requests finished: {stats.requests_finished}, aborted: {stats.requests_aborted}, "
            f"in flight: {stats.requests_in_flight}"
        )


if __name__ == "__main__":
    anyio.run(main, backend="trio")
