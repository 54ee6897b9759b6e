"""How items cross boundaries: threads (the bridge), processes, codecs."""

from .bridge import BridgeReceiver, BridgeSender, BridgeStatistics, open_bridge

__all__ = ["BridgeReceiver", "BridgeSender", "BridgeStatistics", "open_bridge"]
