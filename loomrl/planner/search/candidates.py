"""Where each call of a plan may run: the search's candidate meshes, layouts and allocations, and the units that
move together.

- :func:`candidate_allocations`: meshes are contiguous device ranges whose size is a power of two inside a node
  (aligned to a multiple of that size within the node), or a power-of-two number of whole nodes (aligned
  likewise), plus the whole cluster. Layouts are ``dp × tp × pp`` equal to the mesh size that the runtime can run
  (:func:`loomrl.plan.layout.check_layout`: tp divides the heads, key/value heads and MLP width, pp divides the
  layers), with every tensor-parallel group inside one node; generation runs with pp = 1. Train and inference
  calls also choose micro-batches (:data:`MICRO_BATCHES`: memory for inference, pipelining too for both); train
  calls whether to recompute activations and, with dp > 1, whether to shard the optimizer state (ZeRO-1) or,
  without pipeline stages, the weights, gradients and optimizer state too (FSDP). A compute step may run on any
  single device.
- :func:`unit_names`: a role's train calls share one allocation; every other call is a unit alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from loomrl.errors import ConfigError
from loomrl.plan import Allocation, ClusterSpec, DeviceSet
from loomrl.plan.layout import Layout, check_layout
from loomrl.plan.model_shape import ModelShape
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = [
    "MICRO_BATCHES",
    "RUNTIME_ARCHITECTURES",
    "Unit",
    "allocations_on",
    "candidate_allocations",
    "device_meshes",
    "layouts_on",
    "memory_alone",
    "scored_by_mesh",
    "shardable",
    "unit_names",
]


MICRO_BATCHES: tuple[int, ...] = (1, 2, 4, 8)
"""Micro-batch counts a train call may choose."""


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def device_meshes(cluster: ClusterSpec) -> list[DeviceSet]:
    """The candidate meshes of ``cluster`` (see the module docstring), smallest first, then by first device."""
    per_node, nodes = cluster.devices_per_node, cluster.nodes
    spans: set[tuple[int, int]] = {(0, cluster.n_devices)}
    for size in _powers_of_two(per_node):
        for node in range(nodes):
            spans |= {(node * per_node + off, size) for off in range(0, per_node - size + 1, size)}
    for k in _powers_of_two(nodes):
        spans |= {(node * per_node, k * per_node) for node in range(0, nodes - k + 1, k)}
    return [DeviceSet(tuple(range(first, first + size))) for first, size in sorted(spans, key=lambda s: (s[1], s[0]))]


def _tp_within_nodes(mesh: DeviceSet, tp: int, cluster: ClusterSpec) -> bool:
    """Whether each tensor-parallel group (``tp`` consecutive ranks) sits on one node."""
    return all(len({cluster.node_of(d) for d in mesh.devices[g : g + tp]}) == 1 for g in range(0, len(mesh), tp))


def layouts_on(mfc: MFC, mesh: DeviceSet, cluster: ClusterSpec, config: object | None) -> list[Layout]:
    """Layouts of ``mfc``'s model on ``mesh`` that the runtime can run (module docstring); pure dp first. A role
    with no model (``config`` None: a rule reward) runs data-parallel only; an architecture loomrl's runtime
    does not build (Qwen3, OPT, mixtures of experts: described for planning) takes the layouts serving and
    training systems run it in (:func:`shardable`)."""
    n, found = len(mesh), []
    if config is None:
        return [Layout(dp=n)]
    for tp in (t for t in range(1, min(n, cluster.devices_per_node) + 1) if n % t == 0):
        if not _tp_within_nodes(mesh, tp, cluster):
            continue
        for pp in (p for p in range(1, n // tp + 1) if (n // tp) % p == 0):
            if pp > 1 and mfc.kind is MFCKind.GENERATE:
                continue
            layout = Layout(n // (tp * pp), tp, pp)
            if shardable(layout, config, n):
                found.append(layout)
    return found


RUNTIME_ARCHITECTURES = ("llama", "qwen2", "gpt2")
"""``model_type`` values loomrl's runtime builds (its zoo's): their layouts must pass the runtime's own check."""


def shardable(layout: Layout, config: object, devices: int) -> bool:
    """Whether ``layout`` can shard the model of ``config``: the runtime's check (:func:`check_layout`) for the
    architectures it builds; for others, what vLLM and Megatron accept: tp divides the query heads and the MLP
    (or expert) width, and divides or is a multiple of the key/value heads (which are then replicated); pp
    divides the layers."""
    if getattr(config, "model_type", None) in RUNTIME_ARCHITECTURES:
        try:
            check_layout(layout, config, devices)
        except ConfigError:
            return False
        return True
    d = ModelShape.from_config(config)
    width = d.expert_intermediate if d.experts else d.intermediate
    tp_ok = (
        d.heads % layout.tp == 0
        and width % layout.tp == 0
        and (d.kv_heads % layout.tp == 0 or layout.tp % d.kv_heads == 0)
    )
    return layout.size == devices and tp_ok and d.layers % layout.pp == 0


def _config(mfc: MFC, model_configs: Mapping[str, object]) -> object:
    role = mfc.role
    if role is None or role not in model_configs:
        raise ConfigError(
            f"model_configs: no config for role '{role}' (MFC {mfc.name}); given: {', '.join(model_configs) or 'none'}"
        )
    return model_configs[role]


def allocations_on(
    mfc: MFC, mesh: DeviceSet, cluster: ClusterSpec, model_configs: Mapping[str, object]
) -> list[Allocation]:
    """Every layout of ``mfc`` on ``mesh`` (× micro-batches for train and inference calls; × recompute and, where
    dp > 1, ZeRO-1 for a train call, or FSDP for one without pipeline stages)."""
    if mfc.kind is MFCKind.COMPUTE:
        return [Allocation(mesh, Layout(dp=len(mesh)))]
    train = mfc.kind is MFCKind.TRAIN
    counts = MICRO_BATCHES if mfc.kind in (MFCKind.TRAIN, MFCKind.INFERENCE) else (1,)  # scoring is micro-batched
    recompute = (False, True) if train else (False,)
    out = []
    for layout in layouts_on(mfc, mesh, cluster, _config(mfc, model_configs)):
        shardings = [(False, False)]  # (zero, fsdp)
        if train and layout.dp > 1:
            shardings += [(True, False)] + ([(False, True)] if layout.pp == 1 else [])
        out += [
            Allocation(mesh, layout, mb, rc, zero, fsdp)
            for mb in counts
            for rc in recompute
            for zero, fsdp in shardings
        ]
    return out


def candidate_allocations(
    mfc: MFC, workflow: Workflow, cluster: ClusterSpec, model_configs: Mapping[str, object]
) -> list[Allocation]:
    """Where ``mfc`` of ``workflow`` may run on ``cluster`` (module docstring); ``model_configs`` maps a role to
    its HF-config-like object (heads, key/value heads, MLP width, layers)."""
    mfc = workflow[mfc.name]
    if mfc.kind is MFCKind.COMPUTE:
        return [Allocation(DeviceSet((d,)), Layout()) for d in range(cluster.n_devices)]
    return [a for mesh in device_meshes(cluster) for a in allocations_on(mfc, mesh, cluster, model_configs)]


@dataclass(frozen=True)
class Unit:
    """MFCs that move together (one, or a role's train calls) and their candidate allocations."""

    names: tuple[str, ...]
    candidates: tuple[Allocation, ...]


def unit_names(workflow: Workflow) -> list[tuple[str, ...]]:
    """Groups of MFC names that share one allocation: a role's train calls together, every other MFC alone."""
    units: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for mfc in workflow.topological_order():
        if mfc.name in seen:
            continue
        names: tuple[str, ...] = (mfc.name,)
        if mfc.kind is MFCKind.TRAIN:
            names = tuple(m.name for m in workflow.mfcs_of_role(mfc.model_role) if m.kind is MFCKind.TRAIN)
        seen |= set(names)
        units.append(names)
    return units


def memory_alone(mfcs: list[MFC], alloc: Allocation, cost: CostEstimator) -> float:
    """Bytes per device the calls of one unit need on ``alloc`` with nothing else there: their role's weights
    (its training state, for train calls) and the most transient memory any of them adds."""
    trainable = mfcs[0].kind is MFCKind.TRAIN
    return max(
        (
            cost.static_memory(m.role, alloc, trainable) + cost.mfc_memory(m, alloc, trainable)
            for m in mfcs
            if m.role is not None
        ),
        default=0.0,
    )


def scored_by_mesh(
    mfcs: list[MFC], candidates: tuple[Allocation, ...], cost: CostEstimator
) -> dict[DeviceSet, list[tuple[float, float, int]]]:
    """Each candidate of one unit (its calls ``mfcs``) as (seconds of its calls alone, :func:`memory_alone`,
    its index), grouped by device mesh."""
    by_mesh: dict[DeviceSet, list[tuple[float, float, int]]] = defaultdict(list)
    for i, alloc in enumerate(candidates):
        by_mesh[alloc.mesh].append((sum(cost.mfc_time(m, alloc) for m in mfcs), memory_alone(mfcs, alloc, cost), i))
    return by_mesh
