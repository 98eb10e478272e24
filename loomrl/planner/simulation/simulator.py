"""Simulating an execution plan: list scheduling of the unrolled workflow, with memory tracked over time.

What :func:`simulate` models, and what it leaves out:

- **Graph.** The plan's schedule (:func:`loomrl.plan.schedule.build_schedule`), the same steps the runtime
  executes, repeated for ``iterations`` training iterations: each call, each reallocation ``copy`` (before the
  first call needing that layout, once that call's dependencies are done), each ``free`` after its copy's last
  use, each shadow ``sync`` after its role's train call, each ``reload`` and ``offload`` of an offloaded frozen
  role. The schedule's prologue (filling shadows once before the first iteration) is not simulated: it is not
  part of any iteration.
- **Iterations one after another.** The runtime's trainer runs an iteration only once the previous one has
  ended (its calls, reallocations and syncs; metrics, evaluation and checkpoints come between), so every node
  of iteration ``i + 1`` also waits for every node of iteration ``i``.
- **Resources.** A step occupies every device it names for the time the
  :class:`~loomrl.planner.cost.estimator.CostEstimator` predicts (a call: ``mfc_time``; a copy or sync:
  ``realloc_time``; a reload or offload: ``reload_time`` / ``offload_time``; a stream- or pipeline-fusion stage:
  ``stream_fusion_time`` / ``pipeline_fusion_time``; a free: nothing). Dispatch follows the runtime: a step is sent
  when its last dependency ends, or
  together with a copy, sync or reload it waits for whose devices cover its own
  (:meth:`~loomrl.plan.schedule.Step.sent_with`), and each device runs the steps in the order they were sent
  (no back-filling), so a step starts when it is ready and every device it names has finished the steps sent
  before it. Ties in ready time go to the earlier step of the unrolled order.
- **Memory per device over time.** The resident (static) memory of the roles placed on the device plus the
  transient memory of the call running there. Resident: a trained role's training state on its training mesh,
  its shadow copies on theirs, and each reallocated copy from the start of its ``copy`` to the end of its
  ``free``; a frozen role on each distinct placement of its calls, or, when the schedule offloads it, from
  each ``reload`` to the matching ``offload``. A plan whose peak exceeds ``memory_per_device`` on some device
  is infeasible, and the result says which device needs how much, when, and for what.
- **Shared cores.** Where the estimator's ``shared_cores()`` is a number (``CostModel`` on a CPU profile whose
  devices outnumber the cores), calls running side by side on a node share its cores
  (:mod:`loomrl.planner.simulation.sharing`); otherwise each node takes its predicted time whatever runs beside it.
- **Left out:** data transfers between calls, and compute-communication overlap inside a call (both belong
  to the cost estimator's numbers, if anywhere).

Iteration time is the steady state ``(end of the last iteration − end of the first) / (iterations − 1)``, so
pipeline fill and the first iteration's warm-up do not count; busy fractions are over the same window. The
estimator's ``iteration_time(seconds)`` (``CostModel``: the fitted whole-iteration correction) adjusts that
figure; the timeline is left as scheduled.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loomrl.errors import ConfigError
from loomrl.plan import GB, Allocation, ExecutionPlan
from loomrl.plan.plan import AsyncTraining
from loomrl.plan.schedule import Schedule, Step, StepKind, build_schedule
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.simulation.sharing import release, simulate_shared, successors
from loomrl.workflow import MFCKind, Workflow

__all__ = ["Interval", "SimResult", "format_bytes", "simulate"]


@dataclass(frozen=True)
class Interval:
    """One node of the schedule on one device."""

    device: int
    """Global device index."""
    start: float
    """Seconds from the start of the simulation."""
    end: float
    """Seconds from the start of the simulation."""
    label: str
    """The schedule step's id: the MFC name for a call, e.g. ``"copy actor→0-1:dp1tp2"`` otherwise."""
    kind: str
    """A call's MFC kind (``generate``, ``inference``, ``train``, ``compute``), else the step's kind (``copy``,
    ``free``, ``sync``, ``reload``, ``offload``)."""
    iteration: int = 0
    """Training iteration of the unrolled workflow the node belongs to."""


@dataclass
class SimResult:
    """What a simulation of a plan found."""

    iteration_time: float
    """Steady-state seconds per iteration (see the module docstring)."""
    busy_fraction: dict[int, float]
    """Device → fraction of the steady-state window it spends running nodes (every device of the cluster)."""
    peak_memory: dict[int, float]
    """Device → peak bytes over the whole simulation (every device of the cluster)."""
    schedule: list[Interval] | Callable[[], list[Interval]] = field(repr=False)
    """The :attr:`timeline`, or a function that builds it (a search reads few of its many plans' timelines)."""
    feasible: bool
    """False when some device's peak memory exceeds its capacity."""
    reason: str = ""
    """Why the plan is infeasible, in one line; empty when feasible."""
    iteration_ends: list[float] = field(default_factory=list)
    """End time of each simulated iteration (its last node, reallocations included)."""
    overflow_byte_seconds: float = 0.0
    """Memory above capacity integrated over time, summed over devices (0 when feasible): how far an
    infeasible plan is from fitting, counting every overflowing call, not only the worst."""
    device_seconds: float | None = None
    """Sum over devices of the time they run nodes (None: summed from the timeline when asked)."""
    makespan: float | None = None
    """End of the last node (None: taken from the timeline when asked)."""

    def __post_init__(self) -> None:
        if self.device_seconds is None or self.makespan is None:
            timeline = self.timeline
            self.device_seconds = sum(i.end - i.start for i in timeline)
            self.makespan = max((i.end for i in timeline), default=0.0)

    @functools.cached_property
    def timeline(self) -> list[Interval]:
        """Every node on every device it occupies, ordered by start time (ties: the node's dispatch priority)."""
        return self.schedule() if callable(self.schedule) else self.schedule


@dataclass
class _Node:
    """A schedulable unit: one step of one iteration."""

    step: Step
    iteration: int
    duration: float
    deps: list[int]
    carried: list[int] = field(default_factory=list)
    """The dependencies this node is sent together with (:meth:`Step.sent_with`), a subset of ``deps``."""
    parts: tuple = ()
    """A fused stage's parts, ``(label, device, start, end)`` from the node's start, where the estimator gives them."""

    @property
    def label(self) -> str:
        return self.step.id

    @property
    def kind(self) -> str:
        return self.step.call_mfc.kind.value if self.step.kind is StepKind.CALL else self.step.kind.value

    @property
    def devices(self) -> tuple[int, ...]:
        return self.step.devices


def format_bytes(n: float) -> str:
    """Bytes in binary units for messages: ``"12.5 GB"``, ``"300.0 MB"``, ``"512 B"``."""
    for unit, size in (("GB", GB), ("MB", 2**20), ("KB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _checked(value: float, what: str) -> float:
    value = float(value)
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ValueError(f"cost estimator: {what} is {value!r}; expected a finite number >= 0")
    return value


def _duration(
    step: Step, cost: CostEstimator, trained: frozenset[str] = frozenset(), partial: AsyncTraining | None = None
) -> float:
    """Seconds the estimator gives a step (module docstring); a reload or offload of a ``trained`` role moves its
    training state (:func:`_move_time`); a rollout generate call under partial rollouts (``partial``) decodes
    its iteration's pieces of samples."""
    if partial is not None and step.kind is StepKind.CALL:
        return _checked(cost.partial_rollout_time(step.call_mfc, step.allocation, partial), f"partial({step.id})")
    if step.kind is StepKind.STREAM_FUSION:
        return _checked(cost.stream_fusion_time(step), f"stream_fusion_time({step.id})")
    if step.kind is StepKind.PIPELINE_FUSION:
        return _checked(cost.pipeline_fusion_time(step), f"pipeline_fusion_time({step.id})")
    if step.kind is StepKind.CALL:
        return _checked(cost.mfc_time(step.call_mfc, step.allocation), f"mfc_time({step.id}, {step.allocation.text})")
    if step.transfer is not None:  # a copy or a sync
        role, src, dst = step.transfer
        return _checked(cost.realloc_time(role, src, dst), f"realloc_time({role}, {src.text} -> {dst.text})")
    if step.kind in (StepKind.RELOAD, StepKind.OFFLOAD):
        return _move_time(step, cost, step.role in trained)
    return 0.0


def _move_time(step: Step, cost: CostEstimator, trained: bool) -> float:
    """A reload or offload: the estimator's ``reload_time`` / ``offload_time``. A frozen role's offload keeps its
    host copy and takes no time; a trained role's state is copied each way, and the estimator is told so
    (``trainable``)."""
    if step.kind is StepKind.OFFLOAD and not trained:
        return 0.0
    name = "reload_time" if step.kind is StepKind.RELOAD else "offload_time"
    fn = cost.reload_time if step.kind is StepKind.RELOAD else cost.offload_time
    return _checked(fn(step.model_role, step.allocation, trained), f"{name}({step.role}, {step.allocation.text})")


def _build_graph(
    schedule: Schedule, cost: CostEstimator, iterations: int, trained: frozenset[str] = frozenset()
) -> list[_Node]:
    """The schedule's steps of every iteration as nodes, in dispatch priority order, with their dependencies."""
    steps = schedule.steps
    position = {step.id: i for i, step in enumerate(steps)}
    deps = [[position[d] for d in step.deps] for step in steps]
    carried = [[position[d] for d in step.deps if step.sent_with(steps[position[d]])] for step in steps]
    setting = schedule.asynchronous
    partial = setting if setting is not None and setting.partial_rollout else None
    seconds = [_duration(step, cost, trained, partial if step.id in schedule.ahead else None) for step in steps]
    parts = [cost.stream_fusion_parts(step) if step.kind is StepKind.STREAM_FUSION else () for step in steps]
    nodes: list[_Node] = []
    for it in range(iterations):
        base = it * len(steps)
        nodes += [
            _Node(step, it, seconds[i], [base + d for d in deps[i]], [base + d for d in carried[i]], parts[i])
            for i, step in enumerate(steps)
        ]
    _iteration_barriers(nodes)
    return nodes


def _intervals(node: _Node, start: float, end: float) -> list[Interval]:
    """A node on each of its devices: a fused stage as its parts (generation, migration, each member call)."""
    if not node.parts:
        return [Interval(d, start, end, node.label, node.kind, node.iteration) for d in node.devices]
    kinds = {m.id: m.call_mfc.kind.value for m in node.step.members}
    return [
        Interval(d, start + a, start + b, label, kinds.get(label, label), node.iteration)
        for label, d, a, b in sorted(node.parts, key=lambda p: (p[2], p[1]))
    ]


def _iteration_barriers(nodes: list[_Node]) -> None:
    """Make every node of iteration ``i + 1`` wait for all of iteration ``i`` (module docstring): its first nodes
    (those waiting on no node of their own iteration) wait for the last ones of ``i`` (those no node of ``i``
    waits on); the rest wait through them."""
    waited: set[int] = set()
    for node in nodes:
        waited.update(d for d in node.deps if nodes[d].iteration == node.iteration)
    last: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        if i not in waited:
            last.setdefault(node.iteration, []).append(i)
    for node in nodes:
        if node.iteration > 0 and all(nodes[d].iteration < node.iteration for d in node.deps):
            node.deps = sorted({*node.deps, *last[node.iteration - 1]})


class _DeviceClasses:
    """Devices that every node and placement treats alike: each mesh given holds all of a class or none of it.

    Such devices start and end every node together and hold the same memory throughout, so the schedule, the
    memory intervals and the busy time are computed once per class (a class id stands for its devices) and
    copied to each member: a 64-device plan of a few aligned meshes has a handful of classes. ``identity``
    makes every device its own class."""

    def __init__(self, meshes: Iterable[tuple[int, ...]], n_devices: int, identity: bool = False) -> None:
        if identity:
            self.members: list[list[int]] = [[d] for d in range(n_devices)]
        else:
            signature: list[list[int]] = [[] for _ in range(n_devices)]  # the distinct meshes holding each device
            for k, mesh in enumerate(dict.fromkeys(meshes)):
                for d in mesh:
                    signature[d].append(k)
            by_signature: dict[tuple[int, ...], list[int]] = {}
            for d, sig in enumerate(signature):
                by_signature.setdefault(tuple(sig), []).append(d)
            self.members = list(by_signature.values())  # ordered by their lowest device
        self._class = [0] * n_devices
        for c, devices in enumerate(self.members):
            for d in devices:
                self._class[d] = c
        self._on: dict[tuple[int, ...], tuple[int, ...]] = {}

    def on(self, devices: Iterable[int]) -> tuple[int, ...]:
        """The classes of ``devices`` (a mesh's devices: all members of each class)."""
        devices = tuple(devices)
        found = self._on.get(devices)
        if found is None:
            found = self._on[devices] = tuple(sorted({self._class[d] for d in devices}))
        return found


def _schedule(nodes: list[_Node], devices_of: list[tuple[int, ...]]) -> tuple[list[float], list[float]]:
    """Start and end time of every node (see the module docstring for the dispatch rule) on the devices (or
    device classes) ``devices_of[i]`` of node i."""
    following, carrying = successors([node.deps for node in nodes], [node.carried for node in nodes])
    pending = [len(node.deps) for node in nodes]
    ready_at = [0.0] * len(nodes)
    start, end = [math.nan] * len(nodes), [math.nan] * len(nodes)
    heap = [(0.0, i) for i, node in enumerate(nodes) if not node.deps]
    free: dict[int, float] = {}
    while heap:
        ready, i = heapq.heappop(heap)
        release(carrying[i], ready, ready_at, pending, heap)  # sent with it: queued right behind it
        node, devices = nodes[i], devices_of[i]
        start[i] = max([ready, *(free.get(d, 0.0) for d in devices)])
        end[i] = start[i] + node.duration
        for d in devices:
            free[d] = end[i]
        release(following[i], end[i], ready_at, pending, heap)
    if any(math.isnan(s) for s in start):  # cannot happen for a validated workflow; guard the invariant
        raise RuntimeError("simulator: some nodes were never ready (a cycle in the unrolled graph)")
    return start, end


# A memory interval: (start, end, bytes, what) on one device; end may be inf (resident throughout).
_Mem = tuple[float, float, float, str]


def _resident(plan: ExecutionPlan, workflow: Workflow, role: str) -> list[tuple[Allocation, bool]]:
    """The placements of a role that stay resident all along (unless offloaded), with whether each is trainable."""
    canon = plan.canonical_layout(workflow, role)
    if canon is not None:
        shadows = {plan[n].shards: None for n in plan.shadow_calls(workflow, role)}
        return [(canon, True), *((a, False) for a in shadows)]
    placements = {plan[mfc.name].shards: None for mfc in workflow.mfcs_of_role(role)}
    return [(a, False) for a in placements]


def _memory_intervals(
    plan: ExecutionPlan,
    workflow: Workflow,
    cost: CostEstimator,
    nodes: list[_Node],
    start: list[float],
    end: list[float],
    on: Callable[[Iterable[int]], tuple[int, ...]],
) -> dict[int, list[_Mem]]:
    """Device class (``on`` maps devices to their classes) → the memory intervals on each of its devices
    (see the module docstring)."""
    out: dict[int, list[_Mem]] = {}
    cache: dict[tuple, float] = {}

    def add(devices: Iterable[int], s: float, e: float, key: tuple, fn, what: str) -> None:
        if key not in cache:
            cache[key] = _checked(fn(), f"{key[0]}({', '.join(map(str, key[1:]))})")
        for c in on(devices):
            out.setdefault(c, []).append((s, e, cache[key], what))

    def static(role: str, alloc: Allocation, trainable: bool) -> tuple[tuple, Callable[[], float]]:
        return ("static_memory", role, alloc.text, trainable), lambda: cost.static_memory(role, alloc, trainable)

    trained = set(plan.trained_roles(workflow))
    moved = {n.step.role for n in nodes if n.step.kind is StepKind.RELOAD}
    for role in workflow.roles():
        if role in moved and role not in trained:
            continue  # a frozen role offloaded between its calls: resident from each reload to its offload
        for alloc, trainable in _resident(plan, workflow, role):
            spans = _state_spans(nodes, role, start, end) if trainable and role in moved else [(0.0, math.inf)]
            for s, e in spans:
                add(alloc.mesh, s, e, *static(role, alloc, trainable), f"{role} weights")
    copies = {(n.step.model_role, n.step.allocation) for n in nodes if n.step.kind is StepKind.COPY}
    kept = {key for key in copies if cost.copy_keeps_base(key[0])}
    # a LoRA role's copies keep the base: resident from the start
    for role, alloc in sorted(kept, key=lambda key: (key[0], key[1].text)):
        add(alloc.mesh, 0.0, math.inf, *static(role, alloc, False), f"{role} copy")
    opened: dict[tuple, int] = {}  # (role, shards) → the copy or reload node holding it now
    for i, node in enumerate(nodes):
        step = node.step
        if step.role in trained and step.kind in (StepKind.RELOAD, StepKind.OFFLOAD):
            continue  # a trained role's training state: its spans are above
        if (step.role, step.alloc) in kept and step.kind in (StepKind.COPY, StepKind.FREE):
            continue  # resident from the start (its adapters' bytes are part of it)
        if step.kind in (StepKind.COPY, StepKind.RELOAD):
            opened[(step.role, step.alloc)] = i
        elif step.kind in (StepKind.FREE, StepKind.OFFLOAD):
            held = opened.pop((step.role, step.alloc))
            what = f"{step.role} copy" if step.kind is StepKind.FREE else f"{step.role} weights"
            add(step.devices, start[held], end[i], *static(step.model_role, step.allocation, False), what)
        elif step.kind in (StepKind.CALL, StepKind.PIPELINE_FUSION):  # a fused train stage holds both calls' buffers
            for call in step.members or (step,):
                trainable = call.call_mfc.kind is MFCKind.TRAIN
                key = ("mfc_memory", call.id, call.allocation.text, trainable)
                add(
                    call.devices,
                    start[i],
                    end[i],
                    key,
                    lambda m=call.call_mfc, a=call.allocation, t=trainable: cost.mfc_memory(m, a, t),
                    f"{call.id} running",
                )
    return out


def _state_spans(nodes: list[_Node], role: str, start: list[float], end: list[float]) -> list[tuple[float, float]]:
    """When a trained role whose state the schedule offloads holds it on its training devices: from the start
    until the end of its first offload, then from each reload's start to the next offload's end, and from the
    last reload on."""
    spans: list[tuple[float, float]] = []
    since: float | None = 0.0
    for i, node in enumerate(nodes):
        if node.step.role != role:
            continue
        if node.step.kind is StepKind.OFFLOAD and since is not None:
            spans.append((since, end[i]))
            since = None
        elif node.step.kind is StepKind.RELOAD and since is None:
            since = start[i]
    return spans + ([(since, math.inf)] if since is not None else [])


def _peak(intervals: list[_Mem], capacity: float = math.inf) -> tuple[float, float, float]:
    """(peak bytes, first time it is reached, byte-seconds above ``capacity``) of a device's memory
    intervals, each ``[start, end)``.

    At equal times ends come before starts, so back-to-back calls do not add up; a zero-length interval is
    counted at its instant.
    """
    events: list[tuple[float, int, float]] = []
    for s, e, b, _ in intervals:
        events.append((s, 1, b))
        events.append((e, 0, -b) if e > s else (s, 2, -b))
    events.sort(key=lambda ev: (ev[0], ev[1]))
    level = peak = excess = 0.0
    at = last = 0.0
    for t, _, b in events:
        if level > capacity and math.isfinite(t):  # resident state ends at infinity: count up to the last call
            excess += (level - capacity) * (t - last)
        last = t
        level += b
        if level > peak:
            peak, at = level, t
    return peak, at, excess


def _overflow_reason(device: int, need: float, at: float, intervals: list[_Mem], capacity: float) -> str:
    parts: dict[str, float] = {}
    for s, e, b, what in intervals:
        if s <= at < e or s == e == at:
            parts[what] = parts.get(what, 0.0) + b
    listed = ", ".join(f"{what} {format_bytes(b)}" for what, b in sorted(parts.items(), key=lambda kv: -kv[1]))
    return f"device {device} needs {format_bytes(need)} at t={at:.4g} s ({listed}) but has {format_bytes(capacity)}"


def _memory_check(
    memory: dict[int, list[_Mem]], classes: _DeviceClasses, capacity: float
) -> tuple[dict[int, float], bool, str, float]:
    """Peak bytes per device, whether all fit, the reason naming the (lowest) device that overflows most, and
    the byte-seconds above capacity summed over devices. ``memory`` is per device class."""
    peaks: dict[int, float] = {}
    worst: tuple[float, int, int, float] | None = None
    total_excess = 0.0
    for c, devices in enumerate(classes.members):
        peak, at, excess = _peak(memory.get(c, []), capacity)
        peaks.update(dict.fromkeys(devices, peak))
        total_excess += excess * len(devices)
        if peak > capacity and (worst is None or peak > worst[0]):
            worst = (peak, c, devices[0], at)
    if worst is None:
        return dict(sorted(peaks.items())), True, "", 0.0
    peak, c, d, at = worst
    return dict(sorted(peaks.items())), False, _overflow_reason(d, peak, at, memory[c], capacity), total_excess


def _busy_fractions(
    nodes: list[_Node], start: list[float], end: list[float], classes: _DeviceClasses, window: tuple[float, float]
) -> dict[int, float]:
    lo, hi = window
    busy = [0.0] * len(classes.members)
    for i, node in enumerate(nodes):
        inside = max(0.0, min(end[i], hi) - max(start[i], lo))
        for c in classes.on(node.devices):
            busy[c] += inside
    fraction = {
        d: (busy[c] / (hi - lo) if hi > lo else 0.0) for c, devices in enumerate(classes.members) for d in devices
    }
    return dict(sorted(fraction.items()))


def simulate(
    plan: ExecutionPlan, workflow: Workflow, cost: CostEstimator, memory_per_device: float, iterations: int = 3
) -> SimResult:
    """Schedule ``iterations`` iterations of ``workflow`` under ``plan`` and report time, use and memory.

    ``memory_per_device`` is each device's capacity in bytes. A structurally invalid plan (see
    :meth:`ExecutionPlan.validate`) raises :class:`~loomrl.errors.ConfigError`; one that does not fit in memory
    returns ``feasible=False`` with the reason, and its schedule is still filled in.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"simulate: iterations={iterations!r}; expected an integer >= 1 (2-3 for a steady state)")
    if not memory_per_device > 0:
        raise ConfigError(f"simulate: memory_per_device={memory_per_device!r}; expected bytes > 0")
    plan.validate(workflow)
    nodes = _build_graph(build_schedule(workflow, plan), cost, iterations, frozenset(plan.trained_roles(workflow)))
    cores = cost.shared_cores()
    n_devices = plan.cluster.n_devices
    if cores is None:
        classes = _DeviceClasses(
            [n.devices for n in nodes] + [a.mesh.devices for a in plan.allocations.values()], n_devices
        )
        start, end = _schedule(nodes, [classes.on(n.devices) for n in nodes])
    else:  # the sharing simulation needs each device's node: no classes
        classes = _DeviceClasses([], n_devices, identity=True)
        start, end = simulate_shared(
            [n.duration for n in nodes],
            [n.devices for n in nodes],
            [n.deps for n in nodes],
            plan.cluster.node_of,
            cores,
            [n.carried for n in nodes],
        )
    ends = [max(end[i] for i, n in enumerate(nodes) if n.iteration == it) for it in range(iterations)]
    if iterations > 1:
        iteration_time, window = (ends[-1] - ends[0]) / (iterations - 1), (ends[0], ends[-1])
    else:
        iteration_time, window = ends[0], (0.0, ends[0])
    iteration_time = _checked(cost.iteration_time(iteration_time), "iteration_time")

    def timeline() -> list[Interval]:
        order = sorted(range(len(nodes)), key=lambda i: (start[i], i))
        return [iv for i in order for iv in _intervals(nodes[i], start[i], end[i])]

    memory = _memory_intervals(plan, workflow, cost, nodes, start, end, classes.on)
    peaks, feasible, reason, excess = _memory_check(memory, classes, memory_per_device)
    device_seconds = sum((end[i] - start[i]) * len(n.devices) for i, n in enumerate(nodes))
    return SimResult(
        iteration_time,
        _busy_fractions(nodes, start, end, classes, window),
        peaks,
        timeline,
        feasible,
        reason,
        ends,
        excess,
        device_seconds,
        max(end, default=0.0),
    )
