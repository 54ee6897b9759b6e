"""How items cross boundaries: threads (the bridge), processes, codecs."""

from ._bridge_core import BridgeStatistics
from .bridge import BridgeReceiver, BridgeSender, open_bridge

__all__ = ["BridgeReceiver", "BridgeSender", "BridgeStatistics", "open_bridge"]
