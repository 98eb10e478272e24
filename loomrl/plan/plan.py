"""Execution plans as data: where each model function call runs and how its model is sharded there.

An :class:`ExecutionPlan` holds the cluster, one :class:`~loomrl.plan.allocation.Allocation` per call, the
plan's fusions (:class:`StreamFusion`, pipeline fusion) and two optional choices (which trained roles keep a
shadow copy, which roles are offloaded between calls). Facts derived from these take the workflow: the canonical
(training) allocation of each trained role, shadowed calls, offloaded roles, and a memory estimate. What runs
around the calls (reallocations, frees, shadow syncs, reloads) is the plan's schedule,
:func:`loomrl.plan.schedule.build_schedule`.

:meth:`ExecutionPlan.validate` checks a plan against a workflow and model configs and fails with one line
naming the MFC (``plan.allocations.<mfc>``), the field and the values, and where it helps the valid choices.
Memory is the estimate of :mod:`loomrl.plan.memory` per device:

    need(d) = Σ_{role on d, not offloaded} bytes(role, d) + max_{role on d, offloaded} bytes(role, d)
    bytes(role, d) = [d in the train mesh] · P/(tp·pp)·(2·b + 8)              # weights, grads, fp32 Adam
                   + max over the role's other calls on d, whose placement differs from training,
                     of P/(tp'·pp')·b                                          # a resharded or frozen copy

with ``P`` the role's parameters, counted for the busiest pipeline stage (:meth:`ModelShape.pipeline_params`:
each end stage holds a whole vocabulary table), and ``b`` bytes per parameter. An offloaded role is on a device
only while one of its calls runs there, and one device runs one call at a time, so at most one offloaded role
counts.

Plans round-trip through plain dicts, JSON and YAML (:meth:`ExecutionPlan.save`, :meth:`ExecutionPlan.load`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Any, ClassVar

import yaml

from loomrl.config.tools import FieldError, ValidatedConfig, fail, from_dict, read_yaml, spec, to_dict
from loomrl.errors import ConfigError
from loomrl.plan.allocation import Allocation, DeviceSet
from loomrl.plan.cluster import ClusterSpec
from loomrl.plan.hardware import GB
from loomrl.plan.layout import Layout
from loomrl.plan.memory import shard_bytes
from loomrl.plan.model_shape import ModelShape
from loomrl.workflow import MFCKind, Workflow

__all__ = ["AsyncTraining", "ExecutionPlan", "StreamFusion"]


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
        values: dict[str, Any] = {}  # each key's value has its field's type: float or "auto", int
        for part in text.split(","):
            key, sep, value = (p.strip() for p in part.partition(":"))
            if not sep or key not in ("migrate_at", "migrate_to", "chunk"):
                fail(
                    "stream_fusion",
                    f"{part.strip()!r} is not migrate_at:F|auto, migrate_to:N or chunk:N (e.g. "
                    "migrate_at:0.2,migrate_to:1, or on for the defaults)",
                )
            try:
                values[key] = value if value == "auto" else (float(value) if key == "migrate_at" else int(value))
            except ValueError:
                fail(f"stream_fusion.{key}", f"{value!r} is not a number")
        return cls(**values)

    @property
    def text(self) -> str:
        """The plan string form :meth:`parse` reads."""
        return f"migrate_at:{self.migrate_at},migrate_to:{self.migrate_to},chunk:{self.chunk}"


@dataclass(frozen=True)
class AsyncTraining(ValidatedConfig):
    """Asynchronous training with bounded staleness (AReaL's, verl's one-step-off generalised): generation runs
    ahead of training, so each iteration's rollout generation overlaps the training of an older batch.

    The plan fixes the interleaving, so the run is reproducible: in iteration ``i`` the rollout generate calls run
    on the prompts of iteration ``i + max_staleness`` with the weights of version ``i`` (the policy after ``i``
    updates), beside the rest of iteration ``i`` on a batch generated ``max_staleness`` versions ago; the first
    iteration also generates the batches before ``max_staleness`` with the initial weights. Every batch is trained
    at most ``max_staleness`` versions after the policy that sampled it, so
    ``algo.off_policy`` (the decoupled objective or truncated importance sampling) can correct for it."""

    max_staleness: int = spec(1, ge=1)
    """η: how many policy versions a batch's sampler may be older than the policy it trains (1: one-step-off)."""
    partial_rollout: bool = False
    """Partial rollouts (AReaL's interruptible generation, verl's ``partial_rollout``): a weight update interrupts
    the samples in flight, which continue under the new weights in the next iteration's generation, so one
    batch's long tail is spread over the ``max_staleness`` iterations it is generated in instead of being waited
    for. The plan fixes where the interruption falls: after ``segment_tokens`` tokens of a sample in each
    iteration but its last, in which every sample of the batch runs to its end. Every token keeps the policy
    version that sampled it and its behaviour log-prob; a batch is still trained at most ``max_staleness``
    versions after the oldest of them. Needs ``max_staleness`` ≥ 2 (at 1 a batch has one iteration to be
    generated in, so nothing can continue)."""
    segment_tokens: int | None = spec(None, ge=1)
    """Tokens a sample generates in each iteration before a weight update interrupts it (partial rollouts); None:
    the response budget divided evenly over the ``max_staleness`` iterations (rounded up)."""

    def validate(self) -> None:
        if self.partial_rollout and self.max_staleness < 2:
            fail(
                "partial_rollout",
                f"needs max_staleness >= 2 (got {self.max_staleness}): a batch generated in one iteration has no "
                "later iteration to continue in",
            )
        if self.segment_tokens is not None and not self.partial_rollout:
            fail("segment_tokens", "applies to partial rollouts only: set partial_rollout:on too")

    @classmethod
    def parse(cls, text: str) -> AsyncTraining:
        """``N``, or comma-separated ``key:value`` pairs (a plan string's ``async=`` item), e.g. ``max_staleness:2``
        or ``2,partial_rollout:on,segment_tokens:64``."""
        values: dict[str, Any] = {}
        for i, part in enumerate(str(text).split(",")):
            key, sep, value = (p.strip() for p in part.partition(":"))
            if not sep and i == 0:
                key, value = "max_staleness", key
            try:
                if key in ("max_staleness", "segment_tokens"):
                    values[key] = int(value)
                elif key == "partial_rollout" and value in ("on", "off"):
                    values[key] = value == "on"
                else:
                    raise ValueError
            except ValueError:
                fail(
                    "async",
                    f"{part.strip()!r} is not N, max_staleness:N, partial_rollout:on|off or segment_tokens:N (e.g. "
                    "async=2,partial_rollout:on)",
                )
        return cls(**values)

    @property
    def text(self) -> str:
        """The plan string form :meth:`parse` reads."""
        items = [f"max_staleness:{self.max_staleness}"]
        if self.partial_rollout:
            items.append("partial_rollout:on")
        if self.segment_tokens is not None:
            items.append(f"segment_tokens:{self.segment_tokens}")
        return ",".join(items)


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
    asynchronous: AsyncTraining | None = None
    """Asynchronous training (``async`` in plan files and strings): generation runs up to ``max_staleness``
    batches ahead of training; None: synchronous (every batch sampled by the policy it trains)."""

    @property
    def staleness(self) -> int:
        """η of :attr:`asynchronous`; 0 for a synchronous plan."""
        return 0 if self.asynchronous is None else self.asynchronous.max_staleness

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterSpec):
            raise ConfigError(f"plan.cluster: {self.cluster!r} is not a ClusterSpec")
        if not isinstance(self.allocations, Mapping) or not self.allocations:
            raise ConfigError(
                f"plan.allocations: {self.allocations!r} is not a non-empty mapping of MFC name → Allocation"
            )
        for name, alloc in self.allocations.items():
            if not isinstance(alloc, Allocation):
                raise ConfigError(f"plan.allocations.{name}: {alloc!r} is not an Allocation")
            outside = [d for d in alloc.mesh if d >= self.cluster.n_devices]
            if outside:
                raise ConfigError(
                    f"plan.allocations.{name}.devices: device {outside[0]} is outside the cluster "
                    f"{self.cluster} (devices 0-{self.cluster.n_devices - 1})"
                )
        object.__setattr__(self, "allocations", dict(self.allocations))
        object.__setattr__(self, "shadow", _roles_list(self.shadow, "shadow"))
        object.__setattr__(self, "offload", _roles_list(self.offload, "offload"))
        if self.stream_fusion is not None and not isinstance(self.stream_fusion, StreamFusion):
            raise ConfigError(f"plan.stream_fusion: {self.stream_fusion!r} is not a StreamFusion")
        if not isinstance(self.pipeline_fusion, bool):
            raise ConfigError(f"plan.pipeline_fusion: {self.pipeline_fusion!r} is not true or false")
        if self.asynchronous is not None and not isinstance(self.asynchronous, AsyncTraining):
            raise ConfigError(f"plan.async: {self.asynchronous!r} is not an AsyncTraining")

    def with_allocation(self, name: str, allocation: Allocation) -> ExecutionPlan:
        """A copy of the plan with ``name`` placed at ``allocation``."""
        return dataclasses.replace(self, allocations={**self.allocations, name: allocation})

    def __getitem__(self, name: str) -> Allocation:
        if name not in self.allocations:
            raise ConfigError(
                f"plan.allocations: MFC {name!r} has no allocation; allocated: {', '.join(self.allocations)}"
            )
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
            assert canon is not None  # a trained role has a train call
            if any(
                m.kind is MFCKind.GENERATE and self[m.name].mesh.isdisjoint(canon.mesh)
                for m in workflow.mfcs_of_role(role)
            ):
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
        return tuple(
            role
            for role in workflow.roles()
            if role not in trained
            and any(not devices[role].isdisjoint(used) for other, used in devices.items() if other != role)
        )

    def shadow_calls(self, workflow: Workflow, role: str) -> list[str]:
        """The calls of ``role`` its shadow copy serves: non-train calls on devices disjoint from training."""
        if role not in self.shadow_roles(workflow):
            return []
        canon = self.canonical_layout(workflow, role)
        assert canon is not None  # a shadow role is trained (validate checks it)
        return [
            m.name
            for m in workflow.mfcs_of_role(role)
            if m.kind is not MFCKind.TRAIN and self[m.name].mesh.isdisjoint(canon.mesh)
        ]

    def mfcs_on(self, device: int) -> list[str]:
        """Names of the MFCs whose mesh includes ``device``."""
        return [name for name, alloc in self.allocations.items() if device in alloc.mesh]

    # ---------------------------------------------------------------------------------------- validation

    def validate(
        self, workflow: Workflow, model_configs: Mapping[str, object] | None = None, bytes_per_param: int = 4
    ) -> None:
        """Raise a one-line ConfigError unless the plan runs ``workflow``: an allocation for exactly its MFCs,
        consistent train placements, valid shadow/offload roles; with ``model_configs`` (role → HF-config-like
        object) also tp/pp divisibility and the memory estimate (module docstring)."""
        _check_plan(self, workflow, model_configs, bytes_per_param)

    def role_memory(
        self, workflow: Workflow, model_configs: Mapping[str, object], bytes_per_param: int = 4
    ) -> dict[int, dict[str, int]]:
        """Device → role → estimated bytes of the role's state there."""
        return _role_memory(self, workflow, model_configs, bytes_per_param)

    def peak_memory(
        self, workflow: Workflow, model_configs: Mapping[str, object], bytes_per_param: int = 4
    ) -> dict[int, int]:
        """Device → estimated peak bytes (offloaded roles counted one at a time)."""
        return _peak_memory(self, workflow, model_configs, bytes_per_param)

    # -------------------------------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/YAML-ready); :meth:`from_dict` reads it back to an equal plan."""
        allocations = {
            name: {
                "devices": a.mesh.text,
                "dp": a.layout.dp,
                "tp": a.layout.tp,
                "pp": a.layout.pp,
                "micro_batches": a.micro_batches,
                **({"recompute": True} if a.recompute else {}),
                **({"zero": True} if a.zero else {}),
                **({"fsdp": True} if a.fsdp else {}),
                **({"reverse": True} if a.layout.reverse else {}),
            }
            for name, a in self.allocations.items()
        }
        return {
            "cluster": to_dict(self.cluster),
            "allocations": allocations,
            "shadow": None if self.shadow is None else list(self.shadow),
            "offload": None if self.offload is None else list(self.offload),
            "stream_fusion": None if self.stream_fusion is None else to_dict(self.stream_fusion),
            **({"pipeline_fusion": True} if self.pipeline_fusion else {}),
            **({"async": to_dict(self.asynchronous)} if self.asynchronous is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecutionPlan:
        """Strict inverse of :meth:`to_dict`: unknown keys and wrong types fail with the key's path.

        ``devices`` may be the compact text (``"0-3,6"``) or a list of indices."""
        data = dict(data)
        if "async" in data:  # a Python keyword: the record's field is ``asynchronous``
            data["asynchronous"] = data.pop("async")
        try:
            record = from_dict(_PlanRecord, data, "plan")
        except FieldError as err:
            raise FieldError(
                err.path.replace("plan.asynchronous", "plan.async"), err.reason.replace("asynchronous", "async")
            ) from None
        allocations = {}
        for name, item in record.allocations.items():
            try:
                mesh = DeviceSet.parse(item.devices) if isinstance(item.devices, str) else DeviceSet(item.devices)
                allocations[name] = Allocation(
                    mesh,
                    Layout(item.dp, item.tp, item.pp, item.reverse),
                    item.micro_batches,
                    item.recompute,
                    item.zero,
                    item.fsdp,
                )
            except FieldError as err:
                raise err.under(f"plan.allocations.{name}") from None
        return cls(
            record.cluster,
            allocations,
            record.shadow,
            record.offload,
            record.stream_fusion,
            record.pipeline_fusion,
            record.asynchronous,
        )

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
    asynchronous: AsyncTraining | None = None
    """Asynchronous training, the file's ``async`` (null: synchronous)."""


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


# ------------------------------------------------------------------------------------------- validation

_TP_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def _check_plan(
    plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object] | None = None, bytes_per_param: int = 4
) -> None:
    """Raise a one-line ConfigError unless ``plan`` can run ``workflow`` (and, given configs, fits the models)."""
    _check_names(plan, workflow)
    _check_calls(plan, workflow)
    _check_choices(plan, workflow)
    if model_configs is None:
        return
    configs = _configs_by_role(workflow, model_configs)
    for mfc in workflow:
        if mfc.role is not None:
            _check_divisibility(mfc.name, plan[mfc.name].layout, mfc.role, configs[mfc.role])
    _check_memory(plan, workflow, configs, bytes_per_param)


def _unknown(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_names(plan: ExecutionPlan, workflow: Workflow) -> None:
    names = [m.name for m in workflow.topological_order()]
    for name in plan.allocations:
        if name not in workflow:
            raise ConfigError(
                f"plan.allocations.{name}: unknown MFC; MFCs of the workflow: {', '.join(names)}"
                + _unknown(name, names)
            )
    for name in names:
        if name not in plan.allocations:
            raise ConfigError(
                f"plan.allocations: MFC '{name}' has no allocation; allocated: {', '.join(plan.allocations)}"
            )


def _check_calls(plan: ExecutionPlan, workflow: Workflow) -> None:
    """A compute step has no model to shard; only train calls recompute activations; a role's train calls
    share the one canonical layout (recompute and micro-batches may differ)."""
    for mfc in workflow:
        layout = plan[mfc.name].layout
        if mfc.kind is MFCKind.COMPUTE and (layout.tp > 1 or layout.pp > 1):
            field = "tp" if layout.tp > 1 else "pp"
            raise ConfigError(
                f"plan.allocations.{mfc.name}.{field}: {getattr(layout, field)} but a compute step "
                "has no model to shard (valid: 1)"
            )
        if plan[mfc.name].recompute and mfc.kind is not MFCKind.TRAIN:
            raise ConfigError(
                f"plan.allocations.{mfc.name}: {plan[mfc.name].text} recomputes activations (rc) "
                f"but {mfc.kind.value} calls keep none for a backward; rc is for train calls only"
            )
        if plan[mfc.name].zero and mfc.kind is not MFCKind.TRAIN:
            raise ConfigError(
                f"plan.allocations.{mfc.name}: {plan[mfc.name].text} shards optimizer state (zero) "
                f"but {mfc.kind.value} calls have no optimizer; zero is for train calls only"
            )
        if plan[mfc.name].fsdp and mfc.kind is not MFCKind.TRAIN:
            raise ConfigError(
                f"plan.allocations.{mfc.name}: {plan[mfc.name].text} shards the weights (fsdp) but "
                f"{mfc.kind.value} calls run on a whole copy of them; fsdp is for train calls only"
            )
    for role in workflow.roles():
        trains = [m.name for m in workflow.mfcs_of_role(role) if m.kind is MFCKind.TRAIN]
        for name in trains[1:]:
            if plan[name].shards != plan[trains[0]].shards or plan[name].zero != plan[trains[0]].zero:
                raise ConfigError(
                    f"plan.allocations.{name}: {plan[name].text} differs from {trains[0]} at "
                    f"{plan[trains[0]].text}; the train calls of role '{role}' must share one placement "
                    "(and one optimizer: zero or not)"
                )


def _check_choices(plan: ExecutionPlan, workflow: Workflow) -> None:
    if plan.stream_fusion is not None:
        group = workflow.stream_fusable()
        if group is None:
            raise ConfigError(
                "plan.stream_fusion: the workflow has no inference call that reads only generation's outputs, "
                "so there is nothing to fuse; remove stream_fusion"
            )
        replicas = plan[group[0].name].layout.dp
        if plan.stream_fusion.migrate_to > replicas:
            raise ConfigError(
                f"plan.stream_fusion.migrate_to: {plan.stream_fusion.migrate_to} exceeds the {replicas} generation "
                f"replica(s) of {group[0].name} at {plan[group[0].name].text} (valid: 1-{replicas})"
            )
    if plan.pipeline_fusion:
        _check_pipeline_fusion(plan, workflow)
    if plan.asynchronous is not None:
        _check_async(plan, workflow)
    roles = workflow.roles()
    for field, chosen in (("shadow", plan.shadow), ("offload", plan.offload)):
        for role in chosen or ():
            if role not in roles:
                raise ConfigError(f"plan.{field}: unknown role '{role}'; roles of the workflow: {', '.join(roles)}")
    for role in plan.shadow or ():
        canon = plan.canonical_layout(workflow, role)
        if canon is None:
            raise ConfigError(
                f"plan.shadow: role '{role}' never trains, so it has no weights to shadow; "
                f"trained roles: {', '.join(plan.trained_roles(workflow))}"
            )
        if not plan.shadow_calls(workflow, role):
            raise ConfigError(
                f"plan.shadow: role '{role}' has no call off its training devices "
                f"{canon.mesh.text}, so a shadow would serve nothing"
            )


def _check_async(plan: ExecutionPlan, workflow: Workflow) -> None:
    """Asynchronous training needs rollout generation of a trained role and excludes stream fusion (which runs
    inference on the samples of the generation it fuses with, of the same batch)."""
    if not workflow.rollout_generations():
        raise ConfigError(
            "plan.async: the workflow has no generate call of a trained role on the prompts alone, so nothing "
            "can run ahead of training; remove async"
        )
    if plan.stream_fusion is not None:
        raise ConfigError(
            "plan.async: stream fusion overlaps generation with inference on the same batch, asynchronous training "
            "generates ahead of it; choose one (remove stream_fusion or async)"
        )


def _check_pipeline_fusion(plan: ExecutionPlan, workflow: Workflow) -> None:
    """Intra-stage fusion runs two independent train calls' pipelines on the same devices, each device holding one
    stage (of one replica) of either model: one TP slice per stage (tp = 1), no FSDP, pp > 1 for both."""
    pair = workflow.train_pair()
    if pair is None:
        trains = [m.name for m in workflow if m.kind is MFCKind.TRAIN]
        raise ConfigError(
            f"plan.pipeline_fusion: fusion needs two independent train calls of two roles; the workflow "
            f"has {', '.join(trains) or 'none'}; remove pipeline_fusion"
        )
    first, second = (plan[m.name] for m in pair)
    if first.mesh != second.mesh:
        raise ConfigError(
            f"plan.pipeline_fusion: {pair[0].name} runs on {first.mesh.text} and {pair[1].name} on "
            f"{second.mesh.text}; fused training needs the same devices for both"
        )
    for mfc, alloc in zip(pair, (first, second)):
        if alloc.layout.pp == 1 or alloc.layout.tp > 1 or alloc.fsdp:
            raise ConfigError(
                f"plan.pipeline_fusion: {mfc.name} at {alloc.text} is not a pipeline of one TP slice per "
                "stage; fused training needs pp > 1, tp = 1 and no fsdp for both train calls"
            )


def _configs_by_role(workflow: Workflow, model_configs: Mapping[str, object]) -> dict[str, object]:
    for role in workflow.roles():
        if role not in model_configs:
            raise ConfigError(
                f"model_configs: no config for role '{role}'; given: {', '.join(model_configs) or 'none'}"
            )
    return {role: model_configs[role] for role in workflow.roles()}


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def _check_divisibility(name: str, layout: Layout, role: str, config: object) -> None:
    where = f"plan.allocations.{name}"
    if layout.tp > 1:
        values: dict[str, Any] = {f: getattr(config, f, None) for f in _TP_FIELDS}  # a config's fields are untyped
        for field, value in values.items():
            if value is None:
                raise ConfigError(
                    f"{where}.tp: {layout.tp} cannot be checked: the config of role '{role}' has no {field}"
                )
        common = 0
        for value in values.values():
            common = gcd(common, int(value))
        for field, value in values.items():
            if value % layout.tp:
                raise ConfigError(
                    f"{where}.tp: {layout.tp} does not divide {field}={value} of role '{role}' "
                    f"(valid tp: {_divisors(common)})"
                )
    if layout.pp > 1:
        layers = getattr(config, "num_hidden_layers", None)
        if layers is None or layers % layout.pp:
            raise ConfigError(
                f"{where}.pp: {layout.pp} does not divide num_hidden_layers={layers} of role "
                f"'{role}' (valid pp: {_divisors(int(layers or 1))})"
            )


def _role_memory(
    plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object], bytes_per_param: int = 4
) -> dict[int, dict[str, int]]:
    """Device → role → estimated bytes of that role's state on the device (see the module docstring)."""
    configs = _configs_by_role(workflow, model_configs)
    out: dict[int, dict[str, int]] = {}
    for role in workflow.roles():
        shape = ModelShape.from_config(configs[role])
        canon = plan.canonical_layout(workflow, role)
        need: dict[int, int] = {}
        if canon is not None:
            for d in canon.mesh:
                need[d] = shard_bytes(
                    shape.pipeline_params(canon.layout.pp),
                    canon.layout.tp,
                    canon.layout.pp,
                    bytes_per_param,
                    trained=True,
                    optimizer_shards=canon.optimizer_shards,
                    param_shards=canon.param_shards,
                )
        copies: dict[int, int] = {}
        for mfc in workflow.mfcs_of_role(role):
            alloc = plan[mfc.name]
            if mfc.kind is MFCKind.TRAIN or (canon is not None and alloc.shards == canon.shards):
                continue
            params = shape.pipeline_params(alloc.layout.pp)
            size = shard_bytes(params, alloc.layout.tp, alloc.layout.pp, bytes_per_param, trained=False)
            for d in alloc.mesh:
                copies[d] = max(copies.get(d, 0), size)
        for d in sorted(set(need) | set(copies)):
            out.setdefault(d, {})[role] = need.get(d, 0) + copies.get(d, 0)
    return dict(sorted(out.items()))


def _peak_memory(
    plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object], bytes_per_param: int = 4
) -> dict[int, int]:
    """Device → estimated peak bytes: resident roles summed, plus the largest offloaded role."""
    offloaded = set(plan.offloaded_roles(workflow))
    peaks: dict[int, int] = {}
    for d, roles in _role_memory(plan, workflow, model_configs, bytes_per_param).items():
        resident = sum(b for r, b in roles.items() if r not in offloaded)
        peaks[d] = resident + max((b for r, b in roles.items() if r in offloaded), default=0)
    return peaks


def _check_memory(plan: ExecutionPlan, workflow: Workflow, configs: Mapping[str, object], bytes_per_param: int) -> None:
    if isinstance(bytes_per_param, bool) or not isinstance(bytes_per_param, int) or bytes_per_param < 1:
        raise ConfigError(
            f"bytes_per_param: {bytes_per_param!r} is not a positive integer (e.g. 2 for bf16, 4 for fp32)"
        )
    peaks = _peak_memory(plan, workflow, configs, bytes_per_param)
    available = plan.cluster.memory_gb * GB
    device, need = max(peaks.items(), key=lambda item: (item[1], -item[0]))
    if need <= available:
        return
    offloaded = set(plan.offloaded_roles(workflow))
    roles = _role_memory(plan, workflow, configs, bytes_per_param)[device]
    parts = ", ".join(f"{r} {b / GB:.1f}" + (" offloaded" if r in offloaded else "") for r, b in roles.items())
    raise ConfigError(
        f"plan: device {device} needs an estimated {need / GB:.1f} GB ({parts}; MFCs "
        f"{', '.join(plan.mfcs_on(device))}) but has {plan.cluster.memory_gb:.1f} GB "
        f"({plan.cluster.profile}); spread the roles over more devices or raise tp/pp"
    )
