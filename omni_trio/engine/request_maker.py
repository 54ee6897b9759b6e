"""The engine's request calls: a request's stream from ``generate()``'s arguments (its route,
sampling params, context, prompt hooks and companions), and aborting several requests at once.
Used by :class:`~omni_trio.engine.engine.Engine`, which documents both."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import trio

from ..config.pd import pd_pairs
from ..config.pipeline import PipelineConfig
from ..context import RequestContext, check_request_options
from ..errors import InvalidRequestError, StageError
from ..outputs import OmniOutput, Prompt, SamplingParams
from ..request.companions import expand_companions, load_expand_hooks
from ..request.hooks import PromptHooks
from ..request.pd import pd_request_params
from ..request.planning import RequestPlan, RoutePlanner, prompt_to_input, resolve_sampling_params
from .orchestrator import Orchestrator
from .streams import RequestStream

__all__ = ["RequestMaker", "abort_requests"]


class RequestMaker:
    """Checks a request and makes its :class:`RequestStream` (see :meth:`Engine.generate
    <omni_trio.engine.engine.Engine.generate>`): routes planned once per distinct route, the entry
    stages' ``prompt_transform`` and ``prompt_expand`` hooks run here."""

    def __init__(
        self, config: PipelineConfig, orchestrator: Orchestrator, prompt_hooks: PromptHooks
    ) -> None:
        self._config = config
        self._orchestrator = orchestrator
        self._planner = RoutePlanner(config)
        self._pd_pairs = pd_pairs(config.stages, config.source)
        self._prompt_hooks = prompt_hooks
        self._expand_hooks = load_expand_hooks(
            [(st.id, None if st.inputs else st.prompt_expand) for st in config.stages],
            source=config.source,
        )

    def make(
        self,
        prompt: Prompt,
        request_id: str | None,
        sampling_params: SamplingParams,
        final_stage_id: str | int | None,
        output_stages: Sequence[str | int] | None,
        *,
        priority: int,
        arrival_time: float | None,
        lora_request: object,
        trace_headers: Mapping[str, str] | None,
        tokenization_kwargs: Mapping[str, object] | None,
        streaming_input: bool,
        output_modalities: Sequence[str] | None,
    ) -> RequestStream:
        """The request's stream, not entered. Synchronous; runs the prompt hooks. Raises
        :class:`InvalidRequestError` naming the bad argument or hook."""
        plan = self._planner.plan(final_stage_id, output_stages, output_modalities)
        params = resolve_sampling_params(self._config, sampling_params)
        rid = request_id if request_id is not None else self._orchestrator.new_request_id()
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request_id must be a non-empty string")
        check_request_options(priority, arrival_time, trace_headers, tokenization_kwargs)
        if streaming_input:
            self._check_streaming_input(plan)
        if self._pd_pairs:
            # the pairs' params checked, their prefills' rewritten (request/pd.py)
            params = pd_request_params(
                self._pd_pairs,
                plan,
                params,
                rid,
                streaming_input=bool(streaming_input),
                lora_request=lora_request,
            )
        artifacts = None
        if self._prompt_hooks:
            # after every other argument was checked (a refused call runs no hook), before the
            # prompt is: the hooks may turn what the caller sent into a prompt
            # (omni_trio.request.hooks)
            prompt, first, artifacts = self._prompt_hooks.apply(prompt, rid, plan.active)
        else:
            first = prompt_to_input(prompt)
        context = RequestContext(
            rid,
            prompt,
            params,
            priority,
            arrival_time,
            lora_request,
            trace_headers,
            tokenization_kwargs,
            bool(streaming_input),
            artifacts,
        )
        try:
            if self._expand_hooks:
                context = self._with_companions(context, plan)
        except InvalidRequestError:
            if artifacts is not None:
                artifacts.remove_nowait()
            raise
        if artifacts is not None:
            self._prompt_hooks.keeper.watch(context)
        return RequestStream(self._orchestrator, rid, first, plan, context)

    def _with_companions(self, context: RequestContext, plan: RequestPlan) -> RequestContext:
        # the route's entry stage with a prompt_expand hook makes the request's companions
        stages = [sid for sid in plan.active if sid in self._expand_hooks]
        if not stages:
            return context
        if len(stages) > 1:
            raise InvalidRequestError(
                f"companions come from one entry stage's prompt_expand; this route has "
                f"{len(stages)} entry stages with one: {stages}"
            )
        (sid,) = stages
        hook, name = self._expand_hooks[sid]
        companions = expand_companions(
            hook,
            hook_name=name,
            stage_id=sid,
            request_id=context.request_id,
            prompt=context.prompt,
            sampling_params=context.sampling_params[sid],
            to_input=prompt_to_input,
        )
        if not companions:
            return context
        return dataclasses.replace(context, companions=companions, companion_stage=sid)

    def _check_streaming_input(self, plan: RequestPlan) -> None:
        if len(plan.entries) != 1:
            raise InvalidRequestError(
                f"streaming_input needs a route with one entry stage; this one has "
                f"{len(plan.entries)}: {list(plan.entries)}"
            )


async def abort_requests(
    orchestrator: Orchestrator, request_ids: Iterable[str]
) -> dict[str, list[OmniOutput]]:
    """Abort every request of ``request_ids`` at once and wait for all of them: ``{request_id:
    outputs so far}`` (see :meth:`Engine.abort <omni_trio.engine.engine.Engine.abort>`). Always
    checkpoints; cancelled before the aborts are committed, nothing happens; cancelled after,
    only the wait ends (every abort completes in the background). Raises the one failed
    request's :class:`StageError`, or a :class:`StageError` naming every failed one ``from
    ExceptionGroup`` of theirs."""
    ids = list(dict.fromkeys(request_ids))
    await trio.lowlevel.checkpoint_if_cancelled()
    # every abort is committed at once (synchronously), then all of them are waited for
    aborting = [(rid, orchestrator.commit_abort(rid)) for rid in ids]
    results: dict[str, list[OmniOutput]] = {}
    errors: list[StageError] = []
    waited = False
    for rid, request in aborting:
        if request is None:
            results[rid] = []
            continue
        waited = True
        try:
            results[rid] = await request.aborted()
        except StageError as exc:
            errors.append(exc)
    if not waited:
        await trio.lowlevel.cancel_shielded_checkpoint()
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise StageError(
            f"{len(errors)} of the aborted requests had failed: "
            + "; ".join(f"{e.request_id}: {e}" for e in errors)
        ) from ExceptionGroup("failed requests", errors)
    return {rid: results[rid] for rid in ids}
