"""This process's share of the machine (``omni_trio.stages.machine``): the cgroup files
read as the kernel writes them, the tightest limit winning, and the readings of this
machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_trio.stages.machine import (
    MachineReadings,
    cgroup_dirs,
    cpu_limit,
    machine_capacities,
    memory_limit,
    read_machine,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000\n", None),
        ("150000 100000\n", 1.5),
        ("200000 100000", 2.0),
        ("-1 100000", None),  # cgroup v1's "no quota", as read_machine joins quota and period
        ("garbage", None),
        ("1 2 3", None),
    ],
)
def test_cpu_limit(text, cpus):
    assert cpu_limit(text) == cpus


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("max\n", None),
        ("2147483648\n", 2**31),
        ("9223372036854771712\n", None),  # cgroup v1's "no limit"
        ("0", None),
    ],
)
def test_memory_limit(text, limit):
    assert memory_limit(text) == limit


def test_the_tightest_limit_wins():
    readings = MachineReadings(
        cpus=8,
        memory_bytes=64 * 2**30,
        cpu_quotas=("max 100000", "250000 100000", "400000 100000"),
        memory_limits=("max", str(6 * 2**30), str(16 * 2**30)),
    )
    assert machine_capacities(readings) == {"cpu_cores": 2.5, "memory_gib": 6.0}
    # an affinity mask narrower than the quota
    assert machine_capacities(MachineReadings(cpus=1, memory_bytes=2**30, cpu_quotas=("4 1",))) == {
        "cpu_cores": 1.0,
        "memory_gib": 1.0,
    }
    # what is unknown is left out
    assert machine_capacities(MachineReadings(cpus=None, memory_bytes=None)) == {}


def test_cgroup_dirs_of_v2_and_v1_hierarchies():
    root = Path("/cg")
    assert cgroup_dirs("0::/a/b\n", root) == {
        "cpu": [root / "a/b", root / "a", root],
        "memory": [root / "a/b", root / "a", root],
    }
    v1 = "4:memory:/box/x\n2:cpu,cpuacct:/\n1:name=systemd:/\n"
    assert cgroup_dirs(v1, root) == {
        "memory": [root / "memory/box/x", root / "memory/box", root / "memory"],
        "cpu": [root / "cpu,cpuacct"],
    }
    assert cgroup_dirs("not a cgroup line", root) == {}


def test_this_machine_has_cpus_and_memory():
    capacities = machine_capacities(read_machine())
    assert capacities["cpu_cores"] > 0
    assert capacities["memory_gib"] > 0
