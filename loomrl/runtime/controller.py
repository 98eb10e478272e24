"""A controller: the control path of one shard of an iteration, moving metadata while the workers move bytes.

A :class:`Controller` runs the plan's schedule (:mod:`loomrl.plan.schedule`), the same steps the simulator
prices, on the devices it owns: it sends a step to each of them once the steps it waits for are done (or
together with the one :meth:`~loomrl.plan.schedule.Step.sent_with` allows), and each worker runs its steps in
the order they arrive. For a call it splits its shard's sample ids over the data-parallel ranks it owns
(balanced by tokens; for train calls by the same per-step schedule as the reference executor, over the whole
batch) and tells every worker which rows to process and where their inputs are (Ray object references to other
workers' output shards); it gets back only metadata: references to the new shards, per-sample token counts,
scalar statistics and each device's start and end. Every value a worker returns is checked: a tensor arriving
at a controller is an error.

With one controller (``runtime.controllers: 1``) it owns every device and the whole batch and runs in the
driver (:class:`~loomrl.runtime.ray_executor.RayExecutor`). With K of them (:mod:`loomrl.runtime.controllers`)
each is a Ray actor owning a shard of the prompts and the replicas that serve it; what must be global they
agree on through a coordinator: the whole batch's token counts before the first train call (its optimizer steps
are the reference's minibatches over every shard), and a fused training schedule.

Failures surface within ``runtime.timeout_s`` as one line naming the worker, its role and the step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from loomrl.algorithms.context import PartialRollout, Resumed
from loomrl.config.schema import RuntimeConfig, judge_index
from loomrl.errors import LoomError
from loomrl.plan.allocation import Allocation
from loomrl.plan.cluster import ClusterSpec
from loomrl.plan.schedule import Step, StepKind, split_for_sampling
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.pipeline_fusion import pipeline_fusion_orders
from loomrl.planner.cost.stream_fusion import best_migrate_at
from loomrl.planner.cost.workload import Workload
from loomrl.planner.inputs import PlannerInputs
from loomrl.runtime.ahead import IN_FLIGHT, InFlight, Pending, Shards, split_call
from loomrl.runtime.executor import IterationResult, StepTrace, merge_stats, staleness_stats, version_summary
from loomrl.runtime.spec import CallData, PipelineFusionData, WorkerPlan, WorkerSpec
from loomrl.runtime.stream_fusion import StreamFusionStage, is_stream, take_shard
from loomrl.workflow import MFCKind
from loomrl.workflow.minibatches import loss_weights, minibatch_rows, split_by_tokens

AUTO_START = 0.2
"""``migrate_at: auto`` before any response length is known (RLHFuse's choice at scale)."""
LENGTH_WINDOW = 2
"""Iterations of observed response lengths the runtime's decisions are priced for."""
METRIC_KEYS = (
    "prompt_ids",
    "response_ids",
    "prompt_text",
    "answer",
    "row",
    "score",
    "rule_scores",
    "episode_metrics",
    "kl",
    "overlong_penalty",
)
"""The columns the rollout metrics read (:func:`loomrl.algorithms.metrics.rollout_metrics`), besides each judge's
``judge<i>_unreadable`` (:func:`is_metric_key`)."""


def is_metric_key(key: str) -> bool:
    """Whether the rollout metrics read column ``key``."""
    return key in METRIC_KEYS or (judge_index(key) is not None and key.endswith("_unreadable"))


class RuntimeFailure(LoomError):
    """A worker failed, died or stalled; the message names the worker, role and step. ``recoverable``: a process
    was lost (died or stalled), which new workers resuming from a checkpoint may get past; an error raised by
    the step itself would recur."""

    def __init__(self, message: str, recoverable: bool = False):
        super().__init__(message)
        self.recoverable = recoverable


def check_metadata(value: Any, path: str = "result", references: bool = True) -> None:
    """A controller accepts scalars, strings, object references and containers of them: never tensors. A
    streamed item (``references=False``) holds no object reference (:data:`~loomrl.runtime.spec.SHARD_FOLLOWS`)."""
    if isinstance(value, (int, float, str, bool, type(None))) or (references and isinstance(value, ray.ObjectRef)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_metadata(item, f"{path}.{key}", references)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_metadata(item, f"{path}[{i}]", references)
        return
    where = "" if references else " of a stream (Ray may free it before use: yield the object as the next item)"
    raise RuntimeError(f"the controller received {type(value).__name__} at {path}{where}; only metadata may reach it")


@dataclass(frozen=True)
class ShardInput:
    """One controller's share of an iteration's prompts, as metadata: the rows stay in the object store."""

    ids: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    """Per sample of ``ids``: its prompt's length (what weighs its work until it has a response)."""
    source: tuple[Any, ...]
    """The shard's batch, as an object reference in a 1-tuple (so Ray passes the reference, not the rows)."""
    keys: tuple[str, ...]
    """The batch's columns."""
    max_budget: int = 0
    """The batch's largest per-sample token budget (its ``max_new_tokens`` column; 0 without one)."""


@dataclass
class ShardOutput:
    """What a controller reports of its shard's iteration: metadata only."""

    result: IterationResult
    where: Shards
    """The output shards of the metric columns (:data:`METRIC_KEYS`) of this controller's rows."""
    lengths: list[int]
    """Response length of each of its samples."""
    own_s: float = 0.0
    """Wall-clock seconds of its own work (the iteration less the time spent waiting for workers)."""
    cpu_s: float = 0.0
    """CPU seconds its process used during the iteration (every thread: Ray's messaging too)."""


@dataclass
class _IterationState:
    iteration: int
    ids: list[int]
    where: Shards
    tokens: dict[int, int]
    """Sample id → tokens that weight its work (prompt length, then response length once generated)."""
    max_budget: int = 0
    """The batch's largest per-sample token budget (its ``max_new_tokens`` column; 0 without one)."""
    whole: tuple[list[int], int] | None = field(default=None, repr=False)
    """The whole batch's token counts and this shard's offset in it, once the controllers have exchanged them."""
    partial: PartialRollout | None = None
    """A batch generated ahead under partial rollouts: the generate call's setting, with every paused sample it
    continues (:mod:`loomrl.runtime.ahead`)."""


class Controller:
    """The control path of one shard of every iteration: controller ``index`` of ``count``, dispatching to the
    devices it owns (every device with one controller) through the workers' Ray handles."""

    def __init__(
        self,
        workers: Sequence[Any],
        runtime: RuntimeConfig,
        spec: WorkerSpec,
        cluster: ClusterSpec,
        plan: WorkerPlan,
        inputs: PlannerInputs,
        devices: Sequence[int] | None = None,
        index: int = 0,
        count: int = 1,
        coordinator: Any = None,
    ):
        self.workers, self.runtime, self.spec, self.cluster = list(workers), runtime, spec, cluster
        self.inputs = inputs
        """The run's planner inputs: what the runtime's own decisions are priced with."""
        self.index, self.count, self.coordinator = index, count, coordinator
        self.received = 0
        self.waited_s = 0.0
        """Time spent waiting for workers; the rest of an iteration is the controller's own work."""
        self.pending: dict[int, Pending] = {}
        """Asynchronous plans: iteration → the batch generated ahead for it."""
        self.in_flight: InFlight | None = None
        """Partial rollouts: the samples paused, to continue in the next rollout generate call."""
        self.lengths: list[list[int]] = []
        """Response lengths of the last iterations (at most :data:`LENGTH_WINDOW`): the workload the runtime's
        own decisions are priced for, following the run's drift."""
        self.install(plan, devices)

    def install(self, plan: WorkerPlan, devices: Sequence[int] | None = None) -> None:
        """Run ``plan`` from now on, owning ``devices`` (all of them by default)."""
        self.worker_plan = plan
        self.devices = frozenset(range(len(self.workers)) if devices is None else devices)
        self._fused_orders: dict[str, dict[int, tuple]] = {}
        """A ``fused_train`` step's id → each device's order of the plan's fused pipeline schedule."""

    @property
    def schedule(self):
        return self.worker_plan.schedule

    # ---------------------------------------------------------------------------------- waiting
    def _wait_ready(self, pending: dict, deadline: float) -> list[tuple[Any, Any]]:
        """Every finished call among ``pending`` (ref → (what, role, rank)), at least one, with its checked value
        (one wait for the first, one more that does not block for the others that are done: a controller with
        many workers does not wait once per reply); a failure, death or stall becomes a one-line RuntimeFailure
        naming the worker, role and step."""
        t0 = time.perf_counter()
        refs = list(pending)
        ready, rest = ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        self.waited_s += time.perf_counter() - t0
        if not ready:
            what, role, _ = next(iter(pending.values()))
            stuck = sorted({rank for _, _, rank in pending.values()})
            raise RuntimeFailure(
                f"worker(s) {stuck} did not finish {_step(what, role)} within "
                f"{self.runtime.timeout_s:g} s (runtime.timeout_s)",
                recoverable=True,
            )
        return [(ref, self._value(ref, pending)) for ref in ready]

    def _value(self, ref: Any, pending: dict) -> Any:
        what, role, rank = pending.pop(ref)
        streamed = is_stream(ref)
        try:
            value = ray.get(next(ref)) if streamed else ray.get(ref)
        except ray.exceptions.RayActorError:
            raise RuntimeFailure(f"worker {rank} died during {_step(what, role)}", recoverable=True) from None
        except ray.exceptions.RayTaskError as err:
            # A peer that died makes the survivors' collectives fail too: name the dead worker, the root cause.
            self._raise_if_a_peer_died(pending)
            cause = str(err.cause if getattr(err, "cause", None) else err).strip().splitlines()
            named = next((line for line in cause if " failed in " in line and line.startswith("worker ")), None)
            if named is not None:  # the worker's own one-line account
                raise RuntimeFailure(named) from None
            first = cause[-1] if cause else type(err).__name__
            raise RuntimeFailure(f"worker {rank} failed during {_step(what, role)}: {first}") from None
        check_metadata(value, references=not streamed)
        self.received += 1
        return take_shard(ref, value) if streamed else value

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
                raise RuntimeFailure(f"worker {rank} died during {_step(what, role)}", recoverable=True) from None
            except ray.exceptions.RayTaskError:
                continue

    def wait(self, refs: list, what: str, role: str | None, ranks: Sequence[int] | None = None) -> list:
        """Results of ``refs`` (one per rank), in order."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = {ref: (what, role, rank) for ref, rank in zip(refs, ranks)}
        deadline = time.monotonic() + self.runtime.timeout_s
        results = {}
        while pending:
            results.update(self._wait_ready(pending, deadline))
        return [results[r] for r in refs]

    def exchange(self, key: tuple, value: Any) -> list:
        """Every controller's ``value`` for ``key``, in controller order (through the coordinator; with one
        controller, just this one's)."""
        if self.count == 1:
            return [value]
        t0 = time.perf_counter()
        try:
            return ray.get(self.coordinator.exchange.remote(key, self.index, value), timeout=self.runtime.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeFailure(
                f"controller {self.index} waited over {self.runtime.timeout_s:g} s "
                f"(runtime.timeout_s) for the other controllers at {key[-1]}",
                recoverable=True,
            ) from None
        finally:
            self.waited_s += time.perf_counter() - t0

    # ----------------------------------------------------------------------------------------- steps
    def run_steps(
        self,
        steps: Sequence[Step],
        iteration: int,
        phase: str,
        state: _IterationState | None = None,
        result: IterationResult | None = None,
        data: Mapping[str, dict] | None = None,
        states: Mapping[str, _IterationState | None] | None = None,
    ) -> tuple[list[StepTrace], dict[str, dict[int, dict]]]:
        """Run ``steps`` (one list of the schedule) to the end on this controller's devices: each is sent to them
        once the steps it waits for are done here, or with the one it is sent with; a fused stage runs as its
        members' data arrives (:class:`~loomrl.runtime.stream_fusion.StreamFusionStage`). Call steps take their rows
        from
        ``state`` and report into ``result``; ``data`` gives other steps' per-device payloads. Returns the steps'
        traces, in the order they ended, and every device's reply per step. ``states`` gives call steps that run
        on another batch than ``state`` theirs (an asynchronous plan's generation ahead), or None to skip them.

        With several controllers, each device gets its steps in the schedule's order (a step waits until the
        earlier ones on its devices were sent): two controllers then never send collectives to the devices
        they share in opposite orders."""
        by_id = {s.id: s for s in steps}
        mine = {s.id: tuple(d for d in s.devices if d in self.devices) for s in steps}
        queues = {d: [s.id for s in steps if d in mine[s.id]] for d in self.devices} if self.count > 1 else {}
        done: set[str] = set()
        replies: dict[str, dict[int, dict]] = {}
        payloads: dict[str, dict] = {}
        pending: dict = {}
        routed: dict = {}  # ref → (step id, device), or (fused stage, its key)
        state_of: dict[str, _IterationState | None] = {}  # a call's batch, where it is not ``state``
        traces: list[StepTrace] = []
        deadline = time.monotonic() + self.runtime.timeout_s
        while len(done) < len(steps):
            for step in steps:
                if step.id in replies or not all(
                    d in done or (d in replies and step.sent_with(by_id[d])) for d in step.deps
                ):
                    continue
                if queues and any(queues[d][0] != step.id for d in mine[step.id]):
                    continue
                for d in mine[step.id] if queues else ():
                    queues[d].pop(0)
                replies[step.id] = {}
                if states is not None and step.id in states:
                    state_of[step.id] = states[step.id]
                if not mine[step.id] or (step.id in state_of and state_of[step.id] is None):  # not here, or skipped
                    done.add(step.id)
                    continue
                if step.kind is StepKind.STREAM_FUSION:
                    migrate_at = self.migrate_at(step, state)
                    if result is not None:
                        result.stats["fusion/migrate_at"] = migrate_at
                    StreamFusionStage(self, step, state, migrate_at).start(pending, routed)
                    continue
                payloads[step.id] = self._payloads_of(step, state_of.get(step.id, state), data)
                what = f"MFC '{step.id}'" if step.kind is StepKind.CALL else f"step '{step.id}'"
                for device in mine[step.id]:
                    ref = self.workers[device].run_step.remote(step.id, payloads[step.id].get(device))
                    pending[ref] = (what, step.role, device)
                    routed[ref] = (step.id, device)
            if len(done) == len(steps):
                break
            for ref, meta in self._wait_ready(pending, deadline):
                owner, key = routed.pop(ref)
                if isinstance(owner, StreamFusionStage):
                    owner.on_reply(key, meta, ref, pending, routed)
                    if owner.done:
                        done.add(owner.step.id)
                        traces.append(owner.trace(iteration, phase))
                    continue
                step = by_id[owner]
                replies[step.id][key] = meta
                if len(replies[step.id]) == len(mine[step.id]):
                    done.add(step.id)
                    traces.append(StepTrace.of(step, iteration, phase, replies[step.id]))
                    self._finish_step(step, replies[step.id], payloads[step.id], state_of.get(step.id, state), result)
        if result is not None:
            result.traces.extend(traces)
        return traces, replies

    def _payloads_of(self, step: Step, state: _IterationState | None, data: Mapping[str, dict] | None) -> dict:
        """A step's per-device payloads: a call's rows of ``state``, a fused train stage's members', or what
        ``data`` gives any other step."""
        if step.kind is StepKind.CALL:
            return self.payloads(step, state)
        if step.kind is StepKind.PIPELINE_FUSION:
            return self.pipeline_fusion_payloads(step, state)
        return (data or {}).get(step.id, {})

    def _finish_step(
        self, step: Step, metas: dict[int, dict], payloads: dict, state: _IterationState, result: IterationResult
    ) -> None:
        """A finished call's (or each member's of a fused train stage) replies into ``state`` and ``result``."""
        if step.kind is StepKind.CALL:
            self._finish(step, metas, payloads, state, result)
        elif step.kind is StepKind.PIPELINE_FUSION:
            for member in step.members:
                member_metas = {d: m["members"][member.id] for d, m in metas.items()}
                self._finish(member, member_metas, {d: p.calls[member.id] for d, p in payloads.items()}, state, result)

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
        """The run's cost model for ``workload`` (its planner inputs: ``runtime.cost_profile`` and
        ``runtime.cost_corrections`` where given), for the runtime's own decisions."""
        return self.inputs.cost_model(workload)

    def _my_ranks(self, alloc: Allocation) -> list[int]:
        """The data-parallel ranks of ``alloc`` this controller serves, in order."""
        return sorted({alloc.coords(d).dp for d in alloc.devices if d in self.devices})

    def payloads(self, step: Step, state: _IterationState) -> dict[int, CallData]:
        """Per device of a call that this controller owns: its rows, their input shards, its optimizer steps, and
        whether it publishes. A train call's optimizer steps are the reference's minibatches over the whole batch
        (:func:`~loomrl.workflow.minibatches.minibatch_rows`); this controller's ranks train the rows of each that
        are in its shard, split by tokens, each rank's loss weighted by its share of the minibatch's loss weight
        (tokens, or rows: :func:`~loomrl.workflow.minibatches.loss_weights`), so the ranks' gradients still sum to
        the reference's. With one controller that is the whole minibatch."""
        mfc, alloc = step.mfc, step.alloc
        ranks = self._my_ranks(alloc)
        per_dp: dict[int, tuple[tuple[int, ...], tuple]] = {}
        if mfc.kind == MFCKind.TRAIN:
            counts, offset = self.batch_tokens(state)
            weights = loss_weights(counts, mfc.loss_unit)
            mine = range(offset, offset + len(state.ids))
            local = [[] for _ in ranks]
            for _, rows in minibatch_rows(len(counts), mfc.epochs, mfc.minibatches, self.spec.seed, state.iteration):
                total = max(sum(weights[r] for r in rows), 1)
                for held, part in zip(local, split_by_tokens([r for r in rows if r in mine], counts, len(ranks))):
                    held.append((part, sum(weights[r] for r in part) / total))
            for d, steps_of in zip(ranks, local):
                rows = list(dict.fromkeys(r for part, _ in steps_of for r in part))
                pos = {r: i for i, r in enumerate(rows)}
                steps = tuple((tuple(pos[r] for r in part), weight) for part, weight in steps_of)
                per_dp[d] = (tuple(state.ids[r - offset] for r in rows), steps)
            where = state.where
        else:
            ids, where = state.ids, state.where
            counts = [state.tokens[s] for s in ids]
            for d, part in zip(ranks, split_by_tokens(range(len(ids)), counts, len(ranks))):
                per_dp[d] = (tuple(ids[r] for r in part), ())
        out = {}
        for device in alloc.devices:
            if device in self.devices:
                rows, steps = per_dp[alloc.coords(device).dp]
                out[device] = CallData(
                    state.iteration,
                    rows,
                    shard_refs(mfc.inputs, rows, where),
                    steps,
                    alloc.publishes(device),
                    _partial_of(state.partial, rows) if step.id in self.schedule.ahead else None,
                )
        return out

    def batch_tokens(self, state: _IterationState) -> tuple[list[int], int]:
        """Every sample's token count over the whole batch (in batch order) and where this controller's shard
        starts in it: this controller's own with one controller; with several, every controller's, exchanged once
        an iteration before training (the barrier each controller reaches once its shard is ready to train). Only
        counts are exchanged: each minibatch is the reference's, and each controller's ranks train the rows of it
        that are in its own shard, weighted by their share of the minibatch's tokens (:meth:`payloads`), so no
        controller needs another's output shards."""
        if state.whole is None:
            parts = self.exchange((state.iteration, "training"), [state.tokens[s] for s in state.ids])
            state.whole = ([n for part in parts for n in part], sum(len(part) for part in parts[: self.index]))
        return state.whole

    def pipeline_fusion_payloads(self, step: Step, state: _IterationState) -> dict[int, PipelineFusionData]:
        """Per device of a ``fused_train`` step: each member call's payload and the device's order of the fused
        pipeline schedule (made once per plan, for the first batch it runs on, by the first controller: see
        :func:`loomrl.planner.cost.pipeline_fusion.pipeline_fusion_orders`; its search is time-bounded, so the others
        take
        its result rather than their own)."""
        if step.id not in self._fused_orders:
            orders = None
            counts = self.batch_tokens(state)[0]  # every controller: the exchange is collective
            if self.index == 0:
                lengths = tuple(max(1, n) for n in counts)  # by now, the response lengths
                workload = Workload(len(lengths), sum(lengths) / len(lengths), lengths)
                orders = pipeline_fusion_orders(self.cost_model(workload), step)
            self._fused_orders[step.id] = self.exchange((state.iteration, f"orders of {step.id}"), orders)[0]
        orders = self._fused_orders[step.id]
        calls = {member.id: self.payloads(member, state) for member in step.members}
        return {
            d: PipelineFusionData({m: per[d] for m, per in calls.items()}, orders[d])
            for d in step.devices
            if d in self.devices
        }

    def inputs_of(self, keys: Sequence[str], rows: Sequence[int], state: _IterationState) -> tuple:
        """Object references (each in a 1-tuple) of the output shards holding ``keys`` of any of ``rows``."""
        return shard_refs(keys, rows, state.where)

    def _finish(
        self,
        step: Step,
        metas: dict[int, dict],
        payloads: dict[int, CallData],
        state: _IterationState,
        result: IterationResult,
    ) -> None:
        stats: dict[str, float] = {}
        for device, meta in sorted(metas.items()):
            if not payloads[device].publish:
                continue
            for key, value in meta.get("stats", {}).items():
                stats[key] = stats.get(key, 0.0) + value
            if "shard" in meta:
                rows = tuple(meta["rows"]) if "rows" in meta else payloads[device].sample_ids  # partial: finished
                for key in step.mfc.outputs:
                    state.where.setdefault(key, []).append((rows, meta["shard"][0]))
            state.tokens.update({int(k): v for k, v in meta.get("tokens", {}).items()})
        merge_stats(result.stats, stats, step.id)

    # ------------------------------------------------------------------------------ iterations
    def generate_ahead(self, iteration: int, shard: ShardInput, version: int) -> list[StepTrace]:
        """An asynchronous plan's pipeline fill: this controller's shard of ``iteration``'s prompts generated now
        (the schedule's ``fill``) with the current weights, policy ``version``, and kept for that iteration."""
        state = _state_of(iteration, shard)
        traces = self.run_steps(self.schedule.fill, iteration, "prologue", state, IterationResult())[0]
        self._keep_ahead(state, version)
        return traces

    def pending_entries(self) -> dict[Any, tuple]:
        """The batches generated ahead, as a checkpoint takes them: iteration → (sample ids, references of the
        output shards holding them, their columns, each sample's token versions); under partial rollouts the
        paused samples under :data:`~loomrl.runtime.ahead.IN_FLIGHT` (sample ids, references of their input
        shards, those columns, what each generated as plain data)."""
        out: dict[Any, tuple] = {}
        for iteration, kept in sorted(self.pending.items()):
            ids = sorted({s for shards in kept.where.values() for ids, _ in shards for s in ids})
            versions = [list(kept.versions[s]) for s in ids]
            out[iteration] = (ids, shard_refs(list(kept.where), ids, kept.where), list(kept.where), versions)
        if self.in_flight is not None:
            flight = self.in_flight
            ids, keys = flight.ids, list(flight.where)
            resumed = {s: r.plain() for s, r in flight.resumed.items()}
            out[IN_FLIGHT] = (ids, shard_refs(keys, ids, flight.where), keys, resumed, dict(flight.tokens))
        return out

    def restore_pending(self, entries: Mapping[Any, tuple]) -> None:
        """Batches generated ahead, from a checkpoint: iteration → (sample ids, a reference of the shard holding
        them, its columns, each sample's token count, each sample's token versions); the paused samples under
        :data:`~loomrl.runtime.ahead.IN_FLIGHT` (sample ids, a reference of their input shard, its columns,
        what each generated, their prompt lengths)."""
        entries = dict(entries)
        flight = entries.pop(IN_FLIGHT, None)
        self.pending = {
            it: Pending({k: [(tuple(ids), ref)] for k in keys}, dict(tokens), dict(zip(ids, map(tuple, versions))))
            for it, (ids, ref, keys, tokens, versions) in entries.items()
        }
        self.in_flight = None
        if flight is not None:
            ids, ref, keys, resumed, tokens = flight
            where = {k: [(tuple(ids), ref)] for k in keys}
            self.in_flight = InFlight(where, dict(tokens), {s: Resumed.of_plain(r) for s, r in resumed.items()})

    def _keep_ahead(self, state: _IterationState, version: int, metas: Mapping[int, dict] | None = None) -> None:
        """Keep what generation made of ``state`` (policy ``version``): the whole batch, or under partial rollouts
        (``metas``: the generate call's replies) each finished row for its iteration and the paused ones."""
        keys = self.schedule.ahead_keys()
        if state.partial is None:
            where = {k: v for k, v in state.where.items() if k in keys}
            versions = {s: (version,) * state.tokens[s] for s in state.ids}
            self.pending[state.iteration] = Pending(where, dict(state.tokens), versions)
            return
        (step,) = [s for s in self.schedule.steps if s.id in self.schedule.ahead]
        owner = {
            s: state.partial.resumed[s].iteration if s in state.partial.resumed else state.iteration for s in state.ids
        }
        self.in_flight, done = split_call(metas or {}, owner, step.mfc.inputs, state, keys)
        for it, piece in done.items():
            self.pending.setdefault(it, Pending({}, {}, {})).add(piece)

    @property
    def partial_rollout(self) -> bool:
        setting = self.schedule.asynchronous
        return setting is not None and setting.partial_rollout

    def _with_in_flight(self, later: _IterationState | None, version: int) -> _IterationState | None:
        """Partial rollouts: the rollout generate call's rows (``later``'s new prompts, or none near the run's
        end) with the samples paused before, under policy ``version``; unchanged otherwise."""
        setting = self.schedule.asynchronous
        if setting is None or not setting.partial_rollout:
            return later
        flight = self.in_flight or InFlight()
        if later is None:
            if not flight.resumed:
                return None
            later = _IterationState(version, [], {}, {})
        later.ids = flight.ids + later.ids
        for key, entries in flight.where.items():
            later.where[key] = list(entries) + later.where.get(key, [])
        later.tokens.update(flight.tokens)
        later.partial = PartialRollout(version, setting.max_staleness, setting.segment_tokens, dict(flight.resumed))
        self.in_flight = None
        return later

    def run_iteration(
        self, iteration: int, shard: ShardInput, waves: Any = None, ahead: tuple[int, ShardInput] | None = None
    ) -> ShardOutput:
        """Every step of the schedule's iteration for this controller's shard; calls on disjoint devices run
        concurrently. With ``waves`` (dynamic sampling), ``shard`` is the first wave (:meth:`run_waves`). Under an
        asynchronous plan the rollout generate calls run on ``ahead`` (a later iteration and its shard; None: they
        do not run, but for the samples partial rollouts paused) and the shard takes what was generated for it
        earlier (:attr:`pending`)."""
        start, cpu, self.waited_s = time.perf_counter(), time.process_time(), 0.0
        result = IterationResult()
        state = _state_of(iteration, shard)
        states: dict[str, _IterationState | None] = {}
        later = None if ahead is None else _state_of(*ahead)
        if self.schedule.ahead:
            if iteration not in self.pending:
                raise RuntimeFailure(f"iteration {iteration}: no batch was generated ahead for it")
            kept = self.pending.pop(iteration)
            if sorted(kept.tokens) != sorted(state.ids):
                raise RuntimeFailure(f"iteration {iteration}: the batch generated ahead holds other samples")
            state.where.update(kept.where)
            state.tokens.update(kept.tokens)
            summaries = [version_summary(kept.token_versions() or [kept.oldest(iteration)])]
            if self.partial_rollout:  # each shard's tokens have their own versions: every controller's count
                summaries = self.exchange((iteration, "staleness"), summaries[0])
            if self.index == 0:  # the controllers' statistics are summed: one reports the batch's staleness
                merge_stats(result.stats, staleness_stats(iteration, summaries), "asynchronous training")
            later = self._with_in_flight(later, iteration)
            states = dict.fromkeys(self.schedule.ahead, later)
        if waves is None:
            replies = self.run_steps(self.schedule.steps, iteration, "iteration", state, result, states=states)[1]
            if later is not None:  # partial rollouts have one rollout generate call, whose replies say what paused
                self._keep_ahead(later, iteration, replies.get(self.schedule.ahead[0]) if later.partial else None)
        else:
            self.run_waves(state, result, waves)
        lengths = [state.tokens[s] for s in state.ids]
        self.lengths = (self.lengths + [lengths])[-LENGTH_WINDOW:]
        where = {k: v for k, v in state.where.items() if is_metric_key(k)}
        return ShardOutput(
            result, where, lengths, time.perf_counter() - start - self.waited_s, time.process_time() - cpu
        )

    def run_waves(self, state: _IterationState, result: IterationResult, waves: Any) -> None:
        """Dynamic sampling (:mod:`loomrl.algorithms.dynamic_sampling`): the steps that make the rewards on each
        wave (:func:`~loomrl.plan.schedule.split_for_sampling`; the first wave also puts the models in place),
        each wave's rewards read from the workers, then the rest of the schedule on the samples kept. ``waves``
        gives the next wave as a :class:`ShardInput` (``offer(ids, rewards)``, None when done) and the samples
        kept (``kept()``). Every wave's output shards stay where they were made; the rest reads the kept rows of
        any of them."""
        head, again, tail = split_for_sampling(self.schedule.steps, waves.producer)
        steps = head
        reader = self.workers[min(self.devices)]
        while True:
            wave = IterationResult()
            self.run_steps(steps, state.iteration, "iteration", state, wave)
            result.traces.extend(wave.traces)
            result.stats.update(wave.stats)  # a fused stage's migration threshold: the last wave's
            scores = self.wait(
                [reader.column.remote(state.ids, shard_refs((waves.key,), state.ids, state.where), waves.key)],
                "the wave's rewards",
                None,
            )[0]
            shard = waves.offer(state.ids, scores)
            if shard is None:
                break
            state.ids, state.max_budget = list(shard.ids), shard.max_budget
            for key in shard.keys:
                state.where.setdefault(key, []).append((shard.ids, shard.source[0]))
            state.tokens.update(zip(shard.ids, shard.prompt_tokens))
            steps = again
        state.ids = list(waves.kept())
        self.run_steps(tail, state.iteration, "iteration", state, result)


def _partial_of(setting: PartialRollout | None, rows: Sequence[int]) -> PartialRollout | None:
    """A worker's share of a partial rollout generate call: the setting with what its ``rows`` generated before."""
    if setting is None:
        return None
    resumed = {s: setting.resumed[s] for s in rows if s in setting.resumed}
    return PartialRollout(setting.version, setting.max_staleness, setting.segment_tokens, resumed)


def _state_of(iteration: int, shard: ShardInput) -> _IterationState:
    """A new iteration's state: the shard's prompts, weighted by their lengths until responses exist."""
    return _IterationState(
        iteration,
        list(shard.ids),
        {k: [(shard.ids, shard.source[0])] for k in shard.keys},
        dict(zip(shard.ids, shard.prompt_tokens)),
        shard.max_budget,
    )


def shard_refs(keys: Sequence[str], ids: Sequence[int], where: Shards) -> tuple:
    """Object references (each in a 1-tuple) of the output shards holding ``keys`` of any of ``ids``."""
    wanted = set(ids)
    refs: list = []
    for key in keys:
        for shard_ids, ref in where[key]:
            if ref not in refs and wanted.intersection(shard_ids):
                refs.append(ref)
    return tuple(refs)


def _step(what: str, role: str | None) -> str:
    """A step named in an error: its role, where it has one (a checkpoint save or a plan change has none)."""
    return what if role is None else f"{what} (role {role})"
