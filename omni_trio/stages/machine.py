"""What this process may use of the machine: the default capacities of ``cpu_cores`` and
``memory_gib`` (:data:`~omni_trio.config.resources.MACHINE_RESOURCES`).

Not the machine's totals but this process's share: the CPUs it may run on (its affinity
mask, ``taskset``, a container's cpuset) and a cgroup CPU quota (``cpu.max``; v1's
``cpu.cfs_quota_us``), the physical memory and a cgroup memory limit (``memory.max``; v1's
``memory.limit_in_bytes``), the tightest limit on the way from the process's cgroup to the
root counting. :func:`read_machine` takes the readings (the only I/O here: a few small
files under ``/proc`` and ``/sys/fs/cgroup``, which it skips when they are missing);
:func:`machine_capacities` turns them into capacities (pure).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MachineReadings",
    "cgroup_dirs",
    "cpu_limit",
    "machine_capacities",
    "memory_limit",
    "read_machine",
]

_GIB = 2**30
#: a cgroup memory limit at or above this is "no limit" (v1 writes 2**63 rounded to pages)
_UNLIMITED_BYTES = 2**60
_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class MachineReadings:
    """What :func:`read_machine` found; None (or empty) for what it could not read."""

    #: CPUs the process may run on (the affinity mask), else the machine's count
    cpus: int | None
    #: physical memory in bytes
    memory_bytes: int | None
    #: the CPU quotas on the way to the root, as ``cpu.max`` writes them: ``"max 100000"``,
    #: ``"150000 100000"`` (quota and period in microseconds)
    cpu_quotas: tuple[str, ...] = ()
    #: the memory limits on the way to the root, as ``memory.max`` writes them: ``"max"``
    #: or bytes
    memory_limits: tuple[str, ...] = ()


def cpu_limit(quota: str) -> float | None:
    """CPUs a ``cpu.max`` line allows (``"150000 100000"`` -> 1.5), None for no limit or a
    line it cannot read. Pure."""
    parts = quota.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        allowed, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if allowed <= 0 or period <= 0:
        return None  # v1 writes -1 for no quota
    return allowed / period


def memory_limit(limit: str) -> int | None:
    """Bytes a ``memory.max`` value allows, None for no limit or a value it cannot read.
    Pure."""
    try:
        value = int(limit.strip())
    except ValueError:
        return None
    return value if 0 < value < _UNLIMITED_BYTES else None


def machine_capacities(readings: MachineReadings) -> dict[str, float]:
    """``cpu_cores`` and ``memory_gib`` of this process's share of the machine: each the
    smallest of the machine's amount and every limit read; left out when the machine's own
    amount is unknown. Pure."""
    out: dict[str, float] = {}
    if readings.cpus is not None:
        cpus = float(readings.cpus)
        for quota in readings.cpu_quotas:
            limit = cpu_limit(quota)
            if limit is not None:
                cpus = min(cpus, limit)
        out["cpu_cores"] = cpus
    if readings.memory_bytes is not None:
        memory = readings.memory_bytes
        for text in readings.memory_limits:
            limit_bytes = memory_limit(text)
            if limit_bytes is not None:
                memory = min(memory, limit_bytes)
        out["memory_gib"] = memory / _GIB
    return out


def cgroup_dirs(proc_cgroup: str, root: Path = _CGROUP_ROOT) -> dict[str, list[Path]]:
    """From the text of ``/proc/self/cgroup``: per controller (``cpu``, ``memory``), the
    directories from the process's cgroup up to its hierarchy's root, the process's own
    first. v2 (``0::/path``) serves every controller from ``root``; a v1 line names its own
    controllers, mounted at ``root/<controllers>``. Pure."""
    dirs: dict[str, list[Path]] = {}
    for line in proc_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        relative = Path(path.lstrip("/"))
        if controllers == "":
            mount, names = root, ["cpu", "memory"]
        else:
            mount, names = root / controllers, controllers.split(",")
        chain = [mount / relative, *(mount / parent for parent in relative.parents)]
        for name in names:
            if name in ("cpu", "memory"):
                dirs.setdefault(name, []).extend(chain)
    return dirs


def read_machine() -> MachineReadings:
    """Read this process's CPUs, the physical memory and the cgroup limits on its way to
    the root. Blocking (a few small reads of ``/proc`` and ``/sys``; nothing on a system
    without them). Raises nothing: what cannot be read is left out."""
    try:
        cpus: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        memory = None
    dirs = cgroup_dirs(_read_text(Path("/proc/self/cgroup")) or "")
    quotas: list[str] = []
    for directory in dirs.get("cpu", []):
        quotas.append(_read_text(directory / "cpu.max") or "")
        v1_quota = _read_text(directory / "cpu.cfs_quota_us")
        v1_period = _read_text(directory / "cpu.cfs_period_us")
        if v1_quota and v1_period:
            quotas.append(f"{v1_quota.strip()} {v1_period.strip()}")
    limits: list[str] = []
    for directory in dirs.get("memory", []):
        limits.append(_read_text(directory / "memory.max") or "")
        limits.append(_read_text(directory / "memory.limit_in_bytes") or "")
    return MachineReadings(
        cpus=cpus,
        memory_bytes=memory,
        cpu_quotas=tuple(q for q in quotas if q),
        memory_limits=tuple(m for m in limits if m),
    )


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
