"""The ``vllm`` backend: one replica is one real vLLM ``AsyncLLM`` in a worker thread.

- :mod:`~omni_trio.backends.vllm.backend`: :class:`VllmBackend`, the replica as the pool sees
  it (requests, aborts, credit, death, stop);
- :mod:`~omni_trio.backends.vllm.worker`: the worker thread's side, the engine on its own loop;
  :mod:`~omni_trio.backends.vllm.engine_requests`: the requests in that engine;
- :mod:`~omni_trio.backends.vllm.protocol`: the messages between the two sides;
- :mod:`~omni_trio.backends.vllm.prompts`: sampling params and rendered prompts;
  :mod:`~omni_trio.backends.vllm.multimodal`: multimodal cache keys scoped to a replica;
  :mod:`~omni_trio.backends.vllm.streaming`: input that arrives in segments;
- :mod:`~omni_trio.backends.vllm.outputs`: one batch of outputs per engine step, credit;
- :mod:`~omni_trio.backends.vllm.process`: importing vLLM, spawning and reaping its processes;
  :mod:`~omni_trio.backends.vllm.plugin`: the vLLM general plugin loaded in each of them,
  which asks for AMX tile state (:mod:`~omni_trio.backends.vllm.amx`) and stops an
  EngineCore whose frontend died (:mod:`~omni_trio.backends.vllm.parent_watch`), and
  makes torchvision importable where a model of the Qwen-VL family needs it
  (:mod:`~omni_trio.backends.vllm.torchvision_cpu`).

vllm is imported in the worker thread only, so ``import omni_trio`` stays light.
"""
