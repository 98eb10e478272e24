"""The Ray executor: controllers that move metadata, and one worker per device that moves bytes.

The executor starts one worker per device (:class:`~loomrl.runtime.worker.DeviceWorker`) and runs each iteration
through its controllers (:mod:`loomrl.runtime.controller`): one in this process by default, or
``runtime.controllers: K`` Ray actors each driving a shard of the prompts through the replicas it owns
(:mod:`loomrl.runtime.controllers`). A controller runs the plan's schedule, the same steps the simulator prices,
and receives only metadata from the workers (references to output shards, token counts, scalar statistics, each
device's start and end); a tensor arriving at a controller is an error.

Between iterations the executor itself drives the workers: the prologue that fills shadow copies, evaluation,
checkpoints and :meth:`RayExecutor.apply_plan` (:mod:`loomrl.runtime.plan_change`). Failures surface within
``runtime.timeout_s`` as one line naming the worker, its role and the step (and the controller, with several);
``close`` kills every controller and worker and the local Ray instance, also after a failure or an interrupt.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from loomrl.checkpoint.store import read_pending, state_json_of
from loomrl.config.schema import RuntimeConfig
from loomrl.errors import LoomError
from loomrl.models.tokenizer import task_tokenizer
from loomrl.models.zoo import parameter_shapes
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.realloc_plan import plan_reallocation
from loomrl.plan.schedule import StepKind, build_schedule
from loomrl.planner.inputs import PlannerInputs
from loomrl.role.devices import resolve_dtype
from loomrl.runtime.ahead import IN_FLIGHT, VERSIONS, generated_ahead
from loomrl.runtime.controller import (
    Controller,
    RuntimeFailure,
    ShardInput,
    ShardOutput,
    check_metadata,
    is_metric_key,
    shard_refs,
)
from loomrl.runtime.controllers import (
    plan_for_controllers,
    shard_batch,
    shard_input,
    spawn_controllers,
    wait_controllers,
)
from loomrl.runtime.executor import GENERATED_AHEAD, Executor, IterationResult, StepTrace, merge_stats
from loomrl.runtime.launch import ray_address, start_ray, stop_ray
from loomrl.runtime.plan_change import plan_moves
from loomrl.runtime.spec import WorkerPlan, WorkerSpec
from loomrl.runtime.worker import DeviceWorker
from loomrl.workflow import Workflow
from loomrl.workflow.batch import Batch, response_tokens

if TYPE_CHECKING:
    from loomrl.algorithms.dynamic_sampling import Waves

__all__ = ["RayExecutor", "RuntimeFailure", "check_metadata"]


class RayExecutor(Executor):
    """Executes a workflow's schedule under ``plan`` on one Ray worker per device of the plan's cluster (the
    :class:`~loomrl.runtime.executor.Executor` the reference executor also is)."""

    def __init__(
        self,
        runtime: RuntimeConfig,
        spec: WorkerSpec,
        workflow: Workflow,
        plan: ExecutionPlan,
        inputs: PlannerInputs,
        group_size: int = 1,
        worker_cls: type = DeviceWorker,
    ):
        self.runtime, self.spec, self.workflow = runtime, spec, workflow
        self.inputs = inputs
        """The run's planner inputs, which the controllers price their own decisions with (stream fusion's
        ``migrate_at: auto``, pipeline fusion's task orders)."""
        self.worker_cls = worker_cls
        """The class of the per-device actors (a light stand-in in the control-path benchmark)."""
        self.group_size = group_size
        """Consecutive rows of a batch that form one group (GRPO's samples of a prompt): never split between
        controllers."""
        self.cluster = plan.cluster
        self._tokenizer = task_tokenizer(spec.task, spec.tokenizer)
        self._shapes: dict[str, tuple] = {}
        self.plan = plan
        self.worker_plan, self.owned = self.plan_for_workers(plan)
        self.workers: list[Any] = []
        self.controllers: list[Any] = []
        """The parallel controllers (Ray actors), with ``runtime.controllers`` > 1."""
        self.coordinator = None
        self.pg = None
        self.traces: list[StepTrace] = []
        """Steps run outside an iteration (the prologue, evaluations, plan changes) since :meth:`drain_traces`."""
        n = self.cluster.n_devices
        gpu = self.cluster.device_kind != "cpu"
        self.address = ray_address(runtime.ray_address)
        self._started = start_ray(self.address, num_cpus=n + 1, dashboard=runtime.ray_dashboard)
        try:
            self._spawn(n, gpu)
            self.traces += self.control.run_steps(self.schedule.prologue, 0, "prologue")[0]
        except BaseException:
            self.close()
            raise

    @property
    def schedule(self):
        return self.worker_plan.schedule

    @property
    def received(self) -> int:
        """Worker replies every controller has checked."""
        extra = sum(ray.get([c.received.remote() for c in self.controllers])) if self.controllers else 0
        return self.control.received + extra

    def plan_for_workers(self, plan: ExecutionPlan) -> tuple[WorkerPlan, list[tuple[int, ...]]]:
        """``plan``'s schedule, as the run's controllers run it (:func:`~loomrl.runtime.controllers.
        plan_for_controllers`), with the transfer plan of each of its reallocations (planned here, once, from the
        roles' parameter shapes; the cluster's nodes decide the senders); and each controller's devices."""
        plan, owned = plan_for_controllers(plan, self.workflow, self.runtime.controllers)
        schedule = build_schedule(self.workflow, plan)
        return WorkerPlan(schedule, {t: self._transfer_plan(*t, False) for t in schedule.transfers()}), owned

    def param_shapes(self, role: str) -> tuple[dict[str, tuple[int, ...]], int, bool]:
        """Full shapes of the parameters a role's model moves (all, or its LoRA adapters), its layer count and
        whether its head shares its input embedding, from its config alone (no weights)."""
        if role not in self._shapes:
            spec = self.spec.roles[role]
            self._shapes[role] = parameter_shapes(spec.model, self._tokenizer, value=spec.value_head, lora=spec.lora)
        return self._shapes[role]

    def _spawn(self, n: int, gpu: bool) -> None:
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.runtime.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeFailure(
                f"runtime.devices: {n} devices could not be reserved within "
                f"{self.runtime.timeout_s:g} s; Ray has {ray.cluster_resources()}"
            ) from None
        remote = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0)(self.worker_cls)
        self.workers = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            ).remote(i, n, self.spec)
            for i in range(n)
        ]
        self.control = Controller(self.workers, self.runtime, self.spec, self.cluster, self.worker_plan, self.inputs)
        """The controller of the steps between iterations (and of every iteration, with one controller)."""
        addr = "127.0.0.1" if self.address is None else self._wait([self.workers[0].node_ip.remote()], "setup", None)[0]
        port = self._wait([self.workers[0].free_port.remote()], "setup", None)[0]
        metas = self._wait([w.setup.remote(addr, port, self.worker_plan) for w in self.workers], "setup", None)
        self.pids = [m["pid"] for m in metas]
        self.nodes = [m["node"] for m in metas]
        """The Ray node of each device's worker."""
        if self.runtime.controllers > 1:
            self.coordinator, self.controllers = spawn_controllers(
                self.workers,
                self.nodes,
                self.runtime,
                self.spec,
                self.cluster,
                self.worker_plan,
                self.inputs,
                self.owned,
            )

    def _wait(self, refs: list, what: str, role: str | None, ranks: Sequence[int] | None = None) -> list:
        """Results of ``refs`` (one per rank), in order; failures as one line naming the worker."""
        return self.control.wait(refs, what, role, ranks)

    def run_steps(self, steps, iteration: int, phase: str, data: Mapping[str, dict] | None = None):
        """Run ``steps`` between iterations (this process's controller owns every device)."""
        return self.control.run_steps(steps, iteration, phase, data=data)

    # ------------------------------------------------------------------------------ iterations
    def generate_ahead(self, iteration: int, batch: Batch, version: int) -> None:
        """Asynchronous plans: generate ``batch`` (the prompts of ``iteration``) now with the current weights,
        policy ``version``, and keep it, each controller its shard (the pipeline's fill; traced as a prologue)."""
        budget = _budget(batch)
        if self.controllers:
            shards = shard_batch(batch, len(self.controllers), self.group_size)
            refs = [
                c.generate_ahead.remote(iteration, shard_input(shard, budget), version)
                for c, shard in zip(self.controllers, shards)
            ]
            self.traces += [t for traces in wait_controllers(refs, f"generation ahead for {iteration}") for t in traces]
        else:
            self.traces += self.control.generate_ahead(iteration, shard_input(batch, budget), version)

    def run_iteration(
        self, iteration: int, batch: Batch, waves: Waves | None = None, ahead: tuple[int, Batch] | None = None
    ) -> IterationResult:
        """Every step of the schedule's iteration, through the run's controllers; calls on disjoint devices run
        concurrently. With ``waves`` (dynamic sampling, one controller), ``batch`` is the first wave
        (:meth:`Controller.run_waves <loomrl.runtime.controller.Controller.run_waves>`). The statistics add
        ``time/controller_s`` (the busiest controller's own wall-clock time: the iteration less its waits) and
        ``time/controller_cpu_s`` (the busiest controller's process CPU time)."""
        if waves is not None:
            if self.controllers:
                raise RuntimeError("dynamic sampling runs with one controller")
            output = self.control.run_iteration(iteration, shard_input(batch, _budget(batch)), _ShardWaves(waves))
            return self._result(iteration, [output], waves.kept(), waves.stats())
        max_budget = _budget(batch)
        if self.controllers:
            shards = shard_batch(batch, len(self.controllers), self.group_size)
            later: list[tuple[int, ShardInput] | None] = [None] * len(shards)
            if ahead is not None:
                budget = _budget(ahead[1])
                later = [
                    (ahead[0], shard_input(s, budget)) for s in shard_batch(ahead[1], len(shards), self.group_size)
                ]
            refs = [
                c.run_iteration.remote(iteration, shard_input(shard, max_budget), later[i])
                for i, (c, shard) in enumerate(zip(self.controllers, shards))
            ]
            outputs = wait_controllers(refs, f"iteration {iteration}")
        else:
            next_in = None if ahead is None else (ahead[0], shard_input(ahead[1], _budget(ahead[1])))
            outputs = [self.control.run_iteration(iteration, shard_input(batch, max_budget), ahead=next_in)]
        return self._result(iteration, outputs, batch.ids)

    def _result(
        self,
        iteration: int,
        outputs: Sequence[ShardOutput],
        ids: Sequence[int],
        stats: Mapping[str, float] | None = None,
    ) -> IterationResult:
        """The iteration's result from the controllers' outputs, with the rollout metrics of samples ``ids``."""
        result = _merged(outputs, iteration)
        if stats:
            merge_stats(result.stats, stats, "dynamic sampling")
        result.response_lengths = [n for out in outputs for n in out.lengths]  # the controllers' shards in order
        where: dict[str, list] = {}
        for out in outputs:
            for key, shards in out.where.items():
                where.setdefault(key, []).extend(shards)
        keys = [k for k in where if is_metric_key(k)]
        metrics = self._wait(
            [self.workers[0].metrics.remote(list(ids), shard_refs(keys, ids, where), keys)], "metrics", None
        )[0]
        merge_stats(result.stats, metrics, "metrics")
        result.stats["time/controller_s"] = max(out.own_s for out in outputs)
        result.stats["time/controller_cpu_s"] = max(out.cpu_s for out in outputs)
        return result

    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Greedy evaluation with the actor in its generation layout (copied there first where needed)."""
        steps = self.schedule.evaluation
        if not steps:
            return {}
        step = next(s for s in steps if s.kind is StepKind.EVALUATE)
        dp = step.alloc.layout.dp
        shares = [list(examples[d::dp]) for d in range(dp)]
        data = {step.id: {dev: (shares[step.alloc.coords(dev).dp], step.alloc.publishes(dev)) for dev in step.devices}}
        traces, replies = self.run_steps(steps, 0, "evaluation", data=data)  # the trainer stamps the iteration
        self.traces += traces
        sums: dict[str, float] = {}
        for meta in replies[step.id].values():
            for name, value in meta.get("sums", {}).items():
                sums[name] = sums.get(name, 0.0) + value
        return {name: value / len(examples) for name, value in sums.items()}

    # ---------------------------------------------------------------- checkpoints, plan changes, shutdown
    def check_shared_dir(self, path: Path) -> None:
        """Every worker must see ``path`` (the run directory: worker 0 writes the checkpoints into it and every
        worker reads them back on resume), so on a cluster of several machines it must be storage each one
        mounts; a marker file the controller writes there is looked for by every worker."""
        marker = Path(path) / f".visible-{os.getpid()}"
        marker.write_text("")
        try:
            seen = self._wait([w.sees.remote(str(marker)) for w in self.workers], "storage check", None)
        finally:
            marker.unlink(missing_ok=True)
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        if blind:
            raise RuntimeFailure(
                f"run_dir: '{path}' is not visible to worker(s) {blind}, which run on other "
                "machines; put run_dir on storage every node mounts (NFS or another shared file "
                "system): worker 0 writes the checkpoints there and every worker reads them back"
            )

    def save(
        self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int, sharded: bool = True
    ) -> Path:
        """Checkpoint the trained roles. ``sharded``: every worker writes the pieces it owns and worker 0 completes
        the save (:mod:`loomrl.checkpoint.shards`); otherwise the roles are gathered whole onto worker 0 first."""
        if sharded:
            return self._save_sharded(run_dir, iteration, state, keep_last)
        exports = {}
        for role, alloc in sorted(self.worker_plan.training().items()):
            metas = self._wait(
                [self.workers[d].export_role.remote(role) for d in alloc.devices],
                "checkpoint export",
                role,
                alloc.devices,
            )
            exports[role] = [m["state"] for m in metas if "state" in m]
        ref = self.workers[0].save.remote(str(run_dir), iteration, dict(state), keep_last, exports, self._pending())
        return Path(self._wait([ref], "checkpoint save", None)[0])

    def _save_sharded(self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int) -> Path:
        state_json = state_json_of(state, iteration, keep_last)  # fails before any worker writes
        self._wait([w.check_shards.remote() for w in self.workers], "checkpoint save", None)
        tmp = self._wait([self.workers[0].begin_save.remote(str(run_dir), iteration)], "checkpoint save", None)[0]
        parts: dict[str, list] = {}
        for written in self._wait([w.save_shards.remote(tmp) for w in self.workers], "checkpoint save", None):
            for role, part in written.items():
                parts.setdefault(role, []).append(part)
        ref = self.workers[0].finish_save.remote(tmp, iteration, state_json, keep_last, parts, self._pending())
        return Path(self._wait([ref], "checkpoint save", None)[0])

    def _pending(self) -> dict | None:
        """An asynchronous run's batches generated ahead, from every controller, as the checkpoint's writer takes
        them (:func:`~loomrl.runtime.worker.gather_pending`); None for a synchronous run."""
        if not self.schedule.ahead:
            return None
        parts = ray.get([c.pending_entries.remote() for c in self.controllers]) if self.controllers else []
        merged: dict[Any, tuple] = {}
        for k, entries in enumerate(parts or [self.control.pending_entries()]):
            for it, entry in entries.items():
                if it == IN_FLIGHT:  # each controller's paused samples, with its index
                    merged.setdefault(IN_FLIGHT, []).append((k, entry))
                    continue
                ids, refs, keys, versions = entry
                had = merged.get(it, ([], (), keys, []))
                merged[it] = (had[0] + ids, had[1] + tuple(refs), keys, had[3] + versions)
        return merged

    def load(self, path: Path) -> dict[str, Any]:
        """Every worker loads its part of the checkpoint; the new prologue refills the shadows from it; an
        asynchronous run's batches generated ahead go back to the controllers that will train them."""
        states = self._wait([w.load.remote(str(path)) for w in self.workers], "checkpoint load", None)
        self.traces += self.run_steps(self.schedule.prologue, 0, "prologue")[0]  # the shadows held the old weights
        pending = read_pending(path) if self.schedule.ahead else None
        if pending is not None:
            self._restore_pending(pending)
        return {**states[0], GENERATED_AHEAD: generated_ahead(pending)}

    def _restore_pending(self, pending: Mapping[Any, tuple]) -> None:
        """Each batch generated ahead into the object store, split over the controllers as its iteration's prompts
        will be (:func:`~loomrl.runtime.controllers.shard_batch`); a partial rollout's paused samples back to the
        one controller (:data:`~loomrl.runtime.ahead.IN_FLIGHT`)."""
        count = max(1, len(self.controllers))
        per: list[dict] = [{} for _ in range(count)]
        for it, entry in pending.items():
            if it == IN_FLIGHT:
                self._restore_in_flight(entry, per)
                continue
            columns, ids, version = entry
            batch = Batch(ids, columns)
            for k, shard in enumerate(shard_batch(batch, count, self.group_size)):
                tokens = {s: n for s, n in zip(shard.ids, response_tokens(shard))} if "response_ids" in shard else {}
                versions = shard[VERSIONS] if VERSIONS in shard else [(int(version),) * tokens[s] for s in shard.ids]
                keys = [k for k in shard.keys() if k != VERSIONS]
                per[k][int(it)] = (list(shard.ids), ray.put(shard), keys, tokens, [list(v) for v in versions])
        if self.controllers:
            wait_controllers([c.restore_pending.remote(e) for c, e in zip(self.controllers, per)], "checkpoint load")
        else:
            self.control.restore_pending(per[0])

    def _restore_in_flight(self, entry: tuple, per: list[dict]) -> None:
        """A checkpoint's paused samples back to the controllers that paused them (each sample's controller is
        written with it; a checkpoint of the reference executor has none, and resumes on one controller)."""
        columns, ids, resumed = entry[:3]
        owners = list(entry[3]) if len(entry) > 3 else [0] * len(ids)
        if max(owners, default=0) >= len(per) or (len(entry) <= 3 and len(per) > 1):
            raise LoomError(
                f"runtime.controllers: the checkpoint's paused samples were held by {max(owners, default=0) + 1} "
                f"controller(s); resume them with that many (valid: {max(owners, default=0) + 1})"
            )
        rows = Batch(ids, columns)
        for k in sorted(set(owners)):
            mine = rows.select([i for i, o in enumerate(owners) if o == k])
            tokens = {s: len(p) for s, p in zip(mine.ids, mine["prompt_ids"])} if "prompt_ids" in mine else {}
            held = {s: resumed[s] for s in mine.ids}
            per[k][IN_FLIGHT] = (list(mine.ids), ray.put(mine), mine.keys(), held, tokens)

    def apply_plan(self, plan: ExecutionPlan) -> None:
        """Continue the run under ``plan`` (on the same devices): every role's state moves to the new layouts
        (:mod:`loomrl.runtime.plan_change`), then the new schedule's prologue fills its shadows. The next
        iteration computes what it would have under the old plan."""
        if plan == self.plan:
            return
        if plan.cluster.n_devices != self.cluster.n_devices:
            raise LoomError(
                f"runtime.plan_changes: a plan for {plan.cluster.n_devices} devices cannot replace one "
                f"for {self.cluster.n_devices} (the run keeps its devices)"
            )
        new, owned = self.plan_for_workers(plan)
        steps = {}
        for role, alloc in self.worker_plan.training().items():
            counts = self._wait(
                [self.workers[d].steps_taken.remote(role) for d in alloc.devices], "plan change", role, alloc.devices
            )
            steps[role] = max(counts)
        masters = resolve_dtype(self.spec.precision, torch.device(self.cluster.device_kind)) != torch.float32
        moves = plan_moves(self.worker_plan, new, self.spec.roles, masters, steps, self._transfer_plan)
        metas = self._wait([w.apply_plan.remote(new, moves) for w in self.workers], "plan change", None)
        self.plan, self.worker_plan, self.owned = plan, new, owned
        self.control.install(new)
        if self.controllers:
            wait_controllers([c.install.remote(new, own) for c, own in zip(self.controllers, owned)], "plan change")
        self.traces.append(
            StepTrace(
                0,
                "plan change",
                "plan change",
                None,
                None,
                tuple(range(len(metas))),
                tuple(m["start"] for m in metas),
                tuple(m["end"] for m in metas),
                "plan change",
            )
        )
        self.traces += self.run_steps(self.schedule.prologue, 0, "prologue")[0]

    def _transfer_plan(self, role: str, src, dst, state: bool):
        shapes, layers, tied = self.param_shapes(role)
        return plan_reallocation(shapes, layers, src, dst, self.cluster.node_of, state, tied)

    def drain_traces(self) -> list[StepTrace]:
        """The traces of steps run outside iterations since the last call (the caller stamps their iteration)."""
        traces, self.traces = self.traces, []
        return traces

    def close(self) -> None:
        """Kill every controller and worker and release the devices; stop Ray if this executor started it."""
        for w in [*self.controllers, *([self.coordinator] if self.coordinator is not None else []), *self.workers]:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead: nothing left to kill
                pass
        self.workers, self.controllers, self.coordinator = [], [], None
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        stop_ray(self._started)
        self._started = False


def _budget(batch: Batch) -> int:
    """The batch's largest per-sample token budget (its ``max_new_tokens`` column; 0 without one)."""
    return max(batch["max_new_tokens"]) if "max_new_tokens" in batch else 0


class _ShardWaves:
    """A run's :class:`~loomrl.algorithms.dynamic_sampling.Waves` as the controller takes them: each next wave's
    rows put in the object store, given as a :class:`ShardInput`."""

    def __init__(self, waves: Waves):
        self.waves, self.producer, self.key = waves, waves.producer, waves.key

    def offer(self, ids: Sequence[int], scores: Sequence[float]) -> ShardInput | None:
        batch = self.waves.offer(ids, scores)
        return None if batch is None else shard_input(batch, _budget(batch))

    def kept(self) -> list[int]:
        return self.waves.kept()


def _merged(outputs: Sequence[ShardOutput], iteration: int) -> IterationResult:
    """The iteration's result from every controller's: statistics summed (each controller's are sums over its
    publishing devices), and each step's traces joined into one over all its devices."""
    result = IterationResult()
    for out in outputs:
        for key, value in out.result.stats.items():
            result.stats[key] = result.stats.get(key, 0.0) + value
    if len(outputs) == 1:
        result.traces = list(outputs[0].result.traces)
        return result
    joined: dict[str, StepTrace] = {}
    for out in outputs:
        for trace in out.result.traces:
            seen = joined.get(trace.step)
            if seen is None:
                joined[trace.step] = trace
                continue
            spans = sorted(zip(seen.devices + trace.devices, seen.start + trace.start, seen.end + trace.end))
            joined[trace.step] = dataclasses.replace(
                seen,
                devices=tuple(d for d, _, _ in spans),
                start=tuple(a for _, a, _ in spans),
                end=tuple(b for _, _, b in spans),
                parts=seen.parts + trace.parts,
            )
    result.traces = sorted(joined.values(), key=lambda t: max(t.end))
    return result
