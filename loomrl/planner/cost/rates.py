"""What one device of an allocation computes and moves at: its share of the profile's rates and the link of each
parallel axis."""

from __future__ import annotations

from collections import Counter

from loomrl.plan import Allocation, ClusterSpec
from loomrl.plan.hardware import HardwareProfile
from loomrl.plan.layout import Coords
from loomrl.planner.cost.cache import Rates

__all__ = ["allocation_rates"]


def allocation_rates(profile: HardwareProfile, cluster: ClusterSpec, alloc: Allocation) -> Rates:
    """Links per parallel axis (inter-node if any group of that axis spans nodes; within a node at NCCL's bus
    bandwidth) and the slowdown of devices sharing cores: a call keeping k devices of a node busy on a node with
    fewer cores runs at cores/k of the per-device rate. The matmul rate is what passes reach
    (``matmul_efficiency`` of the peak)."""
    p, lay = profile, alloc.layout
    groups = {
        "tp": [[alloc.device(Coords(s, d, t)) for t in range(lay.tp)] for d in range(lay.dp) for s in range(lay.pp)],
        "dp": [[alloc.device(Coords(s, d, t)) for d in range(lay.dp)] for t in range(lay.tp) for s in range(lay.pp)],
        "pp": [[alloc.device(Coords(s, d, t)) for s in range(lay.pp)] for d in range(lay.dp) for t in range(lay.tp)],
    }

    def spans_nodes(devices: list[int]) -> bool:
        return len({cluster.node_of(d) for d in devices}) > 1

    intra = p.intra_node_bw * p.intra_bus_efficiency
    bw = {axis: p.inter_node_bw if any(spans_nodes(g) for g in gs) else intra for axis, gs in groups.items()}
    slowdown = 1.0
    if p.devices_share_cores > 1:
        busiest = max(Counter(cluster.node_of(d) for d in alloc.mesh).values())
        cores = cluster.devices_per_node / p.devices_share_cores
        slowdown = max(1.0, busiest / cores)
    return Rates(
        p.matmul_flops * p.matmul_efficiency / slowdown,
        p.mem_bandwidth / slowdown,
        bw["tp"],
        bw["dp"],
        bw["pp"],
        p.link_latency,
        p.op_overhead * slowdown,
    )
