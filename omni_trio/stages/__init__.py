"""Stage backends (one module each), the backend contract and replica pools."""

from ._abc import StageBackend, collect_input
from .pool import StagePool, create_backend

__all__ = ["StageBackend", "StagePool", "collect_input", "create_backend"]
