"""Placement strategies: functions that produce an :class:`~loomrl.plan.plan.ExecutionPlan` for a workflow.

- :func:`colocate` (ReaLHF's baseline): every model call on every device, time-shared; a role's layout may
  differ per call (e.g. generation with more DP than training), which costs a reallocation around the call.
- :func:`interleave` (adaptive placement): calls at the same depth of the graph, hence with no dependency path
  between them, get disjoint meshes so they can run side by side: for PPO the ref, reward and critic
  inference, then the actor and critic training. Devices are split in proportion to each call's model size
  (see :func:`split_devices`); generation keeps all devices.
- :func:`separate`: the generate calls on their own devices (the first ``gen_devices``) with a shadow actor
  synced after each actor train step; everything else colocated on the rest.
- a plan string (:mod:`loomrl.plan.plan_string`) for hand-written plans, e.g. on 8 devices::

      actor_gen=0-3:dp4; ref_inf=4-5:dp2; reward_inf=6-7:dp2; critic_inf=4-7:dp4; actor_train=0-7:dp4tp2;
      critic_train=0-7:dp8

  (``a-b`` ranges or ``0,2,5`` lists; layout tokens ``dpN tpN ppN mbN``; unnamed compute steps on device 0).

:func:`make_plan` turns the text of ``loomrl train --plan`` into a plan: a strategy name, ``separate:N``, a
plan string, or the path of a ``.json``/``.yaml`` plan file. Compute steps (advantages) always run on
one device (device 0, or the first non-generation device for :func:`separate`): they need the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loomrl.config.tools import FieldError
from loomrl.errors import ConfigError
from loomrl.plan.allocation import Allocation, DeviceSet
from loomrl.plan.cluster import ClusterSpec
from loomrl.plan.layout import Layout
from loomrl.plan.model_shape import param_count
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.plan_string import compute_allocation, parse_plan_string, with_choices
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = ["STRATEGIES", "colocate", "interleave", "make_plan", "separate", "split_devices"]

STRATEGIES = ("colocate", "interleave", "separate", "separate:N")
"""Strategy names :func:`make_plan` accepts (besides plan strings and plan files)."""


def _span(first: int, count: int) -> Allocation:
    """``count`` consecutive devices from ``first``, pure data parallel."""
    return Allocation(DeviceSet(tuple(range(first, first + count))), Layout(dp=count))


def colocate(workflow: Workflow, cluster: ClusterSpec, layouts: Mapping[str, Layout] | None = None) -> ExecutionPlan:
    """Every model call on all devices; ``layouts`` maps a role or an MFC name (which wins) to its layout,
    default ``dp = devices``. Compute steps run on device 0."""
    layouts = dict(layouts or {})
    valid = [*workflow.roles(), *(m.name for m in workflow.topological_order())]
    for key in layouts:
        if key not in valid:
            raise ConfigError(f"colocate: layouts.{key}: not a role or MFC of the workflow; valid: {', '.join(valid)}")
    n = cluster.n_devices
    everything = DeviceSet(tuple(range(n)))
    allocations: dict[str, Allocation] = {}
    for mfc in workflow.topological_order():
        if mfc.kind is MFCKind.COMPUTE:
            allocations[mfc.name] = compute_allocation()
            continue
        key = mfc.name if mfc.name in layouts else mfc.model_role
        try:
            allocations[mfc.name] = Allocation(everything, layouts.get(key, Layout(dp=n)))
        except FieldError as err:
            raise ConfigError(f"colocate: layouts.{key}: {err.reason}") from None
    return ExecutionPlan(cluster, allocations)


def split_devices(n: int, weights: Sequence[float]) -> list[int]:
    """Device counts summing to ``n``, one per weight, each at least 1, proportional to the weights.

    Largest remainder: each gets ``max(1, floor(n·w/W))``; devices left over go one by one to the largest
    shortfall ``n·w/W − count`` (ties: the earlier weight); if the minimum of one overshoots, devices are
    taken back from the largest surplus with more than one device.
    """
    if not weights or len(weights) > n:
        raise ConfigError(f"split_devices: cannot give {len(weights)} calls at least one of {n} devices each")
    total = sum(weights)
    quotas = [n * w / total if total > 0 else n / len(weights) for w in weights]
    counts = [max(1, int(q)) for q in quotas]
    while sum(counts) < n:
        counts[max(range(len(counts)), key=lambda i: (quotas[i] - counts[i], -i))] += 1
    while sum(counts) > n:
        counts[max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: (counts[i] - quotas[i], -i))] -= 1
    return counts


def split_devices_pow2(n: int, weights: Sequence[float]) -> list[int]:
    """Like :func:`split_devices` for a power-of-two ``n``, but every count a power of two, so each range can
    be sharded (tp and pp are powers of two in practice) and stays aligned: each gets the largest power of two
    up to its quota (at least 1); while the counts overshoot, the largest is halved; while they fall short,
    the count furthest below its quota (relative) among those that fit the remainder is doubled — the
    smallest always fits, as the remainder is a multiple of it."""
    if n & (n - 1):
        raise ConfigError(f"split_devices_pow2: n={n} is not a power of two")
    if not weights or len(weights) > n:
        raise ConfigError(f"split_devices_pow2: cannot give {len(weights)} calls at least one of {n} devices each")
    total = sum(weights)
    quotas = [n * w / total if total > 0 else n / len(weights) for w in weights]
    counts = [1 << (max(1, int(q)).bit_length() - 1) for q in quotas]
    while sum(counts) > n:
        i = max(range(len(counts)), key=lambda k: (counts[k], k))
        counts[i] //= 2
    while sum(counts) < n:
        left = n - sum(counts)
        i = max((k for k in range(len(counts)) if counts[k] <= left), key=lambda k: (quotas[k] / counts[k], -k))
        counts[i] *= 2
    return counts


def _levels(workflow: Workflow) -> list[list[MFC]]:
    """MFCs grouped by depth (longest dependency path from a source); one level's MFCs are independent."""
    depth: dict[str, int] = {}
    for mfc in workflow.topological_order():
        depth[mfc.name] = 1 + max((depth[d] for d in workflow.deps(mfc.name)), default=-1)
    levels: list[list[MFC]] = [[] for _ in range(max(depth.values()) + 1)]
    for mfc in workflow.topological_order():
        levels[depth[mfc.name]].append(mfc)
    return levels


INTERLEAVE_SPLITS = ("auto", "pow2", "proportional")
"""How :func:`interleave` splits a level's devices: power-of-two ranges (``pow2``: shardable), ranges
proportional to model size (``proportional``: balanced), or ``auto``: pow2 on a power-of-two cluster."""


def interleave(
    workflow: Workflow, cluster: ClusterSpec, model_configs: Mapping[str, object] | None = None, split: str = "auto"
) -> ExecutionPlan:
    """Independent calls side by side on disjoint meshes; generation on all devices; compute on device 0.

    The rule: MFCs at the same depth of the graph have no dependency path between them. At each depth the
    inference and train calls split the devices into consecutive ranges with :func:`split_devices_pow2` (on a
    power-of-two cluster: every range a power of two, so it can be sharded) or :func:`split_devices`, weighted
    by their role's parameter count (from ``model_configs``; equal weights without them), pure data parallel
    on each range (``split``: see :data:`INTERLEAVE_SPLITS`). A depth with more such calls than devices, or
    with a single one, is colocated instead.
    """
    if split not in INTERLEAVE_SPLITS:
        raise ConfigError(f"interleave: split={split!r}; valid: {', '.join(INTERLEAVE_SPLITS)}")
    n = cluster.n_devices
    pow2 = split == "pow2" or (split == "auto" and n & (n - 1) == 0)
    if pow2 and n & (n - 1):
        raise ConfigError(f"interleave: split='pow2' needs a power-of-two cluster; {cluster} has {n} devices")
    placed: dict[str, Allocation] = {}
    for level in _levels(workflow):
        models = [m for m in level if m.kind in (MFCKind.INFERENCE, MFCKind.TRAIN)]
        for mfc in level:
            if mfc.kind is MFCKind.COMPUTE:
                placed[mfc.name] = compute_allocation()
            elif mfc.kind is MFCKind.GENERATE or not 1 < len(models) <= n:
                placed[mfc.name] = _span(0, n)
        if 1 < len(models) <= n:
            weights = [
                param_count(model_configs[m.model_role])
                if model_configs and model_configs.get(m.model_role) is not None
                else 1.0
                for m in models
            ]  # a role with no model (a rule reward) weighs least
            first = 0
            counts = (split_devices_pow2 if pow2 else split_devices)(n, weights)
            for mfc, count in zip(models, counts):
                placed[mfc.name] = _span(first, count)
                first += count
    allocations = {m.name: placed[m.name] for m in workflow.topological_order()}
    return ExecutionPlan(cluster, allocations)


def separate(workflow: Workflow, cluster: ClusterSpec, gen_devices: int | None = None) -> ExecutionPlan:
    """Generate calls on devices ``0 .. gen_devices-1`` (default half the cluster), every other call colocated
    on the rest. The actor's generation is then off its training devices, so the plan's default rule gives it
    a shadow copy, synced after each actor train step. Compute steps run on the first non-generation device."""
    n = cluster.n_devices
    gen = n // 2 if gen_devices is None else gen_devices
    if isinstance(gen, bool) or not isinstance(gen, int) or not 1 <= gen < n:
        valid = f"1-{n - 1}" if n > 1 else "none: a separated plan needs at least 2 devices"
        raise ConfigError(
            f"separate: gen_devices={gen!r} on cluster {cluster} ({n} device{'s' * (n != 1)}); valid: {valid}"
        )
    allocations: dict[str, Allocation] = {}
    for mfc in workflow.topological_order():
        if mfc.kind is MFCKind.GENERATE:
            allocations[mfc.name] = _span(0, gen)
        elif mfc.kind is MFCKind.COMPUTE:
            allocations[mfc.name] = _span(gen, 1)
        else:
            allocations[mfc.name] = _span(gen, n - gen)
    return ExecutionPlan(cluster, allocations)


_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def _choices() -> str:
    return f"{', '.join(STRATEGIES)}, a plan string (e.g. 'actor_gen=0-3:dp4; ...') or a .json/.yaml plan file"


def _strategy(
    spec: str,
    workflow: Workflow,
    cluster: ClusterSpec,
    layouts: Mapping[str, Layout] | None,
    model_configs: Mapping[str, object] | None,
    gen_devices: int | None,
) -> ExecutionPlan:
    name, _, arg = spec.partition(":")
    for given, option, used_by in ((layouts, "layouts", "colocate"), (gen_devices, "gen_devices", "separate")):
        if given is not None and name != used_by:
            raise ConfigError(f"plan {spec!r}: {option} applies only to the {used_by} strategy")
    if name == "separate":
        if arg and not arg.isdigit():
            raise ConfigError(f"plan {spec!r}: '{arg}' is not a number of generation devices (e.g. separate:2)")
        return separate(workflow, cluster, int(arg) if arg else gen_devices)
    if arg:
        raise ConfigError(f"plan {spec!r}: only separate takes an argument; valid: {_choices()}")
    if name == "colocate":
        return colocate(workflow, cluster, layouts)
    return interleave(workflow, cluster, model_configs)


def _from_file(spec: str, cluster: ClusterSpec) -> ExecutionPlan:
    plan = ExecutionPlan.load(spec)
    if plan.cluster != cluster:
        ours, theirs = plan.cluster, cluster
        raise ConfigError(
            f"{spec}: the plan is for cluster {ours} ({ours.profile}, {ours.memory_gb} GB per device) "
            f"but the run's cluster is {theirs} ({theirs.profile}, {theirs.memory_gb} GB per device)"
        )
    return plan


def make_plan(
    spec: str,
    workflow: Workflow,
    cluster: ClusterSpec,
    *,
    layouts: Mapping[str, Layout] | None = None,
    model_configs: Mapping[str, object] | None = None,
    gen_devices: int | None = None,
) -> ExecutionPlan:
    """The validated plan ``spec`` names (what ``loomrl train --plan FILE|STRATEGY`` passes).

    ``spec``: ``colocate`` | ``interleave`` | ``separate`` | ``separate:N`` | a plan string (it contains
    ``=``) | a path ending in .json, .yaml or .yml. ``layouts`` go to colocate, ``gen_devices`` to separate,
    ``model_configs`` weigh interleave's split and enable the divisibility and memory checks.
    """
    text = str(spec).strip()
    strategy, _, extras = text.partition(";")
    if "=" not in strategy and extras.strip():  # a strategy followed by shadow / offload / fusion items
        plan = with_choices(
            make_plan(
                strategy, workflow, cluster, layouts=layouts, model_configs=model_configs, gen_devices=gen_devices
            ),
            extras,
            workflow,
        )
        plan.validate(workflow, model_configs)
        return plan
    if ("=" in text or text.lower().endswith(_FILE_SUFFIXES)) and (layouts is not None or gen_devices is not None):
        raise ConfigError(f"plan {text!r}: layouts and gen_devices apply only to the colocate and separate strategies")
    if "=" in text:
        plan = parse_plan_string(text, workflow, cluster)
    elif text.lower().endswith(_FILE_SUFFIXES):
        plan = _from_file(text, cluster)
    elif text.partition(":")[0] in ("colocate", "interleave", "separate"):
        plan = _strategy(text, workflow, cluster, layouts, model_configs, gen_devices)
    else:
        raise ConfigError(f"plan {text!r}: unknown strategy; valid: {_choices()}")
    plan.validate(workflow, model_configs)
    return plan
