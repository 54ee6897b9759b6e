"""A custom stage backend and a custom input processor, for ``examples/custom_backend.py``.

A pipeline config refers to them by dotted path, so they live in an importable module (in a
real project: your own package, ``backend: "my_app.stages:ShoutBackend"``):

    backend: "shout_backend:ShoutBackend"
    input_processor: "shout_backend:reversed_words"
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any

import msgspec
import trio

from omni_trio import InvalidRequestError, StageConfig, StageInput, StageOutput
from omni_trio.config.options import parse_options
from omni_trio.stages import StageBackend, collect_input

# the types of _run's arguments
InputStream = trio.MemoryReceiveChannel[StageInput]
Emit = Callable[[StageOutput], Awaitable[None]]


class ShoutBackend(StageBackend):
    """Streams the words of its input back in upper case, one output per word."""

    backend_name = "shout"

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        """The stage's ``options:``. Declared as a Struct on the factory, they are checked
        when the config is loaded (a typo or a negative delay is a ConfigError naming
        ``$.stages[i].options.<key>`` and the file), before any engine starts."""

        #: trio-clock delay per word, standing in for the time a model takes per token
        delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        # one instance per replica; the base class keeps the per-request bookkeeping
        super().__init__(config, stage_index=stage_index, replica=replica)
        # the loader checked them already; parse_options gives them typed (ConfigError if bad)
        where = f"$.stages[{stage_index}].options"
        options = parse_options(self.Options, config.options, where=where, backend="shout")
        self.delay_s = options.delay_s
        self.words_shouted = 0

    async def _start(self) -> None:
        # Load weights, open connections, start worker threads... Readiness is reported
        # when this returns; it runs under the stage's stage_init_timeout.
        await trio.lowlevel.checkpoint()

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: Any, emit: Emit
    ) -> None:
        # inputs: StageInput chunks (one unless the stage has stream_input: true)
        chunk = await collect_input(inputs)
        words = (chunk.prompt or "").split()
        if not words:
            raise InvalidRequestError(f"request {request_id!r}: the shout stage needs text")
        limit = len(words)
        if isinstance(sampling_params, Mapping) and "max_tokens" in sampling_params:
            limit = min(limit, int(sampling_params["max_tokens"]))
        for i, word in enumerate(words[:limit]):
            # A checkpoint per output: cancelling this task is how the engine aborts the
            # request, so never shield it or swallow trio.Cancelled here.
            await trio.sleep(self.delay_s)
            last = i == limit - 1
            self.words_shouted += 1
            # emit may block: that is backpressure from a slow consumer downstream
            await emit(
                StageOutput(
                    text=word.upper() + ("" if last else " "),
                    finished=last,
                    finish_reason=("stop" if limit == len(words) else "length") if last else None,
                )
            )

    async def _stop(self) -> None:
        # Release what _start acquired. Runs shielded, bounded by shutdown_timeout.
        await trio.lowlevel.checkpoint()

    async def _rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # engine.collective_rpc("words_shouted") lands here, once per replica
        if method == "words_shouted":
            return self.words_shouted
        return await super()._rpc(method, args, kwargs)  # raises StageError: unknown method


def reversed_words(
    upstream: Mapping[str, Sequence[StageOutput]],
    *,
    final: bool,
    options: Mapping[str, Any] | None = None,
) -> StageInput | None:
    """An input processor: the upstream stages' text, word order reversed (pure: no I/O).

    It hands text on (``prompt``), not token ids, as a processor between two models with
    different tokenizers would. Meant for a stage with ``stream_input: false``: it is called
    once, with every upstream output. ``processor_options``: ``prefix`` (str, default none),
    a word put in front.
    """
    words = "".join(out.text for outs in upstream.values() for out in outs).split()
    prefix = (options or {}).get("prefix")
    return StageInput(
        prompt=" ".join([*([str(prefix)] if prefix else []), *reversed(words)]), final=final
    )
