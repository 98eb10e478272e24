"""Communicators of every distinct allocation (device mesh + layout) of an execution plan.

With per-call placement a role's calls may each use their own devices and layout, so groups are keyed by the
allocation, not by the role. Creating a group is collective over the whole world: every rank builds every
allocation's mesh, in the same (sorted) order, members or not; non-members just hold no coordinates. Ranks
inside an allocation follow :meth:`loomrl.plan.layout.Layout.coords`: tp fastest, pp slowest.

A device's groups are the lines of its allocation's (pp, dp, tp) mesh through it: ``tp_mesh`` the ranks of its
stage and replica, ``dp_group`` those with its stage and TP rank, ``pp_group`` those with its replica and TP rank
(one per stage, ordered by stage), so pipeline messages pass between equal TP ranks of neighbouring stages.
Only the devices and the layout decide the groups: allocations differing in their options (micro-batches,
FSDP, ...) share them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loomrl.plan.allocation import Allocation
from loomrl.plan.layout import Coords, Layout

__all__ = ["AllocGroups", "AllocationGroups"]


@dataclass(frozen=True)
class AllocGroups:
    """One device's communicators in one allocation."""

    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    tp_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    coords: Coords
    mesh_group: dist.ProcessGroup
    """Every rank of the allocation (e.g. for a fused stage's generation replicas to agree on a migration)."""
    pp_back_group: dist.ProcessGroup | None = None
    """A second communicator over ``pp_group``'s ranks (pp > 1), for the gradients of a fused pipeline step
    (:mod:`loomrl.parallel.pipeline_fusion`): one communicator per direction."""
    stage_ranks: tuple[int, ...] = ()
    """The device (global rank) of each pipeline stage of this device's replica and TP rank, in stage order."""
    tied_group: dist.ProcessGroup | None = None
    """The first and the last stage of this device's line (on those stages when pp > 1; ``pp_group`` itself when
    pp = 2), which sum the gradient of a tied embedding both hold (:mod:`loomrl.parallel.pipeline`)."""

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp


def _mesh_key(alloc: Allocation) -> tuple[tuple[int, ...], Layout]:
    return alloc.devices, alloc.layout


class AllocationGroups:
    """``groups[alloc]`` for this device; every rank builds it, and each :meth:`add`, with the same allocations."""

    def __init__(self, device: int, allocations: Iterable[Allocation], device_type: str):
        self.device, self.device_type = device, device_type
        self._groups: dict[tuple[tuple[int, ...], Layout], AllocGroups | None] = {}
        self.add(allocations)

    def add(self, allocations: Iterable[Allocation]) -> None:
        """Create the communicators of the allocations not seen yet (collective over the world: every rank
        calls it with the same allocations)."""
        new = sorted(
            {_mesh_key(a) for a in allocations} - set(self._groups),
            key=lambda k: (k[0], k[1].dp, k[1].tp, k[1].pp, k[1].reverse),
        )
        for devices, layout in new:
            grid = [
                [[devices[layout.rank(Coords(p, d, t))] for t in range(layout.tp)] for d in range(layout.dp)]
                for p in range(layout.pp)
            ]
            mesh = DeviceMesh(self.device_type, grid, mesh_dim_names=("pp", "dp", "tp"))
            whole = dist.new_group(list(devices)) if len(devices) > 1 else None  # collective: every rank creates it
            back, ends = {}, {}
            if layout.pp > 1:  # collective too: every rank creates every line's groups, in the same order
                for d in range(layout.dp):
                    for t in range(layout.tp):
                        line = tuple(grid[p][d][t] for p in range(layout.pp))
                        back[line] = dist.new_group(sorted(line))
                        if layout.pp > 2:
                            ends[line] = dist.new_group(sorted((line[0], line[-1])))
            self._groups[(devices, layout)] = None
            if self.device in devices:
                coords = layout.coords(devices.index(self.device))
                line = tuple(grid[p][coords.dp][coords.tp] for p in range(layout.pp))
                pp_group = mesh.get_group("pp")
                self._groups[(devices, layout)] = AllocGroups(
                    mesh.get_group("dp"),
                    pp_group,
                    mesh["tp"],
                    mesh["dp"],
                    coords,
                    whole,
                    back.get(line),
                    line,
                    None if 0 < coords.pp < layout.pp - 1 else pp_group if layout.pp == 2 else ends.get(line),
                )

    def __getitem__(self, alloc: Allocation) -> AllocGroups:
        groups = self._groups.get(_mesh_key(alloc))
        if groups is None:
            raise KeyError(f"device {self.device} has no communicators in allocation {alloc.text}")
        return groups

    def __contains__(self, alloc: Allocation) -> bool:
        return self._groups.get(_mesh_key(alloc)) is not None
