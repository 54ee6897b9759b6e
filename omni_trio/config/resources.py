"""The resource keys of a pipeline, checked at load: each stage's ``resources`` (what one
replica reserves) against the pipeline's ``capacities`` (the totals).

What can be known from the file alone is checked here, by :func:`check_resources` (pure):
names are not empty and amounts are finite numbers (a stage's above zero, a capacity zero
or more), each error naming its own key's path; every resource a stage names has a
capacity (declared, or one of :data:`MACHINE_RESOURCES`, whose default is measured when
the engine starts); a Ray stage names none (Ray reserves its actors' ``placement.ray``
resources on the node each lands on); no single replica asks more than a declared capacity
(then no replica of that stage could ever start); and every declared capacity is one a
stage asks for (a misspelt name would otherwise leave the stage's ask on the machine's
default). Whether all the replicas fit together is the ledger's question when the engine
starts (:mod:`omni_trio.stages.ledger`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import ConfigError
from .pipeline import PipelineConfig

__all__ = ["MACHINE_RESOURCES", "check_resources"]

#: the resources whose capacity defaults to this process's share of the machine
MACHINE_RESOURCES = ("cpu_cores", "memory_gib")


def check_resources(cfg: PipelineConfig) -> None:
    """Check the stages' ``resources`` against the pipeline's ``capacities`` (see the module
    docstring). Pure. Raises :class:`ConfigError` naming the path at the first problem."""
    src = cfg.source
    _check_amounts(cfg.capacities, "$.capacities", src, zero=True)
    asked: set[str] = set()
    for i, st in enumerate(cfg.stages):
        where = f"$.stages[{i}].resources"
        _check_amounts(st.resources, where, src, zero=False)
        if st.resources and st.placement is not None and st.placement.ray is not None:
            raise ConfigError(
                f"stage {st.id!r} runs on Ray, which reserves what each actor asks on the "
                "node it lands on: give it placement.ray's num_cpus, num_gpus or resources "
                "instead of resources",
                path=where,
                source=src,
            )
        for name, amount in st.resources.items():
            asked.add(name)
            capacity = cfg.capacities.get(name)
            if capacity is None and name not in MACHINE_RESOURCES:
                raise ConfigError(
                    f"stage {st.id!r} reserves {name!r} but the pipeline has no capacity of "
                    f"it: declare capacities: {{{name}: <total>}} (only "
                    f"{' and '.join(MACHINE_RESOURCES)} default to this machine's)",
                    path=f"{where}.{name}",
                    source=src,
                )
            if capacity is not None and amount > capacity:
                raise ConfigError(
                    f"one replica of stage {st.id!r} reserves {name}={amount:g}, more than "
                    f"the pipeline's capacity of {capacity:g}: no replica of it could start",
                    path=f"{where}.{name}",
                    source=src,
                )
    for name in cfg.capacities:
        if name not in asked:
            listed = ", ".join(sorted(asked)) or "none"
            raise ConfigError(
                f"no stage reserves {name!r} (the stages reserve: {listed}): a capacity "
                "only bounds the resources stages name",
                path=f"$.capacities.{name}",
                source=src,
            )


def _check_amounts(
    amounts: Mapping[str, float], where: str, source: str | None, *, zero: bool
) -> None:
    # names not empty; amounts finite, above zero (or zero too for a capacity)
    for name, amount in amounts.items():
        if not name.strip():
            raise ConfigError(
                "a resource needs a name, not an empty one", path=where, source=source
            )
        if not math.isfinite(amount) or amount < 0 or (amount == 0 and not zero):
            bound = ">= 0" if zero else "> 0"
            raise ConfigError(
                f"an amount is a finite number {bound}, got {amount!r}",
                path=f"{where}.{name}",
                source=source,
            )
