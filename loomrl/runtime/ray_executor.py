"""The Ray executor: a controller that moves metadata, and one worker per device that moves bytes.

The controller runs the plan's schedule (:mod:`loomrl.plan.schedule`), the same steps the simulator prices: it
sends a step to every device the step names once the steps it waits for are done (or together with the one
:meth:`~loomrl.plan.schedule.Step.sent_with` allows), and each worker runs its steps in the order they
arrive. For a call it splits the batch's sample ids over the data-parallel ranks of the call's layout (balanced
by tokens; for train calls by the same per-step schedule as the reference executor) and tells every worker which
rows to process and where their inputs are (Ray object references to other workers' output shards); it gets back
only metadata: references to the new shards, per-sample token counts, scalar statistics and each device's start
and end. Every value a worker returns is checked: a tensor arriving at the controller is an error.

:meth:`RayExecutor.apply_plan` switches to another plan between iterations (:mod:`loomrl.runtime.plan_change`).
Failures surface within ``runtime.timeout_s`` as one line naming the worker, its role and the step; ``close``
kills every worker and the local Ray instance, also after a failure or an interrupt.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from loomrl.config import RuntimeConfig
from loomrl.errors import LoomError
from loomrl.launch import ray_address, start_ray, stop_ray
from loomrl.models.tokenizer import task_tokenizer
from loomrl.models.zoo import parameter_shapes
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.realloc_plan import plan_reallocation
from loomrl.plan.schedule import Step, StepKind, build_schedule
from loomrl.planner.corrections import Corrections
from loomrl.planner.cost import CostModel
from loomrl.planner.settings import RUNTIME
from loomrl.planner.fused import best_migrate_at
from loomrl.planner.fused_train import fused_train_orders
from loomrl.planner.planning import model_config
from loomrl.planner.profiles import load_profile, profile_for
from loomrl.planner.workload import ModelShape, Workload
from loomrl.engine.devices import resolve_dtype
from loomrl.runtime.fused_stage import FusedStage, is_stream
from loomrl.runtime.plan_change import plan_moves
from loomrl.runtime.reference import IterationResult, StepTrace, merge_stats
from loomrl.runtime.spec import CallData, FusedTrainData, WorkerPlan, WorkerSpec
from loomrl.runtime.worker import DeviceWorker
from loomrl.workflow import MFCKind, Workflow
from loomrl.workflow.batch import Batch
from loomrl.workflow.minibatches import split_by_tokens, train_schedule


AUTO_START = 0.2
"""``migrate_at: auto`` before any response length is known (RLHFuse's choice at scale)."""
LENGTH_WINDOW = 2
"""Iterations of observed response lengths the runtime's decisions are priced for."""


@dataclass
class _IterationState:
    iteration: int
    ids: list[int]
    where: dict[str, list[tuple[tuple[int, ...], Any]]]
    """Key → output shards holding it: (sample ids, object reference)."""
    tokens: dict[int, int]
    """Sample id → tokens that weight its work (prompt length, then response length once generated)."""
    max_budget: int = 0
    """The batch's largest per-sample token budget (its ``max_new_tokens`` column; 0 without one)."""


class RuntimeFailure(LoomError):
    """A worker failed, died or stalled; the message names the worker, role and step."""


def check_metadata(value: Any, path: str = "result") -> None:
    """The controller accepts scalars, strings, object references and containers of them: never tensors."""
    if isinstance(value, (int, float, str, bool, type(None), ray.ObjectRef)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_metadata(item, f"{path}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_metadata(item, f"{path}[{i}]")
        return
    raise RuntimeError(f"the controller received {type(value).__name__} at {path}; only metadata may reach it")


class RayExecutor:
    """Executes a workflow's schedule under ``plan`` on one Ray worker per device of the plan's cluster (same
    interface as the reference executor)."""

    def __init__(self, runtime: RuntimeConfig, spec: WorkerSpec, workflow: Workflow, plan: ExecutionPlan):
        self.runtime, self.spec, self.workflow = runtime, spec, workflow
        self.cluster = plan.cluster
        self._tokenizer = task_tokenizer(spec.task, spec.tokenizer)
        self._shapes: dict[str, tuple] = {}
        self.plan, self.worker_plan = plan, self.plan_for_workers(plan)
        self.workers: list[Any] = []
        self.pg = None
        self.received = 0
        self.lengths: list[list[int]] = []
        """Response lengths of the last iterations (at most :data:`LENGTH_WINDOW`): the workload the runtime's
        own decisions are priced for, following the run's drift."""
        self._cost_inputs = None
        self._fused_orders: dict[str, dict[int, tuple]] = {}
        """A ``fused_train`` step's id → each device's order of the plan's fused pipeline schedule."""
        self.traces: list[StepTrace] = []
        """Steps run outside an iteration (the prologue, evaluations, plan changes) since :meth:`drain_traces`."""
        self.waited_s = 0.0
        """Time spent waiting for workers; the rest of an iteration is the controller's own work."""
        n = self.cluster.n_devices
        gpu = self.cluster.device_kind != "cpu"
        self.address = ray_address(runtime.ray_address)
        self._started = start_ray(self.address, num_cpus=n + 1, dashboard=runtime.ray_dashboard)
        try:
            self._spawn(n, gpu)
            self.traces += self.run_steps(self.schedule.prologue, 0, "prologue")[0]
        except BaseException:
            self.close()
            raise

    @property
    def schedule(self):
        return self.worker_plan.schedule

    def plan_for_workers(self, plan: ExecutionPlan) -> WorkerPlan:
        """``plan``'s schedule with the transfer plan of each of its reallocations (planned here, once, from the
        roles' parameter shapes; the cluster's nodes decide the senders)."""
        schedule = build_schedule(self.workflow, plan)
        return WorkerPlan(schedule, {t: self._transfer_plan(*t, False) for t in schedule.transfers()})

    def param_shapes(self, role: str) -> tuple[dict[str, tuple[int, ...]], int]:
        """Full parameter shapes and layer count of a role's model, from its config alone (no weights)."""
        if role not in self._shapes:
            spec = self.spec.roles[role]
            self._shapes[role] = parameter_shapes(spec.model, self._tokenizer, value=spec.value_head)
        return self._shapes[role]

    def _spawn(self, n: int, gpu: bool) -> None:
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.runtime.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeFailure(f"runtime.devices: {n} devices could not be reserved within "
                                 f"{self.runtime.timeout_s:g} s; Ray has {ray.cluster_resources()}") from None
        remote = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0)(DeviceWorker)
        self.workers = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))
            .remote(i, n, self.spec) for i in range(n)]
        addr = "127.0.0.1" if self.address is None else self._wait(
            [self.workers[0].node_ip.remote()], "setup", None)[0]
        port = self._wait([self.workers[0].free_port.remote()], "setup", None)[0]
        metas = self._wait([w.setup.remote(addr, port, self.worker_plan) for w in self.workers], "setup", None)
        self.pids = [m["pid"] for m in metas]

    # ---------------------------------------------------------------------------------- waiting
    def _wait_one(self, pending: dict, deadline: float) -> tuple[Any, Any]:
        """The next finished call among ``pending`` (ref → (what, role, rank)) and its checked value; a failure,
        death or stall becomes a one-line RuntimeFailure naming the worker, role and step."""
        t0 = time.perf_counter()
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        self.waited_s += time.perf_counter() - t0
        if not ready:
            what, role, _ = next(iter(pending.values()))
            stuck = sorted({rank for _, _, rank in pending.values()})
            raise RuntimeFailure(f"worker(s) {stuck} did not finish {what} (role {role}) within "
                                 f"{self.runtime.timeout_s:g} s (runtime.timeout_s)")
        ref = ready[0]
        what, role, rank = pending.pop(ref)
        try:
            value = ray.get(next(ref)) if is_stream(ref) else ray.get(ref)
        except ray.exceptions.RayActorError:
            raise RuntimeFailure(f"worker {rank} died during {what} (role {role})") from None
        except ray.exceptions.RayTaskError as err:
            # A peer that died makes the survivors' collectives fail too: name the dead worker, the root cause.
            self._raise_if_a_peer_died(pending)
            cause = str(err.cause if getattr(err, "cause", None) else err).strip().splitlines()
            named = next((line for line in cause if " failed in " in line and line.startswith("worker ")), None)
            if named is not None:  # the worker's own one-line account
                raise RuntimeFailure(named) from None
            first = cause[-1] if cause else type(err).__name__
            raise RuntimeFailure(f"worker {rank} failed during {what} (role {role}): {first}") from None
        check_metadata(value)
        self.received += 1
        return ref, value

    def _raise_if_a_peer_died(self, pending: dict, grace_s: float = 5.0) -> None:
        """Give the other calls in flight a moment to report; raise for the first worker found dead."""
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                what, role, rank = pending[ref]
                raise RuntimeFailure(f"worker {rank} died during {what} (role {role})") from None
            except ray.exceptions.RayTaskError:
                continue

    def _wait(self, refs: list, what: str, role: str | None, ranks: Sequence[int] | None = None) -> list:
        """Results of ``refs`` (one per rank), in order."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = {ref: (what, role, rank) for ref, rank in zip(refs, ranks)}
        deadline = time.monotonic() + self.runtime.timeout_s
        results = {}
        while pending:
            ref, value = self._wait_one(pending, deadline)
            results[ref] = value
        return [results[r] for r in refs]

    # ----------------------------------------------------------------------------------------- steps
    def run_steps(self, steps: Sequence[Step], iteration: int, phase: str, state: _IterationState | None = None,
                  result: IterationResult | None = None, data: Mapping[str, dict] | None = None
                  ) -> tuple[list[StepTrace], dict[str, dict[int, dict]]]:
        """Run ``steps`` (one list of the schedule) to the end: each is sent to its devices once the steps it
        waits for are done, or with the one it is sent with; a fused stage runs as its members' data arrives
        (:class:`~loomrl.runtime.fused_stage.FusedStage`). Call steps take their rows from ``state`` and report
        into ``result``; ``data`` gives other steps' per-device payloads. Returns the steps' traces, in the order
        they ended, and every device's reply per step."""
        by_id = {s.id: s for s in steps}
        done: set[str] = set()
        replies: dict[str, dict[int, dict]] = {}
        payloads: dict[str, dict] = {}
        pending: dict = {}
        routed: dict = {}  # ref → (step id, device), or (fused stage, its key)
        traces: list[StepTrace] = []
        deadline = time.monotonic() + self.runtime.timeout_s
        while len(done) < len(steps):
            for step in steps:
                if step.id in replies or not all(d in done or (d in replies and step.sent_with(by_id[d]))
                                                 for d in step.deps):
                    continue
                replies[step.id] = {}
                if step.kind is StepKind.FUSED:
                    migrate_at = self.migrate_at(step, state)
                    if result is not None:
                        result.stats["fusion/migrate_at"] = migrate_at
                    FusedStage(self, step, state, migrate_at).start(pending, routed)
                    continue
                if step.kind is StepKind.CALL:
                    payloads[step.id] = self.payloads(step, state)
                elif step.kind is StepKind.FUSED_TRAIN:
                    payloads[step.id] = self.fused_train_payloads(step, state)
                else:
                    payloads[step.id] = (data or {}).get(step.id, {})
                what = f"MFC '{step.id}'" if step.kind is StepKind.CALL else f"step '{step.id}'"
                for device in step.devices:
                    ref = self.workers[device].run_step.remote(step.id, payloads[step.id].get(device))
                    pending[ref] = (what, step.role, device)
                    routed[ref] = (step.id, device)
            ref, meta = self._wait_one(pending, deadline)
            owner, key = routed.pop(ref)
            if isinstance(owner, FusedStage):
                owner.on_reply(key, meta, ref, pending, routed)
                if owner.done:
                    done.add(owner.step.id)
                    traces.append(owner.trace(iteration, phase))
                continue
            step = by_id[owner]
            replies[step.id][key] = meta
            if len(replies[step.id]) == len(step.devices):
                done.add(step.id)
                traces.append(StepTrace.of(step, iteration, phase, replies[step.id]))
                if step.kind is StepKind.CALL:
                    self._finish(step, replies[step.id], payloads[step.id], state, result)
                elif step.kind is StepKind.FUSED_TRAIN:
                    for member in step.members:
                        self._finish(member, {d: meta["members"][member.id] for d, meta in replies[step.id].items()},
                                     {d: p.calls[member.id] for d, p in payloads[step.id].items()}, state, result)
        if result is not None:
            result.traces.extend(traces)
        return traces, replies

    def migrate_at(self, step: Step, state: _IterationState) -> float:
        """A fused stage's migration threshold this iteration: the plan's fraction, or for ``auto`` the one the
        cost model finds fastest for the response lengths of the last iterations (RLHFuse's 0.2 before any)."""
        value = step.fusion.migrate_at
        if not isinstance(value, str):
            return value
        if not self.lengths:
            return AUTO_START
        prompt = sum(state.tokens[s] for s in state.ids) / len(state.ids)
        workload = Workload(len(state.ids), prompt, tuple(n for past in self.lengths for n in past))
        return best_migrate_at(self.cost_model(workload), step)

    def cost_model(self, workload: Workload) -> CostModel:
        """The planner's cost model of these devices and models for ``workload`` (``runtime.cost_profile`` and
        ``runtime.cost_corrections`` where given), for the runtime's own decisions."""
        if self._cost_inputs is None:
            profile = load_profile(self.runtime.cost_profile) if self.runtime.cost_profile else profile_for(self.cluster)
            corrections = Corrections.load(self.runtime.cost_corrections) if self.runtime.cost_corrections else None
            shapes = {role: ModelShape.from_config(model_config(spec.model, self._tokenizer))
                      for role, spec in self.spec.roles.items() if spec.model is not None}
            self._cost_inputs = (profile, corrections, shapes)
        profile, corrections, shapes = self._cost_inputs
        return CostModel(self.cluster, profile, shapes, workload, corrections, settings=RUNTIME)

    def payloads(self, step: Step, state: _IterationState) -> dict[int, CallData]:
        """Per device of a call: its rows, their input shards, its optimizer steps, and whether it publishes."""
        mfc, alloc = step.mfc, step.alloc
        dp = alloc.layout.dp
        ids = state.ids
        counts = [state.tokens[s] for s in ids]
        per_dp: list[tuple[tuple[int, ...], tuple]] = []
        if mfc.kind == MFCKind.TRAIN:
            schedule = train_schedule(counts, mfc.epochs, mfc.minibatches, self.spec.seed, state.iteration, dp)
            for d in range(dp):
                rows = list(dict.fromkeys(r for s in schedule for r in s.rows_per_rank[d]))
                pos = {r: i for i, r in enumerate(rows)}
                steps = tuple((tuple(pos[r] for r in s.rows_per_rank[d]), s.local(d, counts)[1]) for s in schedule)
                per_dp.append((tuple(ids[r] for r in rows), steps))
        else:
            for part in split_by_tokens(range(len(ids)), counts, dp):
                per_dp.append((tuple(ids[r] for r in part), ()))
        out = {}
        for device in alloc.devices:
            rows, steps = per_dp[alloc.coords(device).dp]
            out[device] = CallData(state.iteration, rows, self.inputs_of(mfc.inputs, rows, state), steps,
                                   alloc.publishes(device))
        return out

    def fused_train_payloads(self, step: Step, state: _IterationState) -> dict[int, FusedTrainData]:
        """Per device of a ``fused_train`` step: each member call's payload and the device's order of the fused
        pipeline schedule (made once per plan, for the first batch it runs on: see
        :func:`loomrl.planner.fused_train.fused_train_orders`)."""
        if step.id not in self._fused_orders:
            lengths = tuple(max(1, state.tokens[s]) for s in state.ids)  # by now, the response lengths
            workload = Workload(len(state.ids), sum(lengths) / len(lengths), lengths)
            self._fused_orders[step.id] = fused_train_orders(self.cost_model(workload), step)
        orders = self._fused_orders[step.id]
        calls = {member.id: self.payloads(member, state) for member in step.members}
        return {d: FusedTrainData({m: per[d] for m, per in calls.items()}, orders[d]) for d in step.devices}

    @staticmethod
    def inputs_of(keys: Sequence[str], rows: Sequence[int], state: _IterationState) -> tuple:
        """Object references (each in a 1-tuple) of the output shards holding ``keys`` of any of ``rows``."""
        return _inputs(keys, rows, state.where)

    def _finish(self, step: Step, metas: dict[int, dict], payloads: dict[int, CallData], state: _IterationState,
                result: IterationResult) -> None:
        stats: dict[str, float] = {}
        for device, meta in sorted(metas.items()):
            if not payloads[device].publish:
                continue
            for key, value in meta.get("stats", {}).items():
                stats[key] = stats.get(key, 0.0) + value
            if "shard" in meta:
                for key in step.mfc.outputs:
                    state.where.setdefault(key, []).append((payloads[device].sample_ids, meta["shard"][0]))
            state.tokens.update({int(k): v for k, v in meta.get("tokens", {}).items()})
        merge_stats(result.stats, stats, step.id)

    # ------------------------------------------------------------------------------ iterations
    def run_iteration(self, iteration: int, batch: Batch) -> IterationResult:
        """Every step of the schedule's iteration; calls on disjoint devices run concurrently."""
        start, self.waited_s = time.perf_counter(), 0.0
        result = IterationResult()
        source = ray.put(batch)
        state = _IterationState(iteration, list(batch.ids), {k: [(tuple(batch.ids), source)] for k in batch.keys()},
                                {sid: len(p) for sid, p in zip(batch.ids, batch["prompt_ids"])},
                                max(batch["max_new_tokens"]) if "max_new_tokens" in batch else 0)
        self.run_steps(self.schedule.steps, iteration, "iteration", state, result)
        self.lengths = (self.lengths + [[state.tokens[s] for s in state.ids]])[-LENGTH_WINDOW:]
        keys = [k for k in ("prompt_ids", "response_ids", "prompt_text", "answer", "score", "kl") if k in state.where]
        metrics = self._wait([self.workers[0].metrics.remote(batch.ids, _inputs(keys, batch.ids, state.where), keys)],
                             "metrics", None)[0]
        merge_stats(result.stats, metrics, "metrics")
        result.stats["time/controller_s"] = time.perf_counter() - start - self.waited_s
        return result

    def evaluate(self, examples: Sequence, iteration: int = 0) -> dict[str, float]:
        """Greedy evaluation with the actor in its generation layout (copied there first where needed)."""
        steps = self.schedule.evaluation
        if not steps:
            return {}
        step = next(s for s in steps if s.kind is StepKind.EVALUATE)
        dp = step.alloc.layout.dp
        shares = [list(examples[d::dp]) for d in range(dp)]
        data = {step.id: {dev: (shares[step.alloc.coords(dev).dp], step.alloc.publishes(dev))
                          for dev in step.devices}}
        traces, replies = self.run_steps(steps, iteration, "evaluation", data=data)
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
            raise RuntimeFailure(f"run_dir: '{path}' is not visible to worker(s) {blind}, which run on other "
                                 "machines; put run_dir on storage every node mounts (NFS or another shared file "
                                 "system): worker 0 writes the checkpoints there and every worker reads them back")

    def save(self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int) -> Path:
        exports = {}
        for role, alloc in sorted(self.worker_plan.training().items()):
            metas = self._wait([self.workers[d].export_role.remote(role) for d in alloc.devices],
                               "checkpoint export", role, alloc.devices)
            exports[role] = [m["state"] for m in metas if "state" in m]
        ref = self.workers[0].save.remote(str(run_dir), iteration, dict(state), keep_last, exports)
        return Path(self._wait([ref], "checkpoint save", None)[0])

    def load(self, path: Path) -> dict[str, Any]:
        states = self._wait([w.load.remote(str(path)) for w in self.workers], "checkpoint load", None)
        self.traces += self.run_steps(self.schedule.prologue, 0, "prologue")[0]  # the shadows held the old weights
        return states[0]

    def apply_plan(self, plan: ExecutionPlan) -> None:
        """Continue the run under ``plan`` (on the same devices): every role's state moves to the new layouts
        (:mod:`loomrl.runtime.plan_change`), then the new schedule's prologue fills its shadows. The next
        iteration computes what it would have under the old plan."""
        if plan == self.plan:
            return
        if plan.cluster.n_devices != self.cluster.n_devices:
            raise LoomError(f"runtime.plan_changes: a plan for {plan.cluster.n_devices} devices cannot replace one "
                            f"for {self.cluster.n_devices} (the run keeps its devices)")
        new = self.plan_for_workers(plan)
        steps = {}
        for role, alloc in self.worker_plan.training().items():
            counts = self._wait([self.workers[d].steps_taken.remote(role) for d in alloc.devices], "plan change",
                                role, alloc.devices)
            steps[role] = max(counts)
        masters = resolve_dtype(self.spec.precision, torch.device(self.cluster.device_kind)) != torch.float32
        moves = plan_moves(self.worker_plan, new, self.spec.roles, masters, steps, self._transfer_plan)
        metas = self._wait([w.apply_plan.remote(new, moves) for w in self.workers], "plan change", None)
        self.plan, self.worker_plan = plan, new
        self._fused_orders.clear()
        self.traces.append(StepTrace(0, "plan change", "plan change", None, None, tuple(range(len(metas))),
                                     tuple(m["start"] for m in metas), tuple(m["end"] for m in metas), "plan change"))
        self.traces += self.run_steps(self.schedule.prologue, 0, "prologue")[0]

    def _transfer_plan(self, role: str, src, dst, state: bool):
        shapes, layers = self.param_shapes(role)
        return plan_reallocation(shapes, layers, src, dst, self.cluster.node_of, state)

    def drain_traces(self) -> list[StepTrace]:
        """The traces of steps run outside iterations since the last call (the caller stamps their iteration)."""
        traces, self.traces = self.traces, []
        return traces

    def close(self) -> None:
        """Kill every worker and release the devices; stop Ray if this executor started it."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead: nothing left to kill
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        stop_ray(self._started)
        self._started = False


def _inputs(keys: Sequence[str], ids: Sequence[int], where) -> tuple:
    """Object references (each in a 1-tuple) of the output shards holding ``keys`` of any of ``ids``."""
    wanted = set(ids)
    refs: list = []
    for key in keys:
        for shard_ids, ref in where[key]:
            if ref not in refs and wanted.intersection(shard_ids):
                refs.append(ref)
    return tuple(refs)
