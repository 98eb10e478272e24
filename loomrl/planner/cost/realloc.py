"""Pricing a parameter reallocation by running the real transfer planner and timing its transfers.

:func:`loomrl.plan.plan_reallocation` says which piece of which parameter each device sends to whom. The
executor packs every route's pieces (a sender and its receivers) into one buffer and sends it, so a
device's time is

    max(sent bytes, received bytes) over its links    (links are full duplex: sends and receives overlap)
    + packing and unpacking: each byte read and written once on either side, and local copies likewise
    + one message start-up per route the device takes part in,

with bytes to or from another node over ``inter_node_bw`` and the rest over ``intra_node_bw``; a broadcast
leaves its sender once (over the slower link if any receiver is on another node). The reallocation takes as
long as its busiest device.

**The reduced model.** Planning a 7B model's real shapes yields pieces per row of every row-split weight
(seconds per plan), too slow inside a plan search. The planner is instead run on a copy of the model whose
dimensions are multiples of ``r = lcm(tp_src, tp_dst)`` in about the true proportions (hidden ``2r``, the
others rounded to their ratio to it) and whose layer count is the largest multiple of
``lcm(pp_src, pp_dst)`` up to :data:`REDUCED_LAYERS` dividing the true count; each piece's bytes are then
scaled by its parameter's true size over its reduced size (times true layers per reduced layer). What each
device *receives* is exact whenever tp divides every split dimension (every shard is then the same fraction
of a parameter at any size) and the reduced layers map onto the same stages (they do: stage boundaries fall
on multiples of layers/pp). What each device *sends* is approximate: the planner balances replicated
senders by elements already assigned, and the reduced sizes can break its ties differently. Against
planning the true shapes of a 16-layer, 1024-hidden model over eight layout pairs the priced time was within
1.3% (the tests hold a small model to 5%), at ~10 ms per pair instead of ~1 s; results are cached.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from loomrl.plan import Allocation, ClusterSpec, ReallocPlan, plan_reallocation
from loomrl.plan.hardware import HardwareProfile
from loomrl.plan.model_shape import ModelShape

REDUCED_LAYERS = 4
"""Layers of the reduced model when the pipeline degrees allow (a multiple of both, dividing the true count)."""
REDUCED_HIDDEN_UNITS = 2
"""The reduced hidden size in multiples of ``lcm(tp_src, tp_dst)``; the other dimensions keep their ratio to it
(rounded to such multiples), so the planner's sender balance sees parameters in their true proportions."""

__all__ = ["DeviceLoad", "device_loads", "price_loads", "realloc_seconds", "reduced_model"]


def reduced_model(
    shape: ModelShape, src: Allocation, dst: Allocation
) -> tuple[dict[str, tuple[int, ...]], int, dict[str, float]]:
    """The reduced parameter shapes, their layer count and each parameter's bytes scale (see module doc)."""
    step = math.lcm(src.layout.pp, dst.layout.pp)
    if shape.layers % step:
        layers = shape.layers  # the real planner will report the stage mismatch
    else:  # the most layers up to REDUCED_LAYERS that keep whole stages: more draws for the sender balance
        layers = max(n for n in range(step, max(step, REDUCED_LAYERS) + 1, step) if shape.layers % n == 0)
    r = math.lcm(src.layout.tp, dst.layout.tp, src.layout.dp if src.fsdp else 1)  # FSDP: dp splits rows too
    unit = shape.hidden / REDUCED_HIDDEN_UNITS
    true_dims = {
        "hidden": shape.hidden,
        "q": shape.q_dim,
        "kv": shape.kv_dim,
        "intermediate": shape.intermediate,
        "vocab": shape.vocab,
        "experts": shape.experts * shape.expert_intermediate,
    }
    reduced = shape.moving_shapes(layers, {k: r * max(1, round(d / unit)) for k, d in true_dims.items()})
    true = shape.moving_shapes(layers)  # a LoRA model's adapters only: its copies keep the base
    per_layer = shape.layers / layers
    scale = {
        name: math.prod(true[name]) / math.prod(dims) * (per_layer if ".layers." in name else 1.0)
        for name, dims in reduced.items()
    }
    return reduced, layers, scale


@dataclass
class DeviceLoad:
    """Bytes one device moves in a reallocation, by link, and the routes it takes part in."""

    send_intra: float = 0.0
    send_inter: float = 0.0
    recv_intra: float = 0.0
    recv_inter: float = 0.0
    copied: float = 0.0
    """Bytes packed, unpacked or copied locally (each read once and written once)."""
    routes: set[tuple[int, tuple[int, ...]]] = field(default_factory=set)
    """Routes (sender, receivers) the device sends or receives on: one message start-up each."""


def device_loads(plan: ReallocPlan, scale: dict[str, float], bytes_per_elem: float) -> dict[int, DeviceLoad]:
    """Per-device bytes of ``plan`` with each piece's size scaled by ``scale[param]``. Bytes are summed per
    route (sender, receivers) first and handed to the route's devices once: a broadcast to hundreds of devices
    carries thousands of pieces."""
    loads: dict[int, DeviceLoad] = defaultdict(DeviceLoad)
    nodes = plan.nodes
    routes: dict[tuple[int, tuple[int, ...]], float] = defaultdict(float)
    for t in plan.transfers:
        nbytes = t.numel * scale[t.param] * bytes_per_elem
        if t.local:
            if not plan.aliased(t.sender, t.param):
                loads[t.sender].copied += nbytes
            continue
        routes[(t.sender, t.receivers)] += nbytes
    for route, nbytes in routes.items():
        sender_id, receivers = route
        sender = loads[sender_id]
        if any(nodes[r] != nodes[sender_id] for r in receivers):
            sender.send_inter += nbytes
        else:
            sender.send_intra += nbytes
        sender.copied += nbytes
        sender.routes.add(route)
        for r in receivers:
            load = loads[r]
            if nodes[r] != nodes[sender_id]:
                load.recv_inter += nbytes
            else:
                load.recv_intra += nbytes
            load.copied += nbytes
            load.routes.add(route)
    return dict(loads)


def price_loads(loads: dict[int, DeviceLoad], profile: HardwareProfile) -> float:
    """Seconds of the busiest device (see the module docstring for the per-device time)."""
    worst = 0.0
    for load in loads.values():
        send = load.send_intra / profile.intra_node_bw + load.send_inter / profile.inter_node_bw
        recv = load.recv_intra / profile.intra_node_bw + load.recv_inter / profile.inter_node_bw
        copy = 2 * load.copied / profile.mem_bandwidth
        worst = max(worst, max(send, recv) + copy + len(load.routes) * profile.link_latency)
    return worst


def realloc_seconds(
    shape: ModelShape,
    src: Allocation,
    dst: Allocation,
    cluster: ClusterSpec,
    profile: HardwareProfile,
    bytes_per_elem: float,
) -> float:
    """Seconds to move a model of ``shape`` from ``src`` to ``dst`` (0 when the placements are the same)."""
    if src.shards == dst.shards:
        return 0.0
    params, layers, scale = reduced_model(shape, src, dst)
    plan = plan_reallocation(params, layers, src, dst, cluster.node_of, tied=shape.tied)
    return price_loads(device_loads(plan, scale, bytes_per_elem), profile)
