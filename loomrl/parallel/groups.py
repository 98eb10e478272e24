"""The one registry of communicators of a worker: per-role data- and tensor-parallel groups over one world.

Every worker process builds a :class:`ProcessGroups` right after ``torch.distributed.init_process_group``,
from the same ``{role: Layout}`` mapping. Creating a process group is a collective over the whole world: every
rank must create every group, members or not, in the same order, or ranks pair up the wrong groups and hang.
So each distinct layout, in the order of the sorted role names that first use it, becomes one
``DeviceMesh`` of shape ``(dp, tp)`` over all ranks; building that mesh creates all of its dp and tp groups on
every rank. Roles with equal layouts share one mesh, hence one set of communicators.

Ranks are tp-fastest: ``rank = dp_rank * tp + tp_rank``. Nothing here is a module global; tear-down is
``torch.distributed.destroy_process_group()`` by the owner of the world, which destroys these groups too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loomrl.errors import ConfigError
from loomrl.parallel.layout import Layout


@dataclass(frozen=True)
class RoleGroups:
    """The communicators and coordinates of this rank for one role."""

    layout: Layout
    mesh: DeviceMesh
    """The role's 2-D ``(dp, tp)`` mesh over all ranks."""
    dp_group: dist.ProcessGroup
    """Ranks holding the same tensor-parallel shard of different data (gradients are summed here)."""
    tp_group: dist.ProcessGroup
    """Ranks holding the shards of one model replica."""
    tp_mesh: DeviceMesh
    """1-D mesh over ``tp_group``'s ranks, for DTensor (``apply_tensor_parallel``)."""
    dp_rank: int
    tp_rank: int

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp


class ProcessGroups:
    """Per-role groups of this rank; ``groups["actor"].tp_group``. Build on every rank, in the same way."""

    def __init__(self, rank: int, world: int, layouts: Mapping[str, Layout], device_type: str):
        """``device_type`` is the type of the workers' devices ('cuda', 'cpu', ...), as DeviceMesh needs it."""
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroups needs torch.distributed.init_process_group to have run")
        if (rank, world) != (dist.get_rank(), dist.get_world_size()):
            raise RuntimeError(f"rank {rank} of world {world} disagrees with torch.distributed "
                               f"(rank {dist.get_rank()} of {dist.get_world_size()})")
        for role, lay in sorted(layouts.items()):
            if lay.size != world:
                raise ConfigError(f"{role}: dp={lay.dp} × tp={lay.tp} × pp={lay.pp} = {lay.size} devices, "
                                  f"but the world has {world}")
            if lay.pp != 1:
                raise ConfigError(f"{role}.pp: {lay.pp} is not supported yet (must be 1)")
        self.rank, self.world, self.device_type = rank, world, device_type
        self.world_group: dist.ProcessGroup = dist.group.WORLD
        """All ranks: the default group (for barriers and world-wide reductions)."""
        meshes: dict[Layout, DeviceMesh] = {}
        self._roles: dict[str, RoleGroups] = {}
        for role in sorted(layouts):  # the order every rank creates groups in
            layout = layouts[role]
            if layout not in meshes:
                meshes[layout] = self._build_mesh(layout)
            self._roles[role] = self._role_groups(layout, meshes[layout])

    def _build_mesh(self, layout: Layout) -> DeviceMesh:
        ranks = [[dp * layout.tp + tp for tp in range(layout.tp)] for dp in range(layout.dp)]
        return DeviceMesh(self.device_type, ranks, mesh_dim_names=("dp", "tp"))

    def _role_groups(self, layout: Layout, mesh: DeviceMesh) -> RoleGroups:
        return RoleGroups(layout=layout, mesh=mesh, dp_group=mesh.get_group("dp"), tp_group=mesh.get_group("tp"),
                          tp_mesh=mesh["tp"], dp_rank=self.rank // layout.tp, tp_rank=self.rank % layout.tp)

    def __getitem__(self, role: str) -> RoleGroups:
        try:
            return self._roles[role]
        except KeyError:
            raise KeyError(f"no process groups for role '{role}' (roles: {', '.join(sorted(self._roles))})") from None

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(sorted(self._roles))
