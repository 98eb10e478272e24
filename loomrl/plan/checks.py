"""Validation of an :class:`~loomrl.plan.plan.ExecutionPlan` against a workflow and model configs.

Each failure is one :class:`~loomrl.errors.ConfigError` line naming the MFC (``plan.allocations.<mfc>``), the
field and the values, and where it helps the valid choices. Memory is the estimate of
:mod:`loomrl.plan.memory` per device:

    need(d) = Σ_{role on d, not offloaded} bytes(role, d) + max_{role on d, offloaded} bytes(role, d)
    bytes(role, d) = [d in the train mesh] · P/(tp·pp)·(2·b + 8)              # weights, grads, fp32 Adam
                   + max over the role's other calls on d, whose placement differs from training,
                     of P/(tp'·pp')·b                                          # a resharded or frozen copy

with ``P`` the role's parameters and ``b`` bytes per parameter. An offloaded role is on a device only while
one of its calls runs there, and one device runs one call at a time, so at most one offloaded role counts.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from math import gcd
from typing import TYPE_CHECKING

from loomrl.errors import ConfigError
from loomrl.plan.cluster import GB
from loomrl.plan.memory import param_count, shard_bytes
from loomrl.workflow import MFCKind, Workflow

if TYPE_CHECKING:
    from loomrl.plan.layout import Layout
    from loomrl.plan.plan import ExecutionPlan

__all__ = ["check_plan", "peak_memory", "role_memory"]

_TP_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def check_plan(plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object] | None = None,
               bytes_per_param: int = 4) -> None:
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
            raise ConfigError(f"plan.allocations.{name}: unknown MFC; MFCs of the workflow: {', '.join(names)}"
                              + _unknown(name, names))
    for name in names:
        if name not in plan.allocations:
            raise ConfigError(f"plan.allocations: MFC '{name}' has no allocation; "
                              f"allocated: {', '.join(plan.allocations)}")


def _check_calls(plan: ExecutionPlan, workflow: Workflow) -> None:
    """A compute step has no model to shard; only train calls recompute activations; a role's train calls
    share the one canonical layout (recompute and micro-batches may differ)."""
    for mfc in workflow:
        layout = plan[mfc.name].layout
        if mfc.kind is MFCKind.COMPUTE and (layout.tp > 1 or layout.pp > 1):
            field = "tp" if layout.tp > 1 else "pp"
            raise ConfigError(f"plan.allocations.{mfc.name}.{field}: {getattr(layout, field)} but a compute step "
                              "has no model to shard (valid: 1)")
        if plan[mfc.name].recompute and mfc.kind is not MFCKind.TRAIN:
            raise ConfigError(f"plan.allocations.{mfc.name}: {plan[mfc.name].text} recomputes activations (rc) "
                              f"but {mfc.kind.value} calls keep none for a backward; rc is for train calls only")
        if plan[mfc.name].zero and mfc.kind is not MFCKind.TRAIN:
            raise ConfigError(f"plan.allocations.{mfc.name}: {plan[mfc.name].text} shards optimizer state (zero) "
                              f"but {mfc.kind.value} calls have no optimizer; zero is for train calls only")
        if plan[mfc.name].fsdp and mfc.kind is not MFCKind.TRAIN:
            raise ConfigError(f"plan.allocations.{mfc.name}: {plan[mfc.name].text} shards the weights (fsdp) but "
                              f"{mfc.kind.value} calls run on a whole copy of them; fsdp is for train calls only")
    for role in workflow.roles():
        trains = [m.name for m in workflow.mfcs_of_role(role) if m.kind is MFCKind.TRAIN]
        for name in trains[1:]:
            if plan[name].shards != plan[trains[0]].shards or plan[name].zero != plan[trains[0]].zero:
                raise ConfigError(f"plan.allocations.{name}: {plan[name].text} differs from {trains[0]} at "
                                  f"{plan[trains[0]].text}; the train calls of role '{role}' must share one placement "
                                  "(and one optimizer: zero or not)")


def _check_choices(plan: ExecutionPlan, workflow: Workflow) -> None:
    if plan.stream_fusion is not None:
        group = workflow.stream_fusable()
        if group is None:
            raise ConfigError("plan.stream_fusion: the workflow has no inference call that reads only generation's outputs, "
                              "so there is nothing to fuse; remove stream_fusion")
        replicas = plan[group[0].name].layout.dp
        if plan.stream_fusion.migrate_to > replicas:
            raise ConfigError(f"plan.stream_fusion.migrate_to: {plan.stream_fusion.migrate_to} exceeds the {replicas} generation "
                              f"replica(s) of {group[0].name} at {plan[group[0].name].text} (valid: 1-{replicas})")
    if plan.pipeline_fusion:
        _check_pipeline_fusion(plan, workflow)
    roles = workflow.roles()
    for field, chosen in (("shadow", plan.shadow), ("offload", plan.offload)):
        for role in chosen or ():
            if role not in roles:
                raise ConfigError(f"plan.{field}: unknown role '{role}'; roles of the workflow: {', '.join(roles)}")
    for role in plan.shadow or ():
        canon = plan.canonical_layout(workflow, role)
        if canon is None:
            raise ConfigError(f"plan.shadow: role '{role}' never trains, so it has no weights to shadow; "
                              f"trained roles: {', '.join(plan.trained_roles(workflow))}")
        if not plan.shadow_calls(workflow, role):
            raise ConfigError(f"plan.shadow: role '{role}' has no call off its training devices "
                              f"{canon.mesh.text}, so a shadow would serve nothing")


def _check_pipeline_fusion(plan: ExecutionPlan, workflow: Workflow) -> None:
    """Intra-stage fusion runs two independent train calls' pipelines on the same devices, each device holding one
    stage (of one replica) of either model: one TP slice per stage (tp = 1), no FSDP, pp > 1 for both."""
    pair = workflow.train_pair()
    if pair is None:
        trains = [m.name for m in workflow if m.kind is MFCKind.TRAIN]
        raise ConfigError(f"plan.pipeline_fusion: fusion needs two independent train calls of two roles; the workflow "
                          f"has {', '.join(trains) or 'none'}; remove pipeline_fusion")
    first, second = (plan[m.name] for m in pair)
    if first.mesh != second.mesh:
        raise ConfigError(f"plan.pipeline_fusion: {pair[0].name} runs on {first.mesh.text} and {pair[1].name} on "
                          f"{second.mesh.text}; fused training needs the same devices for both")
    for mfc, alloc in zip(pair, (first, second)):
        if alloc.layout.pp == 1 or alloc.layout.tp > 1 or alloc.fsdp:
            raise ConfigError(f"plan.pipeline_fusion: {mfc.name} at {alloc.text} is not a pipeline of one TP slice per "
                              "stage; fused training needs pp > 1, tp = 1 and no fsdp for both train calls")


def _configs_by_role(workflow: Workflow, model_configs: Mapping[str, object]) -> dict[str, object]:
    for role in workflow.roles():
        if role not in model_configs:
            raise ConfigError(f"model_configs: no config for role '{role}'; given: {', '.join(model_configs) or 'none'}")
    return {role: model_configs[role] for role in workflow.roles()}


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def _check_divisibility(name: str, layout: Layout, role: str, config: object) -> None:
    where = f"plan.allocations.{name}"
    if layout.tp > 1:
        values = {f: getattr(config, f, None) for f in _TP_FIELDS}
        for field, value in values.items():
            if value is None:
                raise ConfigError(f"{where}.tp: {layout.tp} cannot be checked: the config of role '{role}' has no {field}")
        common = 0
        for value in values.values():
            common = gcd(common, int(value))
        for field, value in values.items():
            if value % layout.tp:
                raise ConfigError(f"{where}.tp: {layout.tp} does not divide {field}={value} of role '{role}' "
                                  f"(valid tp: {_divisors(common)})")
    if layout.pp > 1:
        layers = getattr(config, "num_hidden_layers", None)
        if layers is None or layers % layout.pp:
            raise ConfigError(f"{where}.pp: {layout.pp} does not divide num_hidden_layers={layers} of role "
                              f"'{role}' (valid pp: {_divisors(int(layers or 1))})")


def role_memory(plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object],
                bytes_per_param: int = 4) -> dict[int, dict[str, int]]:
    """Device → role → estimated bytes of that role's state on the device (see the module docstring)."""
    configs = _configs_by_role(workflow, model_configs)
    out: dict[int, dict[str, int]] = {}
    for role in workflow.roles():
        params = param_count(configs[role])
        canon = plan.canonical_layout(workflow, role)
        need: dict[int, int] = {}
        if canon is not None:
            for d in canon.mesh:
                need[d] = shard_bytes(params, canon.layout.tp, canon.layout.pp, bytes_per_param, trained=True,
                                      optimizer_shards=canon.optimizer_shards, param_shards=canon.param_shards)
        copies: dict[int, int] = {}
        for mfc in workflow.mfcs_of_role(role):
            alloc = plan[mfc.name]
            if mfc.kind is MFCKind.TRAIN or (canon is not None and alloc.shards == canon.shards):
                continue
            size = shard_bytes(params, alloc.layout.tp, alloc.layout.pp, bytes_per_param, trained=False)
            for d in alloc.mesh:
                copies[d] = max(copies.get(d, 0), size)
        for d in sorted(set(need) | set(copies)):
            out.setdefault(d, {})[role] = need.get(d, 0) + copies.get(d, 0)
    return dict(sorted(out.items()))


def peak_memory(plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object],
                bytes_per_param: int = 4) -> dict[int, int]:
    """Device → estimated peak bytes: resident roles summed, plus the largest offloaded role."""
    offloaded = set(plan.offloaded_roles(workflow))
    peaks: dict[int, int] = {}
    for d, roles in role_memory(plan, workflow, model_configs, bytes_per_param).items():
        resident = sum(b for r, b in roles.items() if r not in offloaded)
        peaks[d] = resident + max((b for r, b in roles.items() if r in offloaded), default=0)
    return peaks


def _check_memory(plan: ExecutionPlan, workflow: Workflow, configs: Mapping[str, object], bytes_per_param: int) -> None:
    if isinstance(bytes_per_param, bool) or not isinstance(bytes_per_param, int) or bytes_per_param < 1:
        raise ConfigError(f"bytes_per_param: {bytes_per_param!r} is not a positive integer (e.g. 2 for bf16, 4 for fp32)")
    peaks = peak_memory(plan, workflow, configs, bytes_per_param)
    available = plan.cluster.memory_gb * GB
    device, need = max(peaks.items(), key=lambda item: (item[1], -item[0]))
    if need <= available:
        return
    offloaded = set(plan.offloaded_roles(workflow))
    roles = role_memory(plan, workflow, configs, bytes_per_param)[device]
    parts = ", ".join(f"{r} {b / GB:.1f}" + (" offloaded" if r in offloaded else "") for r, b in roles.items())
    raise ConfigError(f"plan: device {device} needs an estimated {need / GB:.1f} GB ({parts}; MFCs "
                      f"{', '.join(plan.mfcs_on(device))}) but has {plan.cluster.memory_gb:.1f} GB "
                      f"({plan.cluster.profile}); spread the roles over more devices or raise tp/pp")
