"""Communicators of every distinct allocation (device mesh + layout) of an execution plan.

With per-call placement a role's calls may each use their own devices and layout, so groups are keyed by the
allocation, not by the role. Creating a group is collective over the whole world: every rank builds every
allocation's mesh, in the same (sorted) order, members or not; non-members just hold no coordinates.
Ranks inside an allocation are tp-fastest, pp-slowest: the allocation's rank r runs on device ``devices[r]``
with ``r = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``.

A device's groups are the lines of its allocation's (pp, dp, tp) mesh through it: ``tp_mesh`` the ranks of its
stage and replica, ``dp_group`` those with its stage and TP rank, ``pp_group`` those with its replica and TP rank
(one per stage, ordered by stage), so pipeline messages pass between equal TP ranks of neighbouring stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loomrl.plan.layout import Layout


@dataclass(frozen=True, order=True)
class AllocKey:
    """The identity of an allocation as far as communication and sharding go."""

    devices: tuple[int, ...]
    dp: int
    tp: int
    pp: int = 1
    fsdp: bool = False
    """The role's weights are sharded over dp (:mod:`loomrl.parallel.fsdp`): a placement of its own."""

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp)

    def coords(self, device: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a member device."""
        rank = self.devices.index(device)
        return rank // (self.dp * self.tp), rank % (self.dp * self.tp) // self.tp, rank % self.tp

    def publishes(self, device: int) -> bool:
        """One device per data-parallel replica reports results: tensor rank 0 of the last pipeline stage."""
        pp_rank, _, tp_rank = self.coords(device)
        return tp_rank == 0 and pp_rank == self.pp - 1


@dataclass(frozen=True)
class AllocGroups:
    key: AllocKey
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    tp_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    pp_rank: int
    dp_rank: int
    tp_rank: int


class AllocationGroups:
    """``groups[key]`` for this device; every rank constructs it with the same keys."""

    def __init__(self, device: int, keys: list[AllocKey], device_type: str):
        self._groups: dict[AllocKey, AllocGroups] = {}
        for key in sorted(set(keys)):
            size = key.dp * key.tp
            grid = [[[key.devices[p * size + d * key.tp + t] for t in range(key.tp)] for d in range(key.dp)]
                    for p in range(key.pp)]
            mesh = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp", "tp"))
            if device in key.devices:
                pp_rank, dp_rank, tp_rank = key.coords(device)
                self._groups[key] = AllocGroups(key, mesh.get_group("dp"), mesh.get_group("pp"), mesh["tp"],
                                                mesh["dp"], pp_rank, dp_rank, tp_rank)

    def __getitem__(self, key: AllocKey) -> AllocGroups:
        return self._groups[key]

    def __contains__(self, key: AllocKey) -> bool:
        return key in self._groups
