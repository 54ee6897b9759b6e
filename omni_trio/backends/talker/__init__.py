"""The ``talker`` backend: a Qwen-Omni talker run step by step in worker threads.

- :mod:`~omni_trio.backends.talker.backend`: :class:`TalkerBackend`, the replica (loading the
  talker, one decode step per worker-thread call, frames streamed as outputs).

torch and transformers are imported when a replica starts.
"""
