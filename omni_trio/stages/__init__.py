"""Stage backends (one module each), the backend contract and replica pools."""

from ._abc import StageBackend, collect_input
from .pool import StagePool, choose_replica, create_backend

__all__ = ["StageBackend", "StagePool", "choose_replica", "collect_input", "create_backend"]
