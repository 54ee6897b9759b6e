"""Which replica of a stage takes a request: the balancing policies, as small pure functions.

A stage's pool asks its :class:`Balancer` to pick one of the replicas that may take a request
now (live, with a free slot), given as :class:`ReplicaLoad` in replica-index order. The
policies (``lb_policy`` in the config) are:

- ``least_loaded``: fewest requests in flight; ties go round-robin (the first tied replica
  after the one chosen last, cyclically), so equal replicas share the work evenly instead of
  the lowest index taking every tie.
- ``round_robin``: the first replica after the one chosen last, cyclically; a replica that is
  not a candidate (dead, draining, full, removed) is simply skipped.
- ``random``: uniform over the candidates, reproducible with ``lb_seed``.

Replica indexes are stable (they survive restarts) and may have gaps after removals, so "the
one chosen last" is remembered by index, not by position. Nothing here checkpoints, reads a
clock or touches a replica: the pool keeps the binding sticky and does the I/O; this module
is tested on its own (``tests/stages/test_balancing.py``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from ..config.stage import LbPolicy
from ..errors import ConfigError

__all__ = [
    "LB_POLICIES",
    "Balancer",
    "ReplicaLoad",
    "effective_policy",
    "least_loaded",
    "random_choice",
    "round_robin",
]

#: every ``lb_policy`` value, in the order the config documents them
LB_POLICIES: tuple[LbPolicy, ...] = get_args(LbPolicy)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica that may take a request now: its stable ``index`` (kept across restarts,
    possibly with gaps after removals) and its requests ``in_flight``."""

    index: int
    in_flight: int


def _first_after(
    candidates: Sequence[ReplicaLoad], positions: Sequence[int], last: int | None
) -> int:
    # ``positions`` ascend with the replica index, so the first one past ``last`` is the next
    # in cyclic order; none past it wraps around to the lowest
    if last is not None:
        for position in positions:
            if candidates[position].index > last:
                return position
    return positions[0]


def _check(candidates: Sequence[ReplicaLoad]) -> None:
    if not candidates:
        raise ValueError("a balancing policy needs at least one candidate replica")


def least_loaded(candidates: Sequence[ReplicaLoad], last: int | None) -> int:
    """The position in ``candidates`` (non-empty, in index order) of the replica with the
    fewest requests in flight. Among tied replicas, the first whose index is greater than
    ``last`` (the index chosen last time), cyclically; ``last=None`` takes the lowest index.
    Pure. Raises ``ValueError`` when ``candidates`` is empty."""
    _check(candidates)
    low = min(c.in_flight for c in candidates)
    tied = [p for p, c in enumerate(candidates) if c.in_flight == low]
    return _first_after(candidates, tied, last)


def round_robin(candidates: Sequence[ReplicaLoad], last: int | None) -> int:
    """The position in ``candidates`` (non-empty, in index order) of the first replica whose
    index is greater than ``last``, cyclically (``last=None``: the lowest index). Replicas
    missing from ``candidates`` are skipped. Pure. Raises ``ValueError`` when empty."""
    _check(candidates)
    return _first_after(candidates, range(len(candidates)), last)


def random_choice(candidates: Sequence[ReplicaLoad], rng: random.Random) -> int:
    """A uniformly random position in ``candidates`` (non-empty), drawn from ``rng``: the
    same seed gives the same sequence of choices. Synchronous; changes only ``rng``'s state.
    Raises ``ValueError`` when ``candidates`` is empty."""
    _check(candidates)
    return rng.randrange(len(candidates))


def effective_policy(stage_policy: LbPolicy | None, pipeline_policy: LbPolicy) -> LbPolicy:
    """A stage's ``lb_policy``, or the pipeline's when the stage leaves it unset. Pure."""
    return pipeline_policy if stage_policy is None else stage_policy


class Balancer:
    """The balancing state of one stage's pool: its policy, the replica index chosen last
    (for round-robin order and ``least_loaded``'s ties) and, for ``random``, a
    ``random.Random(seed)`` of its own (``seed=None``: seeded from the OS).

    Synchronous and not thread-safe: one pool's task calls :meth:`choose`. Raises
    :class:`ConfigError` for an unknown ``policy``.
    """

    __slots__ = ("_rng", "last", "policy", "seed")

    def __init__(self, policy: LbPolicy, seed: int | None = None) -> None:
        if policy not in LB_POLICIES:
            allowed = ", ".join(repr(p) for p in LB_POLICIES)
            raise ConfigError(
                f"unknown lb_policy {policy!r}; expected one of {allowed}", path="$.lb_policy"
            )
        self.policy: LbPolicy = policy
        self.seed = seed
        #: the replica index chosen last (``None`` before the first choice)
        self.last: int | None = None
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        """The position in ``candidates`` (non-empty, in index order) of the replica to take
        the next request, by this balancer's policy; remembers its index as :attr:`last`.
        Synchronous, never checkpoints. Raises ``ValueError`` when ``candidates`` is empty."""
        if self.policy == "least_loaded":
            position = least_loaded(candidates, self.last)
        elif self.policy == "round_robin":
            position = round_robin(candidates, self.last)
        else:
            position = random_choice(candidates, self._rng)
        self.last = candidates[position].index
        return position

    def __repr__(self) -> str:
        return f"Balancer(policy={self.policy!r}, seed={self.seed!r}, last={self.last!r})"
