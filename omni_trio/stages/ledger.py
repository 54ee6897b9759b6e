"""The resource ledger: every replica's declared ``resources`` reserved against the
pipeline's ``capacities``, all or nothing, before the replicas start.

The rule is pure: a :class:`Ledger` is a frozen state (the capacities and what each replica,
``(stage id, replica index)``, holds); :func:`reserve` takes a list of asks and returns the
new state with all of them held, or a :class:`Refusal` for the first one that does not fit
(naming the stage, the replica, the resource, what it asked and what was left, and who holds
the rest) with nothing held; :func:`release` gives one replica's share back. Amounts are
kept as exact fractions of the decimals the config wrote (``0.3`` is 3/10), so reserving and
releasing never drift: after every release the ledger is back to zero exactly.

:class:`ResourceLedger` is the engine's one owner of that state (held by the
:class:`~omni_trio.stages.group.StageGroup`, shared by its pools): it reserves every initial
replica at once before any starts, a replica added at run time before it is built, and
takes a replica's share back when it leaves its pool. A refusal is raised as
:class:`~omni_trio.errors.ResourceUnavailableError`. Stages that reserve nothing (no
``resources:``, Ray stages) never touch it. The capacities are the declared ones, and for
:data:`~omni_trio.config.resources.MACHINE_RESOURCES` not declared, this process's share
of the machine (:mod:`omni_trio.stages.machine`), read only when a stage asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ..config.pipeline import PipelineConfig
from ..config.resources import MACHINE_RESOURCES
from ..errors import ConfigError, ResourceUnavailableError
from ..outputs import ResourceStatistics
from .machine import machine_capacities, read_machine

__all__ = [
    "Ask",
    "Ledger",
    "Refusal",
    "ResourceLedger",
    "exact",
    "pipeline_capacities",
    "release",
    "reserve",
    "unavailable",
]

#: one replica's ask: its stage id, its index, what it reserves by resource name
Ask = tuple[str, int, Mapping[str, float]]
#: who holds what: per (stage id, replica index), its amounts by resource name
Holdings = Mapping[tuple[str, int], Mapping[str, Fraction]]


def exact(amount: float) -> Fraction:
    """The amount as the decimal its shortest repr writes (``0.1`` is 1/10, not the binary
    float's value), so that sums of config amounts are exact. Pure."""
    return Fraction(repr(float(amount)))


@dataclass(frozen=True, slots=True)
class Ledger:
    """The capacities and who holds what of them. Frozen: :func:`reserve` and
    :func:`release` return new ones."""

    capacities: Mapping[str, Fraction]
    held: Holdings
    #: the sum of ``held`` per resource (kept, not recomputed per ask)
    reserved: Mapping[str, Fraction]

    @classmethod
    def of(cls, capacities: Mapping[str, float]) -> Ledger:
        """An empty ledger over ``capacities``. Pure."""
        return cls({k: exact(v) for k, v in capacities.items()}, {}, {})

    def left(self, resource: str) -> Fraction:
        return self.capacities[resource] - self.reserved.get(resource, Fraction(0))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an ask does not fit: replica ``replica`` of ``stage_id`` asks ``asked`` of
    ``resource`` and only ``left`` of ``capacity`` is left; ``holders`` are the stages
    that hold it (with the asks of the same list before this one), in config order."""

    stage_id: str
    replica: int
    resource: str
    asked: Fraction
    left: Fraction
    capacity: Fraction
    holders: tuple[tuple[str, Fraction], ...]


def reserve(ledger: Ledger, asks: Sequence[Ask]) -> Ledger | Refusal:
    """Every ask held, in order, or the :class:`Refusal` of the first one that does not fit
    (and nothing held). Pure. Raises ValueError for a replica that already holds a share or
    a resource with no capacity (a bug: the config's checks and the pool rule them out)."""
    held = dict(ledger.held)
    reserved = dict(ledger.reserved)
    for stage_id, replica, amounts in asks:
        key = (stage_id, replica)
        if key in held:
            raise ValueError(f"replica {stage_id}[{replica}] already holds its resources")
        share = {name: exact(amount) for name, amount in amounts.items()}
        for name, amount in share.items():
            capacity = ledger.capacities.get(name)
            if capacity is None:
                raise ValueError(f"no capacity of {name!r} for replica {stage_id}[{replica}]")
            left = capacity - reserved.get(name, Fraction(0))
            if amount > left:
                return Refusal(
                    stage_id, replica, name, amount, left, capacity, _holders(held, name)
                )
        for name, amount in share.items():
            reserved[name] = reserved.get(name, Fraction(0)) + amount
        held[key] = share
    return Ledger(ledger.capacities, held, reserved)


def release(ledger: Ledger, stage_id: str, replica: int) -> Ledger:
    """The ledger without replica ``replica`` of ``stage_id``'s share; the same ledger if it
    holds none. Pure."""
    share = ledger.held.get((stage_id, replica))
    if share is None:
        return ledger
    held = {k: v for k, v in ledger.held.items() if k != (stage_id, replica)}
    reserved = dict(ledger.reserved)
    for name, amount in share.items():
        reserved[name] -= amount
    return Ledger(ledger.capacities, held, reserved)


def _holders(held: Holdings, resource: str) -> tuple[tuple[str, Fraction], ...]:
    # per stage, in the order its first replica reserved, what it holds of the resource
    totals: dict[str, Fraction] = {}
    for (stage_id, _), share in held.items():
        amount = share.get(resource)
        if amount:
            totals[stage_id] = totals.get(stage_id, Fraction(0)) + amount
    return tuple(totals.items())


def unavailable(refusal: Refusal, outcome: str) -> ResourceUnavailableError:
    """The error a refusal is raised as; ``outcome`` says what did not happen ("nothing was
    started"). Pure."""
    held = ", ".join(f"{sid} {float(amount):g}" for sid, amount in refusal.holders)
    reason = (
        f"replica {refusal.stage_id}[{refusal.replica}] reserves "
        f"{refusal.resource}={float(refusal.asked):g} but only {float(refusal.left):g} of "
        f"the capacity of {float(refusal.capacity):g} is left"
        + (f" (held: {held})" if held else "")
        + f"; {outcome}"
    )
    return ResourceUnavailableError(
        refusal.stage_id,
        reason,
        replica=refusal.replica,
        resource=refusal.resource,
        asked=float(refusal.asked),
        left=float(refusal.left),
        capacity=float(refusal.capacity),
    )


def pipeline_capacities(
    config: PipelineConfig, machine: Callable[[], Mapping[str, float]]
) -> dict[str, float]:
    """The capacities the stages reserve from: the declared ones, and for each of
    :data:`MACHINE_RESOURCES` a stage asks for without a declared capacity, ``machine()``'s
    (called only then). Pure but for ``machine``. Raises :class:`ConfigError` when the
    machine's amount of an asked resource is unknown."""
    asked = {name for st in config.stages for name in st.resources}
    capacities = {name: config.capacities[name] for name in asked if name in config.capacities}
    missing = [name for name in MACHINE_RESOURCES if name in asked and name not in capacities]
    if missing:
        measured = machine()
        for name in missing:
            if name not in measured:
                raise ConfigError(
                    f"a stage reserves {name} and this machine's amount of it cannot be "
                    f"read here: declare capacities: {{{name}: <total>}}",
                    path=f"$.capacities.{name}",
                    source=config.source,
                )
            capacities[name] = measured[name]
    return capacities


def _this_machine() -> dict[str, float]:
    return machine_capacities(read_machine())


class ResourceLedger:
    """The engine's ledger (see the module docstring). Its state changes only through its
    methods, each synchronous."""

    __slots__ = ("_ledger",)

    def __init__(self, capacities: Mapping[str, float]) -> None:
        self._ledger = Ledger.of(capacities)

    @classmethod
    def for_pipeline(
        cls,
        config: PipelineConfig,
        machine: Callable[[], Mapping[str, float]] = _this_machine,
    ) -> ResourceLedger:
        """The ledger of ``config``'s capacities (see :func:`pipeline_capacities`).
        Blocking when a stage asks for a machine resource (reads ``/proc``, ``/sys``)."""
        return cls(pipeline_capacities(config, machine))

    def reserve(self, asks: Sequence[Ask], outcome: str) -> None:
        """Hold every ask, or none. Raises :class:`ResourceUnavailableError` (built with
        ``outcome``, what the refusal means to the caller) for the first that does not fit,
        nothing held."""
        result = reserve(self._ledger, asks)
        if isinstance(result, Refusal):
            raise unavailable(result, outcome)
        self._ledger = result

    def release(self, stage_id: str, replica: int) -> None:
        """Give back replica ``replica`` of ``stage_id``'s share; a no-op if it holds none."""
        self._ledger = release(self._ledger, stage_id, replica)

    def release_all(self) -> None:
        """Give back every share (the stages stopped)."""
        self._ledger = Ledger(self._ledger.capacities, {}, {})

    def holds(self, stage_id: str, replica: int) -> bool:
        return (stage_id, replica) in self._ledger.held

    def statistics(self) -> tuple[ResourceStatistics, ...]:
        """Per resource, in name order: its capacity and what is reserved now."""
        ledger = self._ledger
        return tuple(
            ResourceStatistics(
                resource=name,
                capacity=float(capacity),
                reserved=float(ledger.reserved.get(name, Fraction(0))),
            )
            for name, capacity in sorted(ledger.capacities.items())
        )

    def __repr__(self) -> str:
        ledger = self._ledger
        used = " ".join(
            f"{name}={float(ledger.reserved.get(name, Fraction(0))):g}/{float(cap):g}"
            for name, cap in sorted(ledger.capacities.items())
        )
        return f"<ResourceLedger {used or 'empty'} replicas={len(ledger.held)}>"
