"""What the benchmark scripts share (each ``benchmarks/bench_*.py`` is a script: it runs with
``benchmarks/`` on ``sys.path`` and imports this package as ``harness``). The tests never
import it: they run the scripts (in their quick mode), and the fakes the benchmarks drive
are public, tested where they live (:mod:`omni_trio.testing`).

- :mod:`harness.scripted_cells`: ``bench_orchestrator.py``'s scripted-stage cells (omni-trio
  against the same stages chained by hand) and the per-hop latency;
- :mod:`harness.fake_engine_cells`: its fake engine cells (batching engines with fixed-time
  steps, :class:`omni_trio.testing.FakeEngine`, through omni-trio and chained by hand);
- :mod:`harness.replica_cells`: the replica pool cells of ``bench_replicas.py`` (which
  ``bench_orchestrator.py --replicas`` runs too).
"""
