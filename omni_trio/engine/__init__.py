"""The engine: the session users hold and the one owner of every request.

- :mod:`~omni_trio.engine.engine`: :func:`~.engine.open_engine` and
  :class:`~.engine.Engine` (``omni_trio.open_engine``);
- :mod:`~omni_trio.engine.session`: a session's start and close (requests stop before
  stages), and the calls the close cancels;
- :mod:`~omni_trio.engine.orchestrator`: the one owner of every request, from admission to
  its last output; :mod:`~omni_trio.engine.admission`: the admission gate
  (``max_requests_in_flight``, wait or reject, pause) with its pure rule;
- :mod:`~omni_trio.engine.request_maker`: a request's stream from ``generate()``'s
  arguments; :mod:`~omni_trio.engine.streams`: :class:`~.streams.RequestStream`, what
  ``generate()`` returns;
- :mod:`~omni_trio.engine.live_session`: live sessions (``engine.open_session``): full-duplex
  turns on streaming-input requests, barge-in, leases, detach and resume;
  :mod:`~omni_trio.engine.live_registry`: their admission and the nursery of their tasks;
  :mod:`~omni_trio.engine.live_events`: their events and journal;
  :mod:`~omni_trio.engine.live_rules`: their decisions as pure functions;
- :mod:`~omni_trio.engine.rpc`: ``collective_rpc`` across stages;
  :mod:`~omni_trio.engine.health`: the health report.
"""
