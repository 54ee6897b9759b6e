"""Stage backends (one module each), the backend contract and replica pools."""

from ._abc import StageBackend
from ._inputs import collect_input
from .factory import create_backend
from .pool import StagePool

__all__ = ["StageBackend", "StagePool", "collect_input", "create_backend"]
