"""How items cross boundaries: threads, loops and processes. It knows no stage, request or
config.

- :mod:`~omni_trio.transport.bridge`: a bounded, event-driven, one-way channel between two
  loops in two threads (it replaces janus); ``_bridge_core`` is its shared state;
- :mod:`~omni_trio.transport.queue`: ``OutputQueue``, one request's outputs on their way to
  its consumer;
- :mod:`~omni_trio.transport.loop_host`: the one way a loop is hosted in a thread of its
  own: ``LoopHost`` (asyncio or trio-asyncio), ``open_trio_portal`` (trio), and the orderly
  stop at the interpreter's exit of what an owner left running;
- :mod:`~omni_trio.transport.codec`: the wire format of replicas in other processes.
"""

from ._bridge_core import BridgeStatistics
from .bridge import BridgeReceiver, BridgeSender, open_bridge

__all__ = ["BridgeReceiver", "BridgeSender", "BridgeStatistics", "open_bridge"]
