"""Execution plans as data: where each model function call runs and how its model is sharded there.

- :class:`DeviceSet`: a sorted tuple of global device indices of the cluster (a *mesh* once a layout
  arranges them; not torch's ``DeviceMesh``, which the runtime builds from it);
- :class:`Allocation`: the one type for "a mesh and a layout": devices, a :class:`~loomrl.plan.layout.Layout`
  (``dp × tp × pp``) and the options of the call running there (micro-batches, recompute, ZeRO, FSDP). Rank
  ``r = pp_rank·(dp·tp) + dp_rank·tp + tp_rank`` (tp fastest, then dp, pp slowest) runs on device ``mesh[r]``,
  and coordinates are always ``(pp, dp, tp)`` (:class:`~loomrl.plan.layout.Coords`). :attr:`Allocation.shards`
  reduces an allocation to what decides which part of a model each device holds, the identity the runtime
  keys models and communicators by;
- :class:`ExecutionPlan`: the cluster, one allocation per MFC and two optional choices (which trained roles
  keep a shadow copy, which roles are offloaded between calls). Facts derived from these take the workflow:
  the canonical (training) allocation of each trained role, shadowed calls, offloaded roles, the groups of
  MFCs that may run concurrently, and a memory estimate. What runs around the calls (reallocations, frees,
  shadow syncs, reloads) is the plan's schedule, :func:`loomrl.plan.schedule.build_schedule`. :meth:`ExecutionPlan.validate` checks a plan against a
  workflow and model configs, and fails with one line naming the MFC, the field and the values.

Plans round-trip through plain dicts, JSON and YAML (:meth:`ExecutionPlan.save`, :meth:`ExecutionPlan.load`).
The compact text of an allocation, ``0-3,6:dp2tp2pp1mb4``, is shared with the plan strings of
:mod:`loomrl.plan.plan_string`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from loomrl.config.tools import FieldError, ValidatedConfig, fail, from_dict, read_yaml, spec, to_dict
from loomrl.errors import ConfigError
from loomrl.plan.layout import Coords, Layout
from loomrl.plan import checks
from loomrl.plan.cluster import ClusterSpec
from loomrl.workflow import MFCKind, Workflow

__all__ = ["Allocation", "DeviceSet", "ExecutionPlan", "StreamFusion", "format_devices"]

_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")
MAX_MESH = 1 << 20
"""Most devices one mesh may list (a bound far above any cluster, so a typo such as 0-99999999 fails at once)."""
_LAYOUT_RE = re.compile(r"(dp|tp|pp|mb)(\d+)|(rc|zero|fsdp|rev)")
_LAYOUT_TOKENS = ("expected tokens dp<N>, tp<N>, pp<N>, mb<N> (micro-batches), rc (recompute activations), zero "
                  "(optimizer state sharded over dp), fsdp (weights, gradients and optimizer state sharded over "
                  "dp) and rev (pipeline stages from the mesh's last device), e.g. dp4tp2, dp2mb4, pp2mb4rc, "
                  "dp8zero, dp8fsdp or pp4rev")


def format_devices(devices: tuple[int, ...] | list[int]) -> str:
    """Sorted device indices as ranges and singles: ``(0, 1, 2, 3, 6)`` → ``"0-3,6"``."""
    parts: list[str] = []
    ordered = sorted(devices)
    start = prev = ordered[0] if ordered else 0
    for d in ordered[1:] + [None]:  # a sentinel closes the last run
        if d is not None and d == prev + 1:
            prev = d
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if d is not None:
            start = prev = d
    return ",".join(parts) if ordered else ""


@dataclass(frozen=True)
class DeviceSet(ValidatedConfig):
    """A non-empty set of global device indices, stored sorted; ``mesh[rank]`` is the device of a rank."""

    devices: tuple[int, ...]
    """Global device indices (node-major numbering of the cluster); stored sorted."""

    def validate(self) -> None:
        if not self.devices:
            fail("devices", "() is empty; a mesh needs at least one device")
        for d in self.devices:
            if d < 0:
                fail("devices", f"{d} is negative; devices are numbered from 0")
        if len(set(self.devices)) != len(self.devices):
            dupes = sorted({d for d in self.devices if self.devices.count(d) > 1})
            fail("devices", f"{format_devices(list(self.devices))} lists device {dupes[0]} twice")
        object.__setattr__(self, "devices", tuple(sorted(self.devices)))

    @classmethod
    def parse(cls, text: str) -> DeviceSet:
        """``"0-3"``, ``"0,2,5"``, ``"0-3,6"`` → a mesh; errors are at path ``devices``."""
        devices: list[int] = []
        for part in str(text).split(","):
            match = _RANGE_RE.fullmatch(part.strip())
            if match is None:
                fail("devices", f"{text!r} is not a device list; expected ranges like 0-3 or lists like 0,2,5")
            first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
            if last < first:
                fail("devices", f"range {part.strip()!r} ends before it starts")
            if last - first + 1 + len(devices) > MAX_MESH:
                fail("devices", f"{text!r} lists more than {MAX_MESH} devices; a mesh lists devices of the cluster")
            devices.extend(range(first, last + 1))
        return cls(tuple(devices))

    @functools.cached_property
    def text(self) -> str:
        """The compact form, e.g. ``"0-3,6"`` (made once: a plan search asks for it millions of times)."""
        return format_devices(self.devices)

    def isdisjoint(self, other: DeviceSet) -> bool:
        """True when the two meshes share no device."""
        return set(self.devices).isdisjoint(other.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.devices)

    def __getitem__(self, index: int) -> int:
        return self.devices[index]

    def __contains__(self, device: object) -> bool:
        return device in self.devices


def _layout_text(layout: Layout, micro_batches: int, recompute: bool = False, zero: bool = False,
                 fsdp: bool = False) -> str:
    text = f"dp{layout.dp}"
    text += f"tp{layout.tp}" if layout.tp > 1 else ""
    text += f"pp{layout.pp}" if layout.pp > 1 else ""
    text += "rev" if layout.reverse else ""
    return text + (f"mb{micro_batches}" if micro_batches > 1 else "") + ("rc" if recompute else "") + \
        ("zero" if zero else "") + ("fsdp" if fsdp else "")


def _parse_layout(text: str, devices: int) -> tuple[Layout, int, bool, bool, bool]:
    """``"dp2tp2mb4"`` → (Layout(2, 2, 1), 4, False, False, False); ``rc`` sets recompute, ``zero`` optimizer-state
    sharding and ``fsdp`` full sharding; an omitted dp fills the mesh: ``devices / (tp·pp)``."""
    tokens = _LAYOUT_RE.findall(text)
    if "".join(k + v + flag for k, v, flag in tokens) != text:
        fail("layout", f"{text!r} is not a layout; {_LAYOUT_TOKENS}")
    values: dict[str, int] = {}
    flags: set[str] = set()
    for key, value, flag in tokens:
        if flag:
            if flag in flags:
                fail("layout", f"{text!r} gives {flag} twice")
            flags.add(flag)
            continue
        if key in values:
            fail("layout", f"{text!r} gives {key} twice")
        values[key] = int(value)
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values and tp * pp and devices % (tp * pp) == 0:
        values["dp"] = devices // (tp * pp)
    for key in ("dp", "tp", "pp", "mb"):
        if values.get(key, 1) < 1:
            fail("layout", f"{key}{values[key]} in {text!r} is not a positive degree")
    if "rev" in flags and pp == 1:
        fail("layout", f"{text!r} reverses a pipeline of one stage; rev needs pp > 1 (e.g. pp4rev)")
    layout = Layout(values.get("dp", 1), tp, pp, "rev" in flags)
    return layout, values.get("mb", 1), "rc" in flags, "zero" in flags, "fsdp" in flags


@dataclass(frozen=True)
class Allocation(ValidatedConfig):
    """Where and how one MFC runs: its devices and its model's parallel layout on them."""

    mesh: DeviceSet
    """The devices; a list or tuple of indices is accepted and converted."""
    layout: Layout
    """Data × tensor × pipeline degrees; their product must equal the number of devices."""
    micro_batches: int = spec(1, ge=1)
    """Micro-batches each rank's share of a batch is split into (pipelining, activation memory)."""
    recompute: bool = False
    """Train calls only: keep each decoder layer's input and recompute the rest in the backward (activation
    checkpointing): one more forward pass of compute for a fraction of the activation memory."""
    zero: bool = False
    """Train calls only (ZeRO stage 1): each data-parallel rank keeps the optimizer state of 1/dp of every
    parameter and updates that part, then the parts are all-gathered; the optimizer state (Adam's moments, and
    the fp32 master copy of 16-bit weights) takes 1/dp of the memory for one more all-gather of the weights per
    step (:mod:`loomrl.parallel.zero`). Nothing to shard at dp=1."""
    fsdp: bool = False
    """Train calls only (FSDP, ZeRO stage 3; :mod:`loomrl.parallel.fsdp`): each data-parallel rank keeps 1/dp of
    the weights (in fp32), of their gradients and of the optimizer state; each decoder layer's weights are
    all-gathered for its forward and again for its backward, and gradients are reduce-scattered. The role's
    other calls then run on a reallocated whole copy, even on the same devices and layout. With tp > 1 each
    rank's tensor-parallel shard is what is divided over dp (FSDP over the dp dimension of a dp × tp mesh, as
    torchtitan does); not with pipeline stages (pp = 1), nor with ``zero``, which it includes."""

    def __post_init__(self) -> None:
        if isinstance(self.mesh, (list, tuple)):
            object.__setattr__(self, "mesh", DeviceSet(tuple(self.mesh)))
        super().__post_init__()

    def validate(self) -> None:
        lay = self.layout
        if lay.size != len(self.mesh):
            fail("layout", f"dp={lay.dp} × tp={lay.tp} × pp={lay.pp} = {lay.size} device{'s' * (lay.size != 1)}, "
                           f"but the mesh {self.mesh.text} has {len(self.mesh)}")
        if self.fsdp and lay.pp > 1:
            fail("fsdp", f"does not combine with pipeline stages; with pp={lay.pp} use zero instead "
                         "(valid with fsdp: pp=1, any dp and tp)")
        if self.fsdp and self.zero:
            fail("zero", "fsdp shards the optimizer state already; give one of zero and fsdp")

    @classmethod
    def parse(cls, text: str) -> Allocation:
        """``"0-3:dp2tp2"``, ``"4-7"`` (dp fills the mesh), ``"0,2:dp2mb4"`` → an allocation."""
        devices, _, layout_text = str(text).partition(":")
        mesh = DeviceSet.parse(devices)
        layout, micro_batches, recompute, zero, fsdp = _parse_layout(layout_text.strip(), len(mesh)) \
            if layout_text.strip() else (Layout(dp=len(mesh)), 1, False, False, False)
        return cls(mesh, layout, micro_batches, recompute, zero, fsdp)

    @functools.cached_property
    def text(self) -> str:
        """The compact form :meth:`parse` reads, e.g. ``"0-7:dp4tp2mb2"`` (made once)."""
        return f"{self.mesh.text}:{_layout_text(self.layout, self.micro_batches, self.recompute, self.zero, self.fsdp)}"

    @property
    def optimizer_shards(self) -> int:
        """Data-parallel ranks the optimizer state is divided over when this allocation trains: dp under ZeRO-1
        (``zero``) or FSDP, else 1."""
        return self.layout.dp if self.zero or self.fsdp else 1

    @property
    def param_shards(self) -> int:
        """Data-parallel ranks the weights and gradients are divided over: dp under FSDP, else 1."""
        return self.layout.dp if self.fsdp else 1

    @functools.cached_property
    def shards(self) -> Allocation:
        """This allocation reduced to what decides which part of a model each device holds: devices, layout
        and FSDP, with the call's options (micro-batches, recompute, ZeRO) at their defaults. Two allocations
        with equal shards hold a model alike, so nothing moves between them; an FSDP allocation holds no whole
        weights, so it shares its shards with no other kind."""
        if self.micro_batches == 1 and not (self.recompute or self.zero):
            return self
        return Allocation(self.mesh, self.layout, fsdp=self.fsdp)

    @property
    def devices(self) -> tuple[int, ...]:
        """The mesh's device indices, sorted (``mesh[rank]`` is rank's device)."""
        return self.mesh.devices

    def device(self, coords: Coords) -> int:
        """The device of the rank at ``coords`` (``(pp, dp, tp)``)."""
        try:
            return self.mesh[self.layout.rank(coords)]
        except ConfigError as err:
            raise ConfigError(f"{err} ({self.text})") from None

    def coords(self, device: int) -> Coords:
        """``(pp, dp, tp)`` of the rank on ``device``."""
        if device not in self.mesh:
            raise ConfigError(f"device {device} is not in the mesh {self.mesh.text}")
        return self.layout.coords(self.mesh.devices.index(device))

    def replicas(self) -> list[tuple[int, ...]]:
        """The devices of each data-parallel replica, by dp rank (a replica can run rows on its own)."""
        out: dict[int, list[int]] = {}
        for device in self.devices:
            out.setdefault(self.coords(device).dp, []).append(device)
        return [tuple(out[r]) for r in sorted(out)]

    def publishes(self, device: int) -> bool:
        """Whether ``device`` reports a call's results: one per data-parallel replica, tensor rank 0 of the last
        pipeline stage (the others hold the same results, or none)."""
        coords = self.coords(device)
        return coords.tp == 0 and coords.pp == self.layout.pp - 1

    def dp_split(self, state: bool = False) -> str:
        """How the data-parallel ranks divide what each (pp, tp) shard holds: ``"rows"`` (FSDP: dim-0 blocks),
        ``"flat"`` (ZeRO-1's optimizer state: blocks of the flattened shard; ``state`` only) or ``"none"``
        (every replica holds it whole). ``state``: of the optimizer state (Adam's moments, master weights)
        rather than of the weights."""
        if self.fsdp and self.layout.dp > 1:
            return "rows"
        if state and self.zero and self.layout.dp > 1:
            return "flat"
        return "none"


def _maximal_cliques(order: list[str], adjacent: dict[str, set[str]]) -> list[frozenset[str]]:
    """Bron–Kerbosch without pivoting: workflows have ~10 MFCs, and this keeps the order deterministic."""
    cliques: list[frozenset[str]] = []

    def expand(chosen: list[str], candidates: list[str], excluded: list[str]) -> None:
        if not candidates and not excluded:
            cliques.append(frozenset(chosen))
            return
        for v in list(candidates):
            expand(chosen + [v], [u for u in candidates if u in adjacent[v]], [u for u in excluded if u in adjacent[v]])
            candidates.remove(v)
            excluded.append(v)

    expand([], list(order), [])
    return cliques


@dataclass(frozen=True)
class StreamFusion(ValidatedConfig):
    """Inter-stage fusion (RLHFuse): the inference calls that read only generation's outputs start on finished
    samples while the long tail still generates, and once few samples are left the tail moves onto a few
    generation replicas so that the others can run inference (:mod:`loomrl.plan.schedule`, the fused stage).
    Training still waits for the whole batch, so the run is the unfused run."""

    migrate_at: float | str = 0.2
    """Migrate the unfinished samples when at most this fraction of the batch is left (RLHFuse's R_t; 0 never
    migrates), or ``auto``: chosen each iteration by simulating the run's observed response lengths."""
    migrate_to: int = spec(1, ge=1)
    """Generation replicas the tail moves onto: those with the most of it left."""
    chunk: int = spec(0, ge=0)
    """Finished samples a generation replica gathers before handing them on (0: a quarter of its share)."""

    def validate(self) -> None:
        if isinstance(self.migrate_at, str) and self.migrate_at != "auto":
            fail("migrate_at", f"{self.migrate_at!r} is neither a fraction between 0 and 1 nor 'auto'")
        if not isinstance(self.migrate_at, str) and not 0 <= self.migrate_at <= 1:
            fail("migrate_at", f"{self.migrate_at} is outside 0..1 (a fraction of the batch) or 'auto'")

    @classmethod
    def parse(cls, text: str) -> StreamFusion:
        """``on`` (the defaults) or comma-separated ``key:value`` pairs, e.g. ``migrate_at:0.2,migrate_to:1``."""
        text = str(text).strip()
        if text in ("on", ""):
            return cls()
        values: dict[str, object] = {}
        for part in text.split(","):
            key, sep, value = (p.strip() for p in part.partition(":"))
            if not sep or key not in ("migrate_at", "migrate_to", "chunk"):
                fail("stream_fusion", f"{part.strip()!r} is not migrate_at:F|auto, migrate_to:N or chunk:N (e.g. "
                             "migrate_at:0.2,migrate_to:1, or on for the defaults)")
            try:
                values[key] = value if value == "auto" else (float(value) if key == "migrate_at" else int(value))
            except ValueError:
                fail(f"stream_fusion.{key}", f"{value!r} is not a number")
        return cls(**values)

    @property
    def text(self) -> str:
        """The plan string form :meth:`parse` reads."""
        return f"migrate_at:{self.migrate_at},migrate_to:{self.migrate_to},chunk:{self.chunk}"


def _roles_list(roles: object, field: str) -> tuple[str, ...] | None:
    if roles is None:
        return None
    if isinstance(roles, str) or not isinstance(roles, (list, tuple, set, frozenset)):
        raise ConfigError(f"plan.{field}: {roles!r} is not a list of role names (or null for the default rule)")
    for role in roles:
        if not isinstance(role, str) or not role:
            raise ConfigError(f"plan.{field}: {role!r} is not a role name")
    return tuple(sorted(set(roles)))


@dataclass(frozen=True)
class ExecutionPlan:
    """One allocation per MFC of a workflow on a cluster, plus the shadow and offload choices.

    Derived facts take the workflow, which says each MFC's role and kind; the plan itself is placement only.
    """

    cluster: ClusterSpec
    """The devices the plan is made for."""
    allocations: Mapping[str, Allocation]
    """MFC name → where and how it runs; every MFC of the workflow needs one."""
    shadow: tuple[str, ...] | None = None
    """Trained roles that keep a persistent copy for their calls off the training devices, synced after each
    train step; None applies the rule of :meth:`shadow_roles`."""
    offload: tuple[str, ...] | None = None
    """Roles whose weights go to host memory between their calls, and trained roles whose whole training state
    goes there while a generate call runs on their training devices (:mod:`loomrl.plan.schedule`); None applies
    the rule of :meth:`offloaded_roles` (frozen roles only)."""
    stream_fusion: StreamFusion | None = None
    """Inter-stage fusion of generation with the inference calls that read only its outputs; None: unfused."""
    pipeline_fusion: bool = False
    """Intra-stage fusion (RLHFuse): the workflow's two independent train calls (PPO's actor and critic), placed
    on the same devices with pipeline stages, run as one fused pipeline schedule, each device alternating
    between its stage of either model so that one model's work fills the other's pipeline bubbles
    (:mod:`loomrl.planner.pipeline_fusion`); opposite directions (one layout ``rev``) pair their bubbles best."""

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterSpec):
            raise ConfigError(f"plan.cluster: {self.cluster!r} is not a ClusterSpec")
        if not isinstance(self.allocations, Mapping) or not self.allocations:
            raise ConfigError(f"plan.allocations: {self.allocations!r} is not a non-empty mapping of MFC name → Allocation")
        for name, alloc in self.allocations.items():
            if not isinstance(alloc, Allocation):
                raise ConfigError(f"plan.allocations.{name}: {alloc!r} is not an Allocation")
            outside = [d for d in alloc.mesh if d >= self.cluster.n_devices]
            if outside:
                raise ConfigError(f"plan.allocations.{name}.devices: device {outside[0]} is outside the cluster "
                                  f"{self.cluster} (devices 0-{self.cluster.n_devices - 1})")
        object.__setattr__(self, "allocations", dict(self.allocations))
        object.__setattr__(self, "shadow", _roles_list(self.shadow, "shadow"))
        object.__setattr__(self, "offload", _roles_list(self.offload, "offload"))
        if self.stream_fusion is not None and not isinstance(self.stream_fusion, StreamFusion):
            raise ConfigError(f"plan.stream_fusion: {self.stream_fusion!r} is not a StreamFusion")
        if not isinstance(self.pipeline_fusion, bool):
            raise ConfigError(f"plan.pipeline_fusion: {self.pipeline_fusion!r} is not true or false")

    def with_allocation(self, name: str, allocation: Allocation) -> ExecutionPlan:
        """A copy of the plan with ``name`` placed at ``allocation``."""
        return dataclasses.replace(self, allocations={**self.allocations, name: allocation})

    def __getitem__(self, name: str) -> Allocation:
        if name not in self.allocations:
            raise ConfigError(f"plan.allocations: MFC {name!r} has no allocation; "
                              f"allocated: {', '.join(self.allocations)}")
        return self.allocations[name]

    # ------------------------------------------------------------------------------------- derived facts

    def canonical_layout(self, workflow: Workflow, role: str) -> Allocation | None:
        """The allocation of ``role``'s train call (the layout its weights and optimizer live in); None if frozen."""
        trains = [m for m in workflow.mfcs_of_role(role) if m.kind is MFCKind.TRAIN]
        return self[trains[0].name] if trains else None

    def trained_roles(self, workflow: Workflow) -> list[str]:
        """Roles with a train call, in workflow order."""
        return [r for r in workflow.roles() if any(m.kind is MFCKind.TRAIN for m in workflow.mfcs_of_role(r))]

    def shadow_roles(self, workflow: Workflow) -> tuple[str, ...]:
        """Trained roles that keep a shadow copy: the explicit ``shadow`` field, or by default every trained
        role with a generate call on devices disjoint from its training mesh (the separated placement).
        The shadow serves each of the role's calls off the training mesh and is synced after the train call."""
        if self.shadow is not None:
            return self.shadow
        found = []
        for role in self.trained_roles(workflow):
            canon = self.canonical_layout(workflow, role)
            if any(m.kind is MFCKind.GENERATE and self[m.name].mesh.isdisjoint(canon.mesh)
                   for m in workflow.mfcs_of_role(role)):
                found.append(role)
        return tuple(found)

    def offloaded_roles(self, workflow: Workflow) -> tuple[str, ...]:
        """Roles offloaded to host memory between calls: the explicit ``offload`` field, or by default every
        frozen role (no train call) some of whose devices are also used by another role's calls. Such a
        device is time-shared, and a frozen model can be reloaded at no loss (it has no optimizer state),
        so its memory goes to the calls running in between."""
        if self.offload is not None:
            return self.offload
        devices: dict[str, set[int]] = {}  # role → the devices of its calls
        for mfc in workflow:
            if mfc.role is not None:
                devices.setdefault(mfc.role, set()).update(self[mfc.name].mesh.devices)
        trained = set(self.trained_roles(workflow))
        return tuple(role for role in workflow.roles() if role not in trained and any(
            not devices[role].isdisjoint(used) for other, used in devices.items() if other != role))

    def shadow_calls(self, workflow: Workflow, role: str) -> list[str]:
        """The calls of ``role`` its shadow copy serves: non-train calls on devices disjoint from training."""
        if role not in self.shadow_roles(workflow):
            return []
        canon = self.canonical_layout(workflow, role)
        return [m.name for m in workflow.mfcs_of_role(role)
                if m.kind is not MFCKind.TRAIN and self[m.name].mesh.isdisjoint(canon.mesh)]

    def concurrent_groups(self, workflow: Workflow) -> list[frozenset[str]]:
        """Maximal sets (of two or more) of MFCs that may run at the same time: no dependency path between
        any two of them within an iteration, and pairwise disjoint meshes. Ordered by first member."""
        order = [m.name for m in workflow.topological_order()]
        adjacent = {a: {b for b in order if workflow.independent(a, b) and self[a].mesh.isdisjoint(self[b].mesh)}
                    for a in order}
        groups = [g for g in _maximal_cliques(order, adjacent) if len(g) > 1]
        return sorted(groups, key=lambda g: min(order.index(n) for n in g))

    def mfcs_on(self, device: int) -> list[str]:
        """Names of the MFCs whose mesh includes ``device``."""
        return [name for name, alloc in self.allocations.items() if device in alloc.mesh]

    # ---------------------------------------------------------------------------------------- validation

    def validate(self, workflow: Workflow, model_configs: Mapping[str, object] | None = None,
                 bytes_per_param: int = 4) -> None:
        """Raise a one-line ConfigError unless the plan runs ``workflow``: an allocation for exactly its MFCs,
        consistent train placements, valid shadow/offload roles; with ``model_configs`` (role → HF-config-like
        object) also tp/pp divisibility and the memory estimate (:mod:`loomrl.plan.checks`)."""
        checks.check_plan(self, workflow, model_configs, bytes_per_param)

    def role_memory(self, workflow: Workflow, model_configs: Mapping[str, object],
                    bytes_per_param: int = 4) -> dict[int, dict[str, int]]:
        """Device → role → estimated bytes of the role's state there."""
        return checks.role_memory(self, workflow, model_configs, bytes_per_param)

    def peak_memory(self, workflow: Workflow, model_configs: Mapping[str, object],
                    bytes_per_param: int = 4) -> dict[int, int]:
        """Device → estimated peak bytes (offloaded roles counted one at a time)."""
        return checks.peak_memory(self, workflow, model_configs, bytes_per_param)

    # -------------------------------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/YAML-ready); :meth:`from_dict` reads it back to an equal plan."""
        allocations = {name: {"devices": a.mesh.text, "dp": a.layout.dp, "tp": a.layout.tp, "pp": a.layout.pp,
                              "micro_batches": a.micro_batches, **({"recompute": True} if a.recompute else {}),
                              **({"zero": True} if a.zero else {}), **({"fsdp": True} if a.fsdp else {}),
                              **({"reverse": True} if a.layout.reverse else {})}
                       for name, a in self.allocations.items()}
        return {"cluster": to_dict(self.cluster), "allocations": allocations,
                "shadow": None if self.shadow is None else list(self.shadow),
                "offload": None if self.offload is None else list(self.offload),
                "stream_fusion": None if self.stream_fusion is None else to_dict(self.stream_fusion),
                **({"pipeline_fusion": True} if self.pipeline_fusion else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecutionPlan:
        """Strict inverse of :meth:`to_dict`: unknown keys and wrong types fail with the key's path.

        ``devices`` may be the compact text (``"0-3,6"``) or a list of indices."""
        record = from_dict(_PlanRecord, data, "plan")
        allocations = {}
        for name, item in record.allocations.items():
            try:
                mesh = DeviceSet.parse(item.devices) if isinstance(item.devices, str) else DeviceSet(item.devices)
                allocations[name] = Allocation(mesh, Layout(item.dp, item.tp, item.pp, item.reverse), item.micro_batches,
                                               item.recompute, item.zero, item.fsdp)
            except FieldError as err:
                raise err.under(f"plan.allocations.{name}") from None
        return cls(record.cluster, allocations, record.shadow, record.offload, record.stream_fusion, record.pipeline_fusion)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (``.json``) or YAML (``.yaml``, ``.yml``), atomically."""
        path = Path(path)
        suffix = _plan_suffix(path)
        data = self.to_dict()
        text = json.dumps(data, indent=2) + "\n" if suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExecutionPlan:
        """Read a plan written by :meth:`save` (or by hand); errors name the file and the key."""
        path = Path(path)
        data = _read_json(path) if _plan_suffix(path) == ".json" else read_yaml(path)
        try:
            return cls.from_dict(data)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None


@dataclass(frozen=True)
class _AllocationRecord:
    devices: str | tuple[int, ...]
    """Devices as compact text (``"0-3,6"``) or a list of indices."""
    dp: int = spec(1, ge=1)
    """Data-parallel degree."""
    tp: int = spec(1, ge=1)
    """Tensor-parallel degree."""
    pp: int = spec(1, ge=1)
    """Pipeline-parallel degree."""
    micro_batches: int = spec(1, ge=1)
    """Micro-batches per rank."""
    recompute: bool = False
    """Recompute activations in the backward (train calls only)."""
    zero: bool = False
    """Shard the optimizer state over dp, ZeRO stage 1 (train calls only)."""
    fsdp: bool = False
    """Shard weights, gradients and optimizer state over dp, FSDP (train calls only)."""
    reverse: bool = False
    """Pipeline stages numbered from the mesh's last device (pp > 1)."""


@dataclass(frozen=True)
class _PlanRecord:
    RENAMED: ClassVar[Mapping[str, str]] = {"fuse": "stream_fusion", "fuse_train": "pipeline_fusion"}
    """Keys of plan files of earlier releases, refused with their new names."""

    cluster: ClusterSpec
    """The cluster the plan is for."""
    allocations: dict[str, _AllocationRecord]
    """MFC name → allocation."""
    shadow: tuple[str, ...] | None = None
    """Roles with a shadow copy (null: the default rule)."""
    offload: tuple[str, ...] | None = None
    """Roles offloaded between calls (null: the default rule)."""
    stream_fusion: StreamFusion | None = None
    """Inter-stage fusion (null: none)."""
    pipeline_fusion: bool = False
    """Intra-stage fusion of two train calls' pipelines."""


def _plan_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"{path}: unknown plan file suffix '{suffix}'; valid: .json, .yaml, .yml")
    return suffix


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON at line {err.lineno}: {err.msg}") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise ConfigError(f"{path}: invalid JSON: nested too deeply for a plan") from None
    except ValueError as err:  # a duplicate key, from the hook
        raise ConfigError(f"{path}: invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be an object, got {type(data).__name__}")
    return data
