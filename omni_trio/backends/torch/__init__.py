"""The ``torch`` backend: a torch module run in worker threads with dynamic batching.

- :mod:`~omni_trio.backends.torch.backend`: :class:`TorchBackend`, the replica (requests,
  the batcher task, statistics);
- :mod:`~omni_trio.backends.torch.batching`: when to run a batch and what goes in it, as pure
  functions;
- :mod:`~omni_trio.backends.torch.worker`: what runs in the worker threads (loading the
  module, one batch).

torch is imported on first use.
"""
