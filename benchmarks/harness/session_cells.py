"""The in-process parts of ``bench_sessions.py``: one live-session turn and one one-shot request
on the same engine, each watched by the task that reads it, and the cells built from them
(open/close rates, barge-in against abort, time to first audio).

A :class:`Watch` stamps (``time.perf_counter``) what one response or request showed: its first
text, its first audio, its cancelled end (a session's ``ResponseDone("cancelled")``, a one-shot
request's first ``finish_reason="abort"`` output) and its end (``ResponseDone``; the stream's
end). :class:`Conversation` is one open session whose events one task reads into the watch of
the turn in flight; :func:`one_shot` drives ``engine.generate`` into a watch. Every wait on the
engine is bounded by ``bound_s`` (a dead engine fails the benchmark, never hangs it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import trio

import omni_trio
from omni_trio import ResponseDelta, ResponseDone, ResponseStarted, SessionClosed
from omni_trio.config.stageinfo import audio_stage, text_stage
from omni_trio.outputs import Prompt, SamplingParams

#: the milestones a watch stamps
MILESTONES = ("first_text", "first_audio", "cancelled", "ended")


def data_len(data: object) -> int:
    """Samples in an output's ``data`` (0 for none). Pure."""
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return 0


@dataclass
class Watch:
    """One response (session) or request (one-shot): when each milestone came, what it
    carried. ``t0`` is when the caller started it (the turn's first append, or entering
    ``engine.generate``)."""

    text_stage: str
    audio_stage: str | None
    t0: float = field(default_factory=time.perf_counter)
    at: dict[str, float] = field(default_factory=dict)
    events: dict[str, trio.Event] = field(
        default_factory=lambda: {m: trio.Event() for m in MILESTONES}
    )
    status: str | None = None
    response_id: str | None = None
    text_ids: list[int] = field(default_factory=list)
    audio_samples: int = 0
    outputs: int = 0

    def stamp(self, milestone: str, now: float | None = None) -> None:
        if milestone not in self.at:
            self.at[milestone] = time.perf_counter() if now is None else now
            self.events[milestone].set()

    def output(self, stage_id: str, text: str, token_ids: tuple[int, ...], data: object) -> None:
        self.outputs += 1
        if stage_id == self.text_stage and (text or token_ids):
            self.text_ids.extend(token_ids)
            self.stamp("first_text")
        n = data_len(data)
        if stage_id == self.audio_stage and n:
            self.audio_samples += n
            self.stamp("first_audio")

    def end(self, status: str) -> None:
        self.status = status
        now = time.perf_counter()
        if status == "cancelled":
            self.stamp("cancelled", now)
        self.stamp("ended", now)

    def since(self, milestone: str, t: float | None = None) -> float | None:
        """Seconds from ``t`` (default: the start) to ``milestone``; None if it never came."""
        at = self.at.get(milestone)
        return None if at is None else at - (self.t0 if t is None else t)


def stages_of(engine: omni_trio.Engine) -> tuple[str, str | None]:
    """The pipeline's text stage and audio stage (None without one)."""
    return text_stage(engine.config), audio_stage(engine.config)


class Conversation:
    """One open session, its events read by :meth:`read` (run it in a nursery) into the
    watch of the turn in flight. Turns go one after the other: a turn starts once the one
    before it ended."""

    def __init__(self, session: omni_trio.Session, stages: tuple[str, str | None]) -> None:
        self.session = session
        self.stages = stages
        self.watch: Watch | None = None
        self.closed = trio.Event()

    async def read(self) -> None:
        async for event in self.session.events():
            watch = self.watch
            if isinstance(event, SessionClosed):
                break
            if watch is None or watch.status is not None:
                raise AssertionError(f"an event with no turn in flight: {event!r}")
            if isinstance(event, ResponseStarted):
                watch.response_id = event.response_id
            elif event.response_id != watch.response_id:  # type: ignore[attr-defined]
                raise AssertionError(f"an event of another response: {event!r}")
            elif isinstance(event, ResponseDelta):
                watch.output(event.stage_id, event.text, event.token_ids, event.data)
            elif isinstance(event, ResponseDone):
                watch.end(event.status)
        self.closed.set()

    async def turn(self, prompt: Prompt, bound_s: float) -> Watch:
        """Start a turn: append ``prompt``, commit. Returns its watch (the response goes on)."""
        self.watch = watch = Watch(*self.stages)
        with trio.fail_after(bound_s):
            await self.session.append(prompt)
            await self.session.commit()
        return watch

    async def full_turn(self, prompt: Prompt, bound_s: float) -> Watch:
        """A turn read to its end."""
        watch = await self.turn(prompt, bound_s)
        with trio.fail_after(bound_s):
            await watch.events["ended"].wait()
        return watch


async def converse(
    engine: omni_trio.Engine,
    body: Callable[[Conversation], Awaitable[None]],
    config: Mapping[str, object] | None = None,
) -> None:
    """Open a session, read its events in a task, run ``body`` on it, close it."""
    async with engine.open_session(config=config) as session:
        conversation = Conversation(session, stages_of(engine))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conversation.read)
            await body(conversation)
            await session.aclose()


@dataclass
class OneShot:
    """A one-shot request read by :meth:`run` (in a nursery) into ``watch``; ``abort()``
    aborts it."""

    engine: omni_trio.Engine
    prompt: Prompt
    sampling_params: SamplingParams
    request_id: str
    watch: Watch
    streaming_input: bool = False

    async def run(self) -> None:
        aborted = False
        async with self.engine.generate(
            self.prompt,
            request_id=self.request_id,
            sampling_params=self.sampling_params,
            streaming_input=self.streaming_input,
        ) as stream:
            if self.streaming_input:
                await stream.end_input()  # the prompt was the whole input, as a turn's is
            async for out in stream:
                if out.aborted:
                    aborted = True
                    self.watch.stamp("cancelled")
                self.watch.output(out.stage_id, out.text, out.token_ids, out.data)
        self.watch.end("cancelled" if aborted else "completed")


async def one_shot(
    engine: omni_trio.Engine,
    prompt: Prompt,
    sampling_params: SamplingParams,
    request_id: str,
    bound_s: float,
    streaming_input: bool = False,
) -> Watch:
    """One request read to its end."""
    watch = Watch(*stages_of(engine))
    with trio.fail_after(bound_s):
        await OneShot(engine, prompt, sampling_params, request_id, watch, streaming_input).run()
    return watch


# -- barge-in against abort ------------------------------------------------------------------
@dataclass
class Cut:
    """One response cut at ``point`` (a milestone): how long after the cut its cancelled end
    came, its end, and the cut call's return (every stage dropped it)."""

    to_cancelled_s: float
    to_ended_s: float
    to_return_s: float
    outputs_before: int


def cut_of(watch: Watch, t_cut: float, t_return: float, outputs_before: int) -> Cut:
    cancelled, ended = watch.since("cancelled", t_cut), watch.since("ended", t_cut)
    if watch.status != "cancelled" or cancelled is None or ended is None:
        raise AssertionError(f"the cut response ended {watch.status!r}, not cancelled")
    return Cut(cancelled, ended, t_return - t_cut, outputs_before)


async def barge_ins(
    engine: omni_trio.Engine,
    prompt: Prompt,
    config: Mapping[str, object] | None,
    point: str,
    runs: int,
    bound_s: float,
) -> list[Cut]:
    """``runs`` turns of one session, each barged in at its ``point``."""
    cuts: list[Cut] = []

    async def body(conversation: Conversation) -> None:
        for _ in range(runs):
            watch = await conversation.turn(prompt, bound_s)
            with trio.fail_after(bound_s):
                await watch.events[point].wait()
                outputs, t_cut = watch.outputs, time.perf_counter()
                await conversation.session.barge_in()
                t_return = time.perf_counter()
                await watch.events["ended"].wait()
            cuts.append(cut_of(watch, t_cut, t_return, outputs))

    await converse(engine, body, config)
    return cuts


async def aborts(
    engine: omni_trio.Engine,
    prompt: Prompt,
    sampling_params: SamplingParams,
    point: str,
    runs: int,
    bound_s: float,
    tag: str,
) -> list[Cut]:
    """``runs`` one-shot requests, each aborted (``engine.abort``) at its ``point``."""
    cuts: list[Cut] = []
    for k in range(runs):
        watch = Watch(*stages_of(engine))
        request = OneShot(engine, prompt, sampling_params, f"{tag}-abort-{k}", watch)
        with trio.fail_after(bound_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(request.run)
                await watch.events[point].wait()
                outputs, t_cut = watch.outputs, time.perf_counter()
                await engine.abort(request.request_id)
                t_return = time.perf_counter()
        cuts.append(cut_of(watch, t_cut, t_return, outputs))
    return cuts


# -- open/close rates --------------------------------------------------------------------------
#: the systems of a rate cell: one operation each (``c`` of them run concurrently)
RATE_SYSTEMS = (
    "one_shot",
    "one_shot_streaming_input",
    "session_one_turn",
    "session_turns",
    "session_open_close",
)


@dataclass
class RateRun:
    """One system of one rate cell in one pass."""

    system: str
    ops: int
    wall_s: float
    cpu_s: float


async def rate_run(
    engine: omni_trio.Engine, system: str, prompt: Prompt, n: int, concurrency: int, bound_s: float
) -> RateRun:
    """``n`` operations of ``system`` with ``concurrency`` workers:

    - ``one_shot``: ``engine.generate(prompt)`` read to its end;
    - ``one_shot_streaming_input``: the same with ``streaming_input=True`` (the prompt, then
      ``end_input()``), the request a session's turn makes;
    - ``session_one_turn``: a session opened, one turn (append, commit, its response read to
      ``ResponseDone``), closed;
    - ``session_turns``: one such turn, in a session each worker keeps open for all its turns;
    - ``session_open_close``: a session opened and closed, no turn.
    """
    per_worker = [n // concurrency + (1 if w < n % concurrency else 0) for w in range(concurrency)]
    expected: list[int] = []  # outputs per response (every response has the same)

    def check(watch: Watch) -> None:
        if watch.status != "completed" or (expected and watch.outputs != expected[0]):
            raise AssertionError(f"{system}: a response ended {watch.status}, {watch.outputs}")
        expected.append(watch.outputs)

    async def turns(conversation: Conversation, count: int) -> None:
        for _ in range(count):
            check(await conversation.full_turn(prompt, bound_s))

    async def worker(w: int) -> None:
        count = per_worker[w]
        if system.startswith("one_shot"):
            streaming = system == "one_shot_streaming_input"
            for k in range(count):
                rid = f"rate-{w}-{k}"
                check(await one_shot(engine, prompt, None, rid, bound_s, streaming))
        elif system == "session_turns":
            await converse(engine, lambda c: turns(c, count))
        elif system == "session_one_turn":
            for _ in range(count):
                await converse(engine, lambda c: turns(c, 1))
        else:
            for _ in range(count):
                with trio.fail_after(bound_s):
                    async with engine.open_session():
                        pass

    cpu0, t0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in range(concurrency):
            nursery.start_soon(worker, w)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stats = engine.statistics()
    if stats.sessions or stats.requests_in_flight:
        raise AssertionError(f"{system}: left behind {stats.sessions} sessions, {stats}")
    return RateRun(system, n, wall, cpu)


# -- time to first audio -----------------------------------------------------------------------
#: the sides of a first-audio run: a session turn, and the prompt as a one-shot request
#: without and with streaming input (the request a turn makes, outside a session)
FIRST_AUDIO_SIDES = ("session", "one_shot", "one_shot_streaming_input")


async def first_audio_runs(
    engine: omni_trio.Engine,
    prompt: Prompt,
    sampling_params: SamplingParams,
    runs: int,
    bound_s: float,
) -> dict[str, list[Watch]]:
    """``runs`` rounds of the same prompt on each side (the turns in one session), each read
    to its end; the sides' order rotates round by round."""
    watches: dict[str, list[Watch]] = {side: [] for side in FIRST_AUDIO_SIDES}

    async def body(conversation: Conversation) -> None:
        for k in range(runs):
            for i in range(len(FIRST_AUDIO_SIDES)):
                side = FIRST_AUDIO_SIDES[(k + i) % len(FIRST_AUDIO_SIDES)]
                if side == "session":
                    watch = await conversation.full_turn(prompt, bound_s)
                else:
                    streaming = side == "one_shot_streaming_input"
                    rid = f"first-audio-{side}-{k}"
                    watch = await one_shot(engine, prompt, sampling_params, rid, bound_s, streaming)
                watches[side].append(watch)

    await converse(engine, body, {"sampling_params": sampling_params})
    return watches
