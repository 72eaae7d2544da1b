"""A simulated dist layer for the group registry: one rank of an N-rank job, every call recorded, nothing sent.

Test and benchmark code (it stands in for ``torch.distributed`` in ``cpscope.groups``' registry), kept out of the
package.

Example::

    from cpscope.groups import registry
    from tests._sim import SimulatedLayer

    registry._LAYER = layer = SimulatedLayer(4096, rank=17)
    groups.new_cp_groups([2 ** i for i in range(13)])     # what rank 17 of 4096 would call
    layer.calls                                          # [("gather", ...), ("new_group", (16, 17), True), ...]
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from cpscope.groups._create import TorchLayer

__all__ = ["SimGroup", "SimulatedLayer"]


class SimGroup:
    """A simulated process group: its sorted member ranks."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = sorted(ranks)
        self.alive = True

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"SimGroup({self.ranks})"


class SimulatedLayer(TorchLayer):
    """One rank of a simulated ``world``-rank job: records every call, communicates nothing.

    Every other participant is assumed to send the same record as this rank (same arguments, torch group count
    ``counts.get(rank, own)``, same cached blocks) unless ``fingerprints`` overrides a rank's argument digest.
    ``calls`` lists ``("new_group" | "split" | "gather", ranks, local)``.

    Example::

        layer = SimulatedLayer(4096, rank=17)
        # cpscope.groups._registry._LAYER = layer; cpscope.new_cp_groups([1, 2, 4, ..., 4096]); layer.calls
    """

    def __init__(self, world: int, rank: int, *, split: bool = False, bound: bool = False,
                 counts: Optional[dict] = None, fingerprints: Optional[dict] = None, count: int = 1) -> None:
        self._world, self._rank = world, rank
        self._split, self._bound = split, bound
        self.counts, self.fingerprints = dict(counts or {}), dict(fingerprints or {})
        self.count = self.counts.get(rank, count)
        self.world_token = SimGroup(range(world))
        self.calls: list[tuple] = []

    def is_initialized(self) -> bool:
        return True

    def world_size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def world(self) -> Any:
        return self.world_token

    def bound_device(self) -> Any:
        return "cuda:0" if self._bound else None

    def can_split(self) -> bool:
        return self._split

    def local_name_count(self) -> Optional[int]:
        return self.count

    def local_ok(self) -> bool:
        return True

    def all_gather(self, obj: Any, group: Any) -> list:
        ranks = range(self._world) if group is None else group.ranks
        self.calls.append(("gather", tuple(ranks), False))
        return [obj for _ in ranks]

    def all_gather_ints(self, values: Sequence[int], group: Any) -> list[list[int]]:
        ranks = range(self._world) if group is None else group.ranks
        self.calls.append(("gather", tuple(ranks), False))
        fp, count = values[0], values[1]
        over = {r: int(self.fingerprints[r], 16) if self.fingerprints[r] else 0 for r in self.fingerprints}
        return [list(values) if r == self._rank else
                [over.get(r, fp), self.counts.get(r, count), *values[2:]] for r in ranks]

    def new_group(self, ranks: Sequence[int], *, local: bool) -> Any:
        self.calls.append(("new_group", tuple(ranks), local))
        if self._rank not in ranks:
            return None if local else "NON_GROUP_MEMBER"
        self.count += 1
        return SimGroup(ranks)

    def split(self, parent: Any, split_ranks: Sequence[Sequence[int]]) -> Any:
        members = range(self._world) if parent is None else parent.ranks
        blocks = [[members[i] for i in b] for b in split_ranks]
        self.calls.append(("split", tuple(map(tuple, blocks)), False))
        for b in blocks:
            if self._rank in b:
                self.count += 1
                return SimGroup(b)
        return None

    def ranks_of(self, group: Any) -> list[int]:
        return list(group.ranks)

    def registered(self, group: Any) -> bool:
        return bool(getattr(group, "alive", False))
