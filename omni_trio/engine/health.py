"""The health of an engine: which stages can take new work, and why not.

:func:`assess_health` turns one :class:`~omni_trio.outputs.EngineStatistics` snapshot into a
frozen :class:`HealthReport`. It is pure (no I/O, no clock), so every rule below is tested
on constructed statistics; ``Engine.check_health()`` applies it to the engine's own
snapshot, and the HTTP server's ``/health`` and its Prometheus replica gauges read that
report.

Rules:

- A replica is *live* when its state is ``"ready"``: it takes new requests. A
  ``"draining"`` replica still serves the requests already bound to it but takes no new
  ones, so it is not live: a stage whose only replica drains cannot start any new request.
  ``"starting"``, ``"restarting"``, ``"dead"`` and ``"stopped"`` replicas are not live.
- A stage's ``total_replicas`` counts its members: every replica it lists except the
  ``"stopped"`` ones (removed, or shut down with the engine). A dead or restarting replica
  is still a member: its index is the one a restart reuses.
- A stage is *healthy* when it has at least one live replica.
- The engine's ``status``: ``"closed"`` once the engine closes; else ``"unhealthy"`` when a
  stage is unhealthy (``unhealthy_stages`` names each, in pipeline order); else
  ``"degraded"`` when a stage has fewer live replicas than members; else ``"ok"``.
  ``healthy`` is true for ``"ok"`` and ``"degraded"``: every stage can take new work.
- ``paused`` (admission held by ``engine.pause()``) is reported but does not make the
  engine unhealthy: it is an operator's choice, and in-flight requests go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from ..outputs import EngineStatistics, ReplicaState, ReplicaStatistics, StageStatistics

__all__ = [
    "HealthReport",
    "HealthStatus",
    "ReplicaHealth",
    "StageHealth",
    "assess_health",
]

#: ``ok``: every member replica is live; ``degraded``: every stage has a live replica but
#: some member is not live; ``unhealthy``: a stage has none; ``closed``: the engine closed
HealthStatus: TypeAlias = Literal["ok", "degraded", "unhealthy", "closed"]

# the state in which a replica takes new requests
_LIVE: ReplicaState = "ready"
# a replica no longer part of its stage's deployment
_GONE: ReplicaState = "stopped"


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """One replica: its state, the requests bound to it, and its failure history."""

    replica: int
    state: ReplicaState
    requests_in_flight: int
    #: times this replica index died
    failures: int = 0
    #: times this replica index was replaced after dying
    restarts: int = 0
    #: ``"ExcType: message"`` of its last death, or None
    last_error: str | None = None

    @property
    def live(self) -> bool:
        """Whether it takes new requests (``state == "ready"``)."""
        return self.state == _LIVE


@dataclass(frozen=True, slots=True)
class StageHealth:
    """One stage: how many of its member replicas take new work, and what waits for one."""

    stage_id: str
    #: replicas in state ``ready`` (a draining replica is not counted: it takes no new work)
    live_replicas: int
    #: member replicas: every listed replica except the ``stopped`` ones
    total_replicas: int
    #: requests waiting for a replica of this stage (a slot, or a restarting replica)
    requests_waiting: int = 0
    #: requests bound to a replica of this stage
    requests_in_flight: int = 0
    replicas: tuple[ReplicaHealth, ...] = ()

    @property
    def healthy(self) -> bool:
        """At least one replica takes new requests."""
        return self.live_replicas > 0

    @property
    def degraded(self) -> bool:
        """Healthy, but some member replica does not take new requests."""
        return self.healthy and self.live_replicas < self.total_replicas

    def describe_replicas(self) -> str:
        """The replicas that are not live, ``"talker[0] dead (StageError: ...)"``, comma
        separated; ``""`` when every member is live."""
        parts = []
        for r in self.replicas:
            if r.live or r.state == _GONE:
                continue
            error = f" ({r.last_error})" if r.last_error else ""
            parts.append(f"{self.stage_id}[{r.replica}] {r.state}{error}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class HealthReport:
    """A frozen health snapshot of an engine (see the module docstring for the rules)."""

    status: HealthStatus
    #: every stage has a live replica and the engine is open (status ok or degraded)
    healthy: bool
    stages: tuple[StageHealth, ...]
    #: the stages with no live replica, in pipeline order
    unhealthy_stages: tuple[str, ...]
    requests_in_flight: int
    #: admissions waiting (``max_requests_in_flight`` reached, or paused)
    requests_waiting: int
    paused: bool
    closed: bool

    def stage(self, stage_id: str) -> StageHealth:
        """The health of one stage. Raises ``KeyError`` for an unknown stage id."""
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def message(self) -> str:
        """One sentence for people: what is wrong, naming stages and replicas."""
        if self.closed:
            return "the engine is closed"
        if self.unhealthy_stages:
            named = ", ".join(self.unhealthy_stages)
            details = "; ".join(
                d for s in self.stages if not s.healthy and (d := s.describe_replicas())
            )
            return f"stage(s) {named} have no ready replica" + (f": {details}" if details else "")
        if self.status == "degraded":
            details = "; ".join(d for s in self.stages if (d := s.describe_replicas()))
            return f"every stage has a ready replica; not ready: {details}"
        return "every replica of every stage is ready"


def replica_health(replica: ReplicaStatistics) -> ReplicaHealth:
    """The health of one replica, from its statistics. Pure."""
    return ReplicaHealth(
        replica=replica.replica,
        state=replica.state,
        requests_in_flight=replica.requests_in_flight,
        failures=replica.failures,
        restarts=replica.restarts,
        last_error=replica.last_error,
    )


def stage_health(stage: StageStatistics) -> StageHealth:
    """The health of one stage, from its statistics. Pure."""
    replicas = tuple(replica_health(r) for r in stage.replicas)
    return StageHealth(
        stage_id=stage.stage_id,
        live_replicas=sum(1 for r in replicas if r.live),
        total_replicas=sum(1 for r in replicas if r.state != _GONE),
        requests_waiting=stage.requests_waiting,
        requests_in_flight=stage.requests_in_flight,
        replicas=replicas,
    )


def health_status(stages: tuple[StageHealth, ...], *, closed: bool) -> HealthStatus:
    """``closed``, ``unhealthy``, ``degraded`` or ``ok``, in that order of precedence. Pure."""
    if closed:
        return "closed"
    if any(not s.healthy for s in stages):
        return "unhealthy"
    if any(s.degraded for s in stages):
        return "degraded"
    return "ok"


def assess_health(stats: EngineStatistics) -> HealthReport:
    """The health report of one statistics snapshot. Pure and synchronous: it never
    checkpoints and raises nothing."""
    stages = tuple(stage_health(st) for st in stats.stages)
    status = health_status(stages, closed=stats.closed)
    return HealthReport(
        status=status,
        healthy=status in ("ok", "degraded"),
        stages=stages,
        unhealthy_stages=tuple(s.stage_id for s in stages if not s.healthy),
        requests_in_flight=stats.requests_in_flight,
        requests_waiting=stats.requests_waiting,
        paused=stats.paused,
        closed=stats.closed,
    )
