"""loomrl.plan: execution plans as data, and the strategies that produce them.

- :class:`ClusterSpec`, :data:`PROFILES`: the devices a plan is for (``cpu:2``, ``h100:8x8``) and their hardware;
- :class:`DeviceSet`, :class:`Allocation`, :class:`ExecutionPlan`: where each MFC runs and how its model is
  sharded (one type for a mesh plus a layout, coordinates ``(pp, dp, tp)``); derived facts (canonical layouts,
  shadows, offloading, concurrent groups, memory), validation, JSON/YAML round trips;
- :class:`Schedule`, :func:`build_schedule` (:mod:`loomrl.plan.schedule`): the steps both executors run for an
  iteration under a plan: calls, reallocations with their transfers, frees, shadow syncs, reloads;
- :func:`plan_reallocation` (:mod:`loomrl.plan.realloc_plan`, :mod:`loomrl.plan.shards`): which pieces of which
  parameter move from which device to which, between two layouts (executed by
  :func:`loomrl.parallel.execute_reallocation`, priced by the cost model);
- :func:`colocate`, :func:`interleave`, :func:`separate`, :func:`parse_plan_string`, :func:`format_plan_string`,
  :func:`make_plan`: plan producers, and the one entry point ``loomrl train --plan`` calls.

Nothing here imports Ray or torch.distributed: a plan is data that the runtime and the simulator both read.
"""

from loomrl.plan.allocation import Allocation, DeviceSet, format_devices
from loomrl.plan.cluster import DEVICE_KINDS, ClusterSpec
from loomrl.plan.hardware import GB, PROFILES
from loomrl.plan.memory import shard_bytes
from loomrl.plan.model_shape import param_count
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.plan_string import compute_allocation, format_plan_string, parse_plan_string
from loomrl.plan.realloc_plan import ReallocPlan, Transfer, plan_reallocation
from loomrl.plan.shards import shard_intervals, shard_shape
from loomrl.plan.strategies import (
    STRATEGIES,
    colocate,
    interleave,
    make_plan,
    separate,
    split_devices,
    split_devices_pow2,
)

__all__ = [
    "DEVICE_KINDS",
    "GB",
    "PROFILES",
    "STRATEGIES",
    "Allocation",
    "ClusterSpec",
    "DeviceSet",
    "ExecutionPlan",
    "ReallocPlan",
    "Transfer",
    "colocate",
    "compute_allocation",
    "format_devices",
    "format_plan_string",
    "interleave",
    "make_plan",
    "param_count",
    "parse_plan_string",
    "plan_reallocation",
    "shard_intervals",
    "shard_shape",
    "separate",
    "shard_bytes",
    "split_devices",
    "split_devices_pow2",
]
