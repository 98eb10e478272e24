"""Plan strings: a hand-written execution plan on one line.

Items are separated by ``;``; each places one MFC as ``NAME=DEVICES[:LAYOUT]``::

    actor_gen=0-3:dp4; ref_inf=4-5:dp2; reward_inf=6-7:dp2; critic_inf=4-7:dp4; actor_train=0-7:dp4tp2;
    critic_train=0-7:dp8

- ``DEVICES``: global device indices as ranges and singles, comma-separated: ``0-3``, ``0,2,5``, ``0-3,6``;
- ``LAYOUT``: tokens ``dpN``, ``tpN``, ``ppN`` and ``mbN`` (micro-batches) in any order, each optional:
  ``dp4tp2``, ``tp2`` (dp then fills the mesh: 8 devices → dp4), ``dp2mb4``; ``rev`` numbers pipeline stages
  from the mesh's last device (``pp4rev``); without a layout the MFC is pure data parallel over its devices
  (``4-7`` is ``4-7:dp4``);
- ``shadow=actor`` and ``offload=ref,reward`` set the plan's explicit shadow and offload roles (``offload=``
  means none); without them the default rules of :class:`~loomrl.plan.plan.ExecutionPlan` apply;
- ``stream_fusion=on`` or ``stream_fusion=migrate_at:0.2,migrate_to:1`` (``migrate_at:auto``, ``chunk:N``) fuses
generation with
  the inference calls that read only its outputs (:class:`~loomrl.plan.plan.StreamFusion`); these items may also
  follow a strategy's name (``colocate; stream_fusion=on``, :func:`loomrl.plan.strategies.make_plan`);
- ``pipeline_fusion=on`` (or ``off``) runs the two train calls as one fused pipeline (intra-stage fusion,
  :attr:`~loomrl.plan.plan.ExecutionPlan.pipeline_fusion`), e.g. ``actor_train=0-3:pp4mb4;
  critic_train=0-3:pp4revmb4; pipeline_fusion=on``;
- ``async=N`` (or ``async=max_staleness:N``) trains asynchronously: generation runs up to N batches ahead of
  training (:class:`~loomrl.plan.plan.AsyncTraining`), e.g. ``actor_gen=0-1; ref_inf=2; reward_inf=3;
  actor_train=2-3; async=1``; ``async=2,partial_rollout:on`` (``segment_tokens:N``) adds partial rollouts;
- a compute step (e.g. ``advantages``) that is not named runs on device 0 with no parallelism
  (``advantages=0:dp1``), where the runtime runs it; every model call must be named.

More examples, on a ``cpu:1x4`` cluster::

    actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; actor_train=0-3:dp2tp2          # colocated GRPO, TP training
    actor_gen=0-1; ref_inf=2; reward_inf=3; actor_train=2-3; shadow=actor        # separated generation

:func:`format_plan_string` prints a plan back in this form; ``parse_plan_string(format_plan_string(p), ...) == p``.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from loomrl.config.tools import FieldError
from loomrl.errors import ConfigError
from loomrl.plan.allocation import Allocation, DeviceSet
from loomrl.plan.cluster import ClusterSpec
from loomrl.plan.layout import Layout
from loomrl.plan.plan import AsyncTraining, ExecutionPlan, StreamFusion
from loomrl.workflow import MFCKind, Workflow

__all__ = ["RESERVED_KEYS", "compute_allocation", "format_plan_string", "parse_plan_string", "with_choices"]

RESERVED_KEYS = ("shadow", "offload", "stream_fusion", "pipeline_fusion", "async")
"""Item names that set plan fields rather than place an MFC."""

RENAMED_KEYS = {"fuse": "stream_fusion", "fuse_train": "pipeline_fusion"}
"""Item names of earlier releases → their names now (refused with a one-line error that names the new one)."""


def compute_allocation() -> Allocation:
    """Where a compute step runs unless told otherwise: device 0, one rank (it needs the whole batch)."""
    return Allocation(DeviceSet((0,)), Layout())


def _parse_item(
    item: str, workflow: Workflow
) -> tuple[str, Allocation | StreamFusion | AsyncTraining | bool | tuple[str, ...]]:
    name, sep, rest = (part.strip() for part in item.partition("="))
    if not sep or not name:
        raise ConfigError(f"plan item {item!r}: expected NAME=DEVICES[:LAYOUT], e.g. actor_gen=0-3:dp4")
    if name in RENAMED_KEYS:
        raise ConfigError(f"plan item {item!r}: '{name}' was renamed to '{RENAMED_KEYS[name]}'")
    if name == "stream_fusion":
        try:
            return name, StreamFusion.parse(rest)
        except FieldError as err:
            raise ConfigError(f"plan item {item!r}: {err}") from None
    if name == "async":
        try:
            return "asynchronous", AsyncTraining.parse(rest)
        except FieldError as err:
            raise ConfigError(f"plan item {item!r}: {err}") from None
    if name == "pipeline_fusion":
        if rest not in ("on", "off"):
            raise ConfigError(f"plan item {item!r}: pipeline_fusion is on or off, not {rest!r}")
        return name, rest == "on"
    if name in RESERVED_KEYS:
        return name, tuple(r.strip() for r in rest.split(",") if r.strip())
    if name not in workflow:
        names = [m.name for m in workflow.topological_order()]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"plan item {item!r}: unknown MFC '{name}'; MFCs: {', '.join(names)}{hint}")
    try:
        return name, Allocation.parse(rest)
    except FieldError as err:
        raise ConfigError(f"plan item {item!r}: {err.under(name)}") from None


def parse_plan_string(text: str, workflow: Workflow, cluster: ClusterSpec) -> ExecutionPlan:
    """The plan a plan string describes, checked against ``workflow`` (see the module docstring)."""
    given: dict[str, Allocation] = {}
    choices: dict[str, Any] = {}  # a reserved key's value has its plan field's type (_parse_item)
    for item in (part.strip() for part in str(text).split(";")):
        if not item:
            continue
        name, value = _parse_item(item, workflow)
        if name in given or name in choices:
            raise ConfigError(f"plan item {item!r}: '{name}' is placed twice")
        if isinstance(value, Allocation):
            given[name] = value
        else:
            choices[name] = value
    allocations: dict[str, Allocation] = {}
    for mfc in workflow.topological_order():
        if mfc.name in given:
            allocations[mfc.name] = given[mfc.name]
        elif mfc.kind is MFCKind.COMPUTE:
            allocations[mfc.name] = compute_allocation()
        else:
            raise ConfigError(f"plan: MFC '{mfc.name}' is not placed; add e.g. '{mfc.name}=0-{cluster.n_devices - 1}'")
    try:
        plan = ExecutionPlan(
            cluster,
            allocations,
            choices.get("shadow"),
            choices.get("offload"),
            choices.get("stream_fusion"),
            choices.get("pipeline_fusion", False),
            choices.get("asynchronous"),
        )
    except ConfigError as err:
        raise ConfigError(f"plan: {err}") from None
    plan.validate(workflow)
    return plan


def with_choices(plan: ExecutionPlan, text: str, workflow: Workflow) -> ExecutionPlan:
    """``plan`` with the ``shadow``, ``offload``, ``stream_fusion``, ``pipeline_fusion`` and ``async`` items of ``text``
    (``;``-separated) applied."""
    changes: dict[str, Any] = {}  # each value has its plan field's type (_parse_item)
    for item in (part.strip() for part in str(text).split(";")):
        if not item:
            continue
        if item.partition("=")[0].strip() not in (*RESERVED_KEYS, *RENAMED_KEYS):
            raise ConfigError(
                f"plan item {item!r}: after a strategy only {', '.join(RESERVED_KEYS)} items may "
                "follow (e.g. 'colocate; stream_fusion=on'); place calls with a plan string instead"
            )
        name, value = _parse_item(item, workflow)
        changes[name] = value
    return dataclasses.replace(plan, **changes)


def format_plan_string(plan: ExecutionPlan, workflow: Workflow | None = None) -> str:
    """The plan string of ``plan``; given the workflow, compute steps at the default are left out."""
    default = compute_allocation()
    items = []
    for name, alloc in plan.allocations.items():
        if workflow is not None and name in workflow and workflow[name].kind is MFCKind.COMPUTE and alloc == default:
            continue
        items.append(f"{name}={alloc.text}")
    for key, roles in (("shadow", plan.shadow), ("offload", plan.offload)):
        if roles is not None:
            items.append(f"{key}={','.join(roles)}")
    if plan.stream_fusion is not None:
        items.append(f"stream_fusion={plan.stream_fusion.text}")
    if plan.pipeline_fusion:
        items.append("pipeline_fusion=on")
    if plan.asynchronous is not None:
        a = plan.asynchronous
        items.append(f"async={a.text if a.partial_rollout else a.max_staleness}")
    return "; ".join(items)
