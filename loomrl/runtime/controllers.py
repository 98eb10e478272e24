"""Parallel controllers (G-Core): K controllers, each a Ray actor driving a shard of every iteration.

With ``runtime.controllers: K`` the control path is split K ways instead of passing through one driver:

- **Who owns what.** Controller ``k`` owns the ``k``-th block of every call's data-parallel ranks (``dp / K``
  consecutive ranks: K must divide each call's dp) and so the devices those ranks run on
  (:func:`controller_devices`); a device must belong to the same controller in every call it serves, or the plan
  gets a one-line error naming the device, the two calls and the two controllers. Each controller sends the
  schedule's steps (calls, reallocations, syncs) only to its own devices; a collective over devices of several
  controllers meets on the workers, each controller having sent its part, and every device receives its steps
  in the schedule's order (:meth:`~loomrl.runtime.controller.Controller.run_steps`).
- **Who drives which samples.** The driver splits the prompts into K contiguous shards of whole groups (a GRPO
  group never spans two controllers) and hands each controller its shard as an object reference with its ids
  and prompt lengths; the controller never reads the rows. Its generation, inference and compute calls run its
  own samples on its own replicas.
- **What is global.** Through a :class:`Coordinator` (an asynchronous Ray actor: ``exchange`` returns every
  controller's value once all have given theirs) the controllers exchange, once an iteration before the first
  train call, their samples' token counts: a train call's optimizer steps are the reference's minibatches over
  the whole batch, and each controller's ranks train the rows of each minibatch in its own shard, weighted by
  their share of the minibatch's tokens. Batch statistics (advantage whitening) are summed over the shards by
  the compute call itself, which runs on one device per controller, data-parallel over them
  (:func:`plan_for_controllers`), its ranks reducing over their communicator. A fused training schedule is
  searched once, by the first controller, and shared.
- **What stays with the driver.** Everything between iterations, when no controller runs: the prologue,
  evaluation, checkpoints and plan changes (after which each controller is given its new devices), and the
  rollout metrics of the whole batch, computed on a worker from the controllers' shard references.
- **Failure.** One controller's failure stops the run, in one line naming the controller and its own account
  (the worker, role and step); where a worker's death broke a collective under another controller first, the
  controller that saw the death is named, the root cause. Closing the executor kills every controller, the
  coordinator and every worker.

Inter-stage fusion (``stream_fusion``) streams generation across all replicas and migrates its tail between them, which
would need the controllers' generation replicas to coordinate mid-call; with K > 1 it is refused in one line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import ray

from loomrl.errors import ConfigError, LoomError
from loomrl.plan.allocation import Allocation, DeviceSet
from loomrl.plan.layout import Layout
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.schedule import Schedule, build_schedule
from loomrl.planner.inputs import PlannerInputs
from loomrl.runtime.controller import Controller, RuntimeFailure, ShardInput, ShardOutput
from loomrl.workflow import MFCKind, Workflow
from loomrl.workflow.batch import Batch

__all__ = ["ControllerActor", "Coordinator", "controller_devices", "plan_for_controllers", "shard_batch"]


def controller_devices(schedule: Schedule, count: int, n_devices: int) -> list[tuple[int, ...]]:
    """The devices each of ``count`` controllers owns under ``schedule``: every model call's data-parallel ranks
    split evenly between the controllers, each rank (its tensor and pipeline devices) with one controller, and
    each device with the same controller in every call. The devices a rank spans in any call must stay together,
    so they are joined into groups first; the groups are then dealt to controllers in device order by a
    depth-first search that keeps every call's share at ``dp / count`` ranks, a new controller opened only after
    the previous ones (so controller ``k``'s first device precedes controller ``k + 1``'s). A colocated plan comes
    out as contiguous blocks; one whose calls sit on different devices, interleaved. One-line errors where
    ``count`` does not divide a call's dp, or no such split exists."""
    calls = [s for s in schedule.calls() if s.mfc.kind is not MFCKind.COMPUTE]  # compute: plan_for_controllers
    parent = list(range(n_devices))

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for step in calls:
        alloc = step.alloc
        if alloc.layout.dp % count:
            raise ConfigError(
                f"runtime.controllers: {count} controllers cannot share the {alloc.layout.dp} "
                f"data-parallel replicas of {step.id} ({alloc.text}); choose a number of controllers "
                "that divides every call's dp, or a plan whose dp it divides"
            )
        for rank_devices in alloc.replicas():
            for d in rank_devices[1:]:
                parent[root(d)] = root(rank_devices[0])
    groups: dict[int, list[int]] = {}
    for d in range(n_devices):
        groups.setdefault(root(d), []).append(d)
    order = sorted(groups.values())
    # ranks[g][c]: how many data-parallel ranks of call c group g holds
    ranks = [[len({s.alloc.coords(d).dp for d in g if d in s.alloc.mesh}) for s in calls] for g in order]
    share = [s.alloc.layout.dp // count for s in calls]
    load = [[0] * len(calls) for _ in range(count)]
    owner = [-1] * len(order)

    def place(i: int, opened: int) -> bool:
        if i == len(order):
            return all(load[k] == share for k in range(count))
        for k in range(min(opened + 1, count)):
            if all(load[k][c] + ranks[i][c] <= share[c] for c in range(len(calls))):
                for c in range(len(calls)):
                    load[k][c] += ranks[i][c]
                owner[i] = k
                if place(i + 1, max(opened, k + 1)):
                    return True
                for c in range(len(calls)):
                    load[k][c] -= ranks[i][c]
        return False

    if not place(0, 0):
        raise ConfigError(
            f"runtime.controllers: this plan's devices cannot be split between {count} controllers so "
            "that each serves an equal share of every call's data-parallel replicas (a replica's "
            "devices in one call may hold several replicas of another); use fewer controllers or "
            "give the calls matching data-parallel layouts"
        )
    return [tuple(sorted(d for g, k in zip(order, owner) if k == c for d in g)) for c in range(count)]


def plan_for_controllers(
    plan: ExecutionPlan, workflow: Workflow, count: int
) -> tuple[ExecutionPlan, list[tuple[int, ...]]]:
    """``plan`` as ``count`` controllers run it, and each one's devices: every compute step (advantages) runs on
    each controller's first device, data-parallel over them, so each computes its own shard and sums batch
    statistics with the others. One controller: ``plan`` as it is, every device its own."""
    n = plan.cluster.n_devices
    if count == 1:
        return plan, [tuple(range(n))]
    if plan.stream_fusion is not None:
        raise ConfigError(
            f"runtime.controllers: {count} controllers cannot run stream fusion (the plan's stream_fusion: "
            "generation streams into inference and migrates across every replica); use one "
            "controller or a plan without stream_fusion"
        )
    devices = controller_devices(build_schedule(workflow, plan), count, n)
    firsts = [own[0] for own in devices]  # ascending: the search opens controllers in device order
    for mfc in workflow:
        if mfc.kind is MFCKind.COMPUTE:
            plan = plan.with_allocation(mfc.name, Allocation(DeviceSet(tuple(firsts)), Layout(dp=count)))
    return plan, devices


def shard_batch(batch: Batch, count: int, group_size: int) -> list[Batch]:
    """``batch`` cut into ``count`` contiguous shards of whole groups of ``group_size`` rows, the first ones one
    group larger where the groups do not divide evenly."""
    groups = len(batch) // group_size
    if groups < count:
        raise ConfigError(
            f"runtime.controllers: {count} controllers need at least {count} prompts an iteration "
            f"(rollout.prompts_per_iter gives {groups})"
        )
    sizes = [groups // count + (k < groups % count) for k in range(count)]
    shards, start = [], 0
    for size in sizes:
        rows = list(range(start * group_size, (start + size) * group_size))
        shards.append(batch.select(rows))
        start += size
    return shards


def shard_input(shard: Batch, max_budget: int) -> ShardInput:
    """What a controller is given of its shard: ids and prompt lengths, the rows behind one object reference."""
    return ShardInput(
        tuple(shard.ids), tuple(len(p) for p in shard["prompt_ids"]), (ray.put(shard),), tuple(shard.keys()), max_budget
    )


class Coordinator:
    """What the controllers agree through: :meth:`exchange` returns every controller's value for a key once all
    of them have given theirs (an all-gather of metadata; asynchronous, so the controllers wait concurrently)."""

    def __init__(self, count: int):
        self.count = count
        self.rounds: dict[Any, dict] = {}

    async def exchange(self, key: Any, index: int, value: Any) -> list:
        round_ = self.rounds.setdefault(
            key, {"values": [None] * self.count, "given": 0, "taken": 0, "all": asyncio.Event()}
        )
        round_["values"][index] = value
        round_["given"] += 1
        if round_["given"] == self.count:
            round_["all"].set()
        await round_["all"].wait()
        round_["taken"] += 1
        if round_["taken"] == self.count:
            del self.rounds[key]
        return round_["values"]

    async def cpu_s(self) -> float:
        """This process's CPU time so far (every thread, Ray's messaging included), for control-path accounting."""
        return time.process_time()


class ControllerActor:
    """One parallel controller, as a Ray actor: a :class:`~loomrl.runtime.controller.Controller` owning some
    devices, driving its shard of each iteration."""

    def __init__(
        self,
        workers: Sequence[Any],
        runtime,
        spec,
        cluster,
        plan,
        inputs: PlannerInputs,
        devices: Sequence[int],
        index: int,
        count: int,
        coordinator: Any,
    ):
        self.control = Controller(workers, runtime, spec, cluster, plan, inputs, devices, index, count, coordinator)

    def install(self, plan, devices: Sequence[int]) -> None:
        self.control.install(plan, devices)

    def run_iteration(
        self, iteration: int, shard: ShardInput, ahead: tuple[int, ShardInput] | None = None
    ) -> ShardOutput:
        return self.control.run_iteration(iteration, shard, ahead=ahead)

    def generate_ahead(self, iteration: int, shard: ShardInput, version: int) -> list:
        return self.control.generate_ahead(iteration, shard, version)

    def pending_entries(self) -> dict:
        return self.control.pending_entries()

    def restore_pending(self, entries: dict) -> None:
        self.control.restore_pending(entries)

    def received(self) -> int:
        return self.control.received

    def pid(self) -> int:
        import os

        return os.getpid()

    def node(self) -> str:
        """The Ray node this controller runs on."""
        return ray.get_runtime_context().get_node_id()


def wait_controllers(refs: Sequence[Any], what: str, grace_s: float = 5.0) -> list[ShardOutput]:
    """Every controller's result, in order; the first failure (a controller's own account of a worker's failure,
    or the controller's death) stops the wait as one line naming the controller.

    A worker's death breaks the collectives of its peers under other controllers too, and one of those may
    report first (a reset connection). A failure that is not a death waits up to ``grace_s`` for the others:
    a controller reporting a death (its own or a worker's) is the root cause and is named instead."""
    index = {ref: k for k, ref in enumerate(refs)}
    pending, results = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        k = index[ready[0]]
        try:
            results[k] = ray.get(ready[0])
            continue
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
            failure = _controller_failure(k, err, what)
        if not failure.recoverable and pending:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
            for ref in done:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                    other = _controller_failure(index[ref], err, what)
                    if other.recoverable:
                        raise other from None
        raise failure from None
    return [results[k] for k in range(len(refs))]


def _controller_failure(k: int, err: Exception, what: str) -> RuntimeFailure:
    """The one-line failure of controller ``k``: its death, or its own account of what failed (recoverable when
    that account is, as a worker's death is)."""
    if isinstance(err, ray.exceptions.RayActorError):
        return RuntimeFailure(f"controller {k} died during {what}", recoverable=True)
    cause = err.cause if getattr(err, "cause", None) is not None else err
    lines = str(cause).strip().splitlines()
    return RuntimeFailure(
        f"controller {k} failed during {what}: {lines[0] if lines else type(cause).__name__}",
        recoverable=isinstance(cause, LoomError) and cause.recoverable,
    )


def spawn_controllers(
    workers: Sequence[Any],
    node_of_worker: Sequence[str],
    runtime,
    spec,
    cluster,
    plan,
    inputs: PlannerInputs,
    devices: list[tuple[int, ...]],
) -> tuple[Any, list[Any]]:
    """The coordinator and one controller actor per entry of ``devices``, each on the node of its first device
    (where its messages to its workers are local)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    count = len(devices)
    coordinator = ray.remote(num_cpus=0, max_restarts=0)(Coordinator).remote(count)
    remote = ray.remote(num_cpus=0, max_restarts=0)(ControllerActor)
    controllers = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_of_worker[own[0]], soft=False)).remote(
            workers, runtime, spec, cluster, plan, inputs, own, k, count, coordinator
        )
        for k, own in enumerate(devices)
    ]
    wait_controllers([c.pid.remote() for c in controllers], "setup")
    return coordinator, controllers
