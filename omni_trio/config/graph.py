"""The stage graph of a pipeline: index maps, downstream lists, topological order, ancestors.

Built once per config (``PipelineConfig`` caches it), without recursion, in O(n log n) for n
stages and their edges, so a 20,000-stage chain listed in any order is checked in well under a
second. Raises :class:`~omni_trio.errors.ConfigError` for an unknown input or a cycle.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from ..errors import ConfigError

__all__ = ["StageGraph", "few_ids", "some_ids"]


def few_ids(ids: Sequence[str]) -> str:
    """``[...]`` of stage ids for an error message, cut short for big pipelines. Pure."""
    more = f" ... ({len(ids)} in all)" if len(ids) > 10 else ""
    return f"{list(ids[:10])}{more}"


def some_ids(ids: Sequence[str]) -> str:
    """``stages are [...]`` for an error message, cut short for big pipelines. Pure."""
    return f"stages are {few_ids(ids)}"


def _arrows(cycle: list[str]) -> str:
    # a cycle through thousands of stages: its ends, and how many it has
    if len(cycle) <= 12:
        return " -> ".join(cycle)
    return f"{' -> '.join(cycle[:5])} -> ... -> {' -> '.join(cycle[-5:])} ({len(cycle) - 1} stages)"


class StageGraph:
    """The stage graph of one config: index maps, downstream lists, topological order.

    Built in O(n log n) without recursion; raises ConfigError for an unknown input or a cycle.
    """

    def __init__(self, ids: list[str], inputs: list[list[str]], source: str | None) -> None:
        self.ids = ids
        self.index = {sid: i for i, sid in enumerate(ids)}
        self.downstream: dict[str, list[str]] = {sid: [] for sid in ids}
        self._ancestors: dict[str, frozenset[str]] = {}
        self._inputs = inputs
        waiting = [0] * len(ids)
        for i, (sid, ups) in enumerate(zip(ids, inputs, strict=True)):
            for j, up in enumerate(ups):
                if up not in self.index:
                    raise ConfigError(
                        f"unknown input stage {up!r}; {some_ids(ids)}",
                        path=f"$.stages[{i}].inputs[{j}]",
                        source=source,
                    )
                self.downstream[up].append(sid)
            waiting[i] = len(set(ups))
        # Kahn's algorithm; the heap keeps ties in config order
        ready = [i for i, n in enumerate(waiting) if n == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(self.ids[i])
            for down in self.downstream[self.ids[i]]:
                d = self.index[down]
                waiting[d] -= 1
                if waiting[d] == 0:
                    heapq.heappush(ready, d)
        if len(order) < len(self.ids):
            cycle = self._cycle(waiting)
            raise ConfigError(
                f"the stage graph has a cycle: {_arrows(cycle)}",
                path=f"$.stages[{self.index[cycle[0]]}].inputs",
                source=source,
            )
        self.order = order

    def _cycle(self, waiting: list[int]) -> list[str]:
        # every stage Kahn's algorithm left has an input that was left too: follow those
        at = next(i for i, n in enumerate(waiting) if n > 0)
        path: list[int] = []
        pos: dict[int, int] = {}
        while at not in pos:
            pos[at] = len(path)
            path.append(at)
            at = next(self.index[u] for u in self._inputs[at] if waiting[self.index[u]] > 0)
        return [self.ids[i] for i in path[pos[at] :]] + [self.ids[at]]

    def closure(self, stage_ids: Iterable[str]) -> set[str]:
        """``stage_ids`` and every stage they depend on, transitively: one walk, linear in
        the stages and edges it reaches (not one ancestor set per stage)."""
        seen: set[str] = set()
        todo = list(stage_ids)
        while todo:
            sid = todo.pop()
            if sid not in seen:
                seen.add(sid)
                todo.extend(self._inputs[self.index[sid]])
        return seen

    def ancestors(self, stage_id: str) -> frozenset[str]:
        """Every stage ``stage_id`` depends on, transitively (cached per stage)."""
        found = self._ancestors.get(stage_id)
        if found is None:
            seen: set[str] = set()
            todo = list(self._inputs[self.index[stage_id]])
            while todo:
                sid = todo.pop()
                if sid not in seen:
                    seen.add(sid)
                    todo.extend(self._inputs[self.index[sid]])
            found = self._ancestors[stage_id] = frozenset(seen)
        return found
