"""One request's life inside the engine: which stages it runs on, how they run, where their
outputs go, and everything it carries.

- :mod:`~omni_trio.request.planning`: which stages a request runs on (its route), each
  stage's sampling params, how each stage is run (pure);
- :mod:`~omni_trio.request.lifecycle`: a request's life as a small pure state machine;
- :mod:`~omni_trio.request.state`: an admitted request (:class:`~.state.Request`, owned by
  the orchestrator) and the consumer's narrow handle on it;
- :mod:`~omni_trio.request.run`: the request's run (:class:`~.run.StageRunner`: which stage
  runs in which task, where its outputs go); :mod:`~omni_trio.request.emits`: the ``emit``
  a stage's backend gets, per place its outputs go; :mod:`~omni_trio.request.route`: a
  routed stage's routing task; :mod:`~omni_trio.request.feeds`: stage-to-stage feeds (the
  input processors);
- :mod:`~omni_trio.request.output_builder`: the ``OmniOutput`` a caller gets for a stage's
  output;
- what a request carries: :mod:`~omni_trio.request.streaming_input` (input sent in
  segments), :mod:`~omni_trio.request.interactions` (control payloads for its entry stage),
  :mod:`~omni_trio.request.hooks` (``prompt_transform`` and the directories it leaves),
  :mod:`~omni_trio.request.companions` (CFG companions);
- :mod:`~omni_trio.request.pd`: a prefill/decode pair per request (the sampling rewrite,
  the KV handoff's params and input, pure).

It runs requests on the stage pools (:mod:`omni_trio.stages`) and never imports a backend
or the engine.
"""
