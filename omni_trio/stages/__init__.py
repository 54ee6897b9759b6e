"""Stages: the backend contract every stage backend implements, and the replica pools that
run a stage's replicas.

The contract (what a backend author uses; :mod:`omni_trio.backends` holds the built-in ones):

- :mod:`~omni_trio.stages.backend`: :class:`StageBackend`, one replica of one stage: its
  start, requests, aborts, interactions, RPCs, death and stop;
- :mod:`~omni_trio.stages.emit`: the ``emit`` a backend's ``_run`` gets (:data:`Emit`, its
  synchronous fast path :class:`Emitter`);
- :mod:`~omni_trio.stages.input_stream`: the input a backend reads (:data:`InputStream`,
  :func:`collect_input`, :func:`merge_inputs`);
- :mod:`~omni_trio.stages.replica`: a replica's stop default, its cancellation test and its
  errors; :mod:`~omni_trio.stages.watch`: waiting for a request's run on a stage to start or
  end; ``_request_table`` / ``_running`` / ``_rpc_calls``: a replica's running requests and
  RPCs (the base class's bookkeeping);
- :mod:`~omni_trio.stages.processors`: the built-in input processors (configs name them by
  dotted path, ``omni_trio.stages.processors:token_handoff``).

The pools (what the engine uses):

- :mod:`~omni_trio.stages.pool`: :class:`StagePool`, one stage's replicas for the session
  (start, supervision, membership, stop, requests, RPCs, statistics);
- :mod:`~omni_trio.stages.replicas`: one replica index across the backends that serve it in
  turn (restarts); :mod:`~omni_trio.stages.binding`: which replica runs each request;
  :mod:`~omni_trio.stages.balancing`: the balancing policies, as pure functions;
- :mod:`~omni_trio.stages.group`: every stage's pool, started and stopped together;
- :mod:`~omni_trio.stages.ledger`: the replicas' ``resources`` reserved against the
  pipeline's ``capacities``, all or nothing; :mod:`~omni_trio.stages.machine`: this
  process's share of the machine (the default ``cpu_cores`` and ``memory_gib``);
- :mod:`~omni_trio.stages.fanout`: one ``collective_rpc`` on every replica of a stage;
- :mod:`~omni_trio.stages.factory`: a replica's backend built from its stage's config.

Nothing here imports a backend, the request core or the engine.
"""

from ..config.options import parse_options
from ..errors import StageAborted
from .backend import StageBackend
from .emit import Emit, Emitter
from .factory import create_backend
from .input_stream import InputStream, collect_input, merge_inputs
from .pool import StagePool
from .replica import DEFAULT_SHUTDOWN_TIMEOUT

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "Emit",
    "Emitter",
    "InputStream",
    "StageAborted",
    "StageBackend",
    "StagePool",
    "collect_input",
    "create_backend",
    "merge_inputs",
    "parse_options",
]
