"""Stage replicas placed in Ray actors (a stage with ``placement: {ray: ...}``).

- :mod:`~omni_trio.backends.ray.backend`: :class:`RayBackend`, the replica as the pool sees it
  in the user's process;
- :mod:`~omni_trio.backends.ray.actor`: what runs in the actor (any other backend, under the
  ordinary contract);
- :mod:`~omni_trio.backends.ray.link`: the process's link to Ray (the connection, the loop
  where Ray calls are awaited).

ray is imported on first use.
"""
