import random
from collections import Counter

import pytest

from omni_trio import ConfigError, load_config
from omni_trio.stages.balancing import (
    LB_POLICIES,
    Balancer,
    ReplicaLoad,
    effective_policy,
    least_loaded,
    random_choice,
    round_robin,
)


def loads(*in_flight, indexes=None):
    indexes = range(len(in_flight)) if indexes is None else indexes
    return [ReplicaLoad(i, n) for i, n in zip(indexes, in_flight, strict=True)]


def chosen_indexes(balancer, candidates, n):
    return [candidates[balancer.choose(candidates)].index for _ in range(n)]


def test_policies_match_the_config_literal():
    assert LB_POLICIES == ("least_loaded", "round_robin", "random")


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_four_equal_replicas_share_100_requests_evenly(policy):
    candidates = loads(0, 0, 0, 0)
    counts = Counter(chosen_indexes(Balancer(policy), candidates, 100))
    assert counts == {0: 25, 1: 25, 2: 25, 3: 25}


def test_least_loaded_balances_requests_that_stay_in_flight():
    # nothing finishes: every choice adds one to the chosen replica's load
    in_flight = [0, 0, 0, 0]
    balancer = Balancer("least_loaded")
    for _ in range(100):
        candidates = loads(*in_flight)
        in_flight[candidates[balancer.choose(candidates)].index] += 1
    assert in_flight == [25, 25, 25, 25]


def test_least_loaded_ties_cycle_instead_of_taking_the_lowest_index():
    assert chosen_indexes(Balancer("least_loaded"), loads(0, 0, 0, 0), 5) == [0, 1, 2, 3, 0]


def test_least_loaded_picks_the_minimum_and_cycles_among_its_ties():
    candidates = loads(3, 1, 2, 1)
    assert least_loaded(candidates, None) == 1
    assert least_loaded(candidates, 1) == 3
    assert least_loaded(candidates, 3) == 1  # wraps around among the tied ones
    assert least_loaded(candidates, 0) == 1
    assert chosen_indexes(Balancer("least_loaded"), candidates, 4) == [1, 3, 1, 3]
    assert least_loaded(loads(5, 0, 5), 1) == 1  # a single minimum wins whatever came last


def test_least_loaded_with_gaps_in_replica_indexes():
    candidates = loads(0, 0, 0, 0, indexes=[0, 2, 5, 7])
    assert chosen_indexes(Balancer("least_loaded"), candidates, 5) == [0, 2, 5, 7, 0]
    assert least_loaded(candidates, 3) == 2  # `last` between indexes: the next one up (5)
    assert least_loaded(candidates, 7) == 0
    # the replica chosen last was removed: its successor takes the next tie
    assert least_loaded(loads(1, 0, 0, indexes=[0, 1, 3]), 2) == 2


def test_round_robin_skips_a_missing_index_and_ignores_load():
    balancer = Balancer("round_robin")
    assert chosen_indexes(balancer, loads(0, 0, 0, 0), 2) == [0, 1]
    without_2 = loads(0, 0, 0, indexes=[0, 1, 3])
    assert chosen_indexes(balancer, without_2, 3) == [3, 0, 1]
    assert chosen_indexes(balancer, loads(0, 0, 0, 0), 2) == [2, 3]
    assert round_robin(loads(9, 0, 0), None) == 0
    assert round_robin(loads(9, 0, 0), 0) == 1
    assert round_robin(loads(0, 0, indexes=[4, 6]), 9) == 0


def test_random_is_reproducible_with_a_seed():
    candidates = loads(0, 0, 0, 0)
    first = chosen_indexes(Balancer("random", seed=7), candidates, 50)
    again = chosen_indexes(Balancer("random", seed=7), candidates, 50)
    other = chosen_indexes(Balancer("random", seed=8), candidates, 50)
    assert first == again
    assert first != other
    rng = random.Random(7)
    assert [random_choice(candidates, rng) for _ in range(50)] == first


def test_random_covers_all_candidates_and_ignores_load():
    candidates = loads(100, 0, 0, 0, indexes=[1, 4, 6, 9])
    balancer = Balancer("random", seed=3)
    counts = Counter(chosen_indexes(balancer, candidates, 400))
    assert set(counts) == {1, 4, 6, 9}
    assert all(60 <= n <= 140 for n in counts.values()), counts
    assert balancer.last in {1, 4, 6, 9}  # an index, not a position


def test_balancer_records_last_and_shows_it():
    balancer = Balancer("round_robin", seed=None)
    assert balancer.last is None
    assert repr(balancer) == "Balancer(policy='round_robin', seed=None, last=None)"
    assert balancer.choose(loads(0, 0, indexes=[3, 8])) == 0
    assert balancer.last == 3
    assert repr(balancer) == "Balancer(policy='round_robin', seed=None, last=3)"


def test_unknown_policy_and_empty_candidates_are_refused():
    with pytest.raises(ConfigError, match="unknown lb_policy 'rr'; expected one of 'least_loaded'"):
        Balancer("rr")  # type: ignore[arg-type]
    for choose in (
        lambda: least_loaded([], None),
        lambda: round_robin([], 0),
        lambda: random_choice([], random.Random(0)),
        lambda: Balancer("least_loaded").choose([]),
    ):
        with pytest.raises(ValueError, match="at least one candidate replica"):
            choose()


def test_effective_policy_falls_back_to_the_pipeline():
    assert effective_policy(None, "random") == "random"
    assert effective_policy("round_robin", "random") == "round_robin"
    cfg = load_config(
        {
            "lb_policy": "round_robin",
            "stages": [
                {"id": "a", "backend": "scripted"},
                {
                    "id": "b",
                    "backend": "scripted",
                    "inputs": ["a"],
                    "lb_policy": "random",
                    "final_output": True,
                },
            ],
        }
    )
    assert [effective_policy(s.lb_policy, cfg.lb_policy) for s in cfg.stages] == [
        "round_robin",
        "random",
    ]
