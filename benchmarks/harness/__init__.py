"""What the benchmark scripts share (each ``benchmarks/bench_*.py`` is a script: it runs with
``benchmarks/`` on ``sys.path`` and imports this package as ``harness``). The tests run the
scripts (in their quick mode), but for ``tests/test_bench_vllm_pipeline.py``, which imports
the vLLM pipeline's pure summary helpers; and the fakes the benchmarks drive
are public, tested where they live (:mod:`omni_trio.testing`).

- :mod:`harness.scripted_cells`: ``bench_orchestrator.py``'s scripted-stage cells (omni-trio
  against the same stages chained by hand) and the per-hop latency;
- :mod:`harness.fake_engine_cells`: its fake engine cells (batching engines with fixed-time
  steps, :class:`omni_trio.testing.FakeEngine`, through omni-trio and chained by hand);
- :mod:`harness.replica_cells`: the replica pool cells of ``bench_replicas.py`` (which
  ``bench_orchestrator.py --replicas`` runs too);
- ``bench_sessions.py``'s parts: :mod:`harness.session_cells` (a live session's turns and
  one-shot requests on one engine, each read into a watch of its milestones: the rate, barge-in
  and first-audio cells) and :mod:`harness.session_ws` (the same over ``WS /v1/realtime``
  against ``POST /v1/completions``);
- ``bench_vllm_pipeline.py``'s parts: :mod:`harness.vllm_cells` (the cells, systems and
  engine settings), :mod:`harness.vllm_child` (one system on one cell, in a subprocess),
  :mod:`harness.vllm_trio` (the no-orchestrator trio floor), :mod:`harness.vllm_procs` (the
  processes a run spawned and what outlived it), :mod:`harness.vllm_summary` (a cell's
  summary); ``bench_heap.py`` drives its batches through :mod:`harness.vllm_cells` too;
- :mod:`harness.pd_hand`: a prefill -> decode KV handoff driven by hand on vLLM's CPU build
  (ExampleConnector, no omni-trio in the request path), and what that connector loads, which
  ``bench_pd.py`` checks its decodes against.
"""
