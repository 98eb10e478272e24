"""The single-process reference executor: every MFC in this process, in workflow order.

It defines the expected run: every plan, placement, fusion and controller layout must reproduce what this
executor computes from the same seed. It is deliberately plain: no overlap, no sharding, no copies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loomrl.algorithms.context import OpContext, PartialRollout, Resumed, Role
from loomrl.checkpoint.optim_state import FullOptimizerState
from loomrl.checkpoint.store import load_checkpoint, read_pending, save_checkpoint, save_sharded_checkpoint
from loomrl.models.tokenizer import encode_prompt
from loomrl.plan.schedule import Schedule, Step, split_for_sampling
from loomrl.runtime.ahead import IN_FLIGHT, VERSIONS
from loomrl.runtime.executor import (
    GENERATED_AHEAD,
    Executor,
    IterationResult,
    StepTrace,
    merge_stats,
    staleness_stats,
    version_summary,
)
from loomrl.workflow import MFCKind
from loomrl.workflow.batch import Batch, response_tokens
from loomrl.workflow.minibatches import minibatch_steps

if TYPE_CHECKING:
    from loomrl.algorithms.dynamic_sampling import Waves
    from loomrl.plan.plan import ExecutionPlan


class PendingRollouts:
    """Batches an asynchronous run generated ahead of their iteration, with the policy version that sampled each
    token, which their iteration's staleness statistics compare against; under partial rollouts a batch is kept
    row by row as its samples finish, and the paused samples wait here to continue."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.keys = tuple(keys)
        """The columns generation makes: what is kept of a batch."""
        self.batches: dict[int, Batch] = {}
        """Iteration → the rows generated for it so far (:attr:`keys` and :data:`VERSIONS`)."""
        self.in_flight: Batch | None = None
        """Partial rollouts: the paused samples' rows (the generate call's input columns)."""
        self.resumed: dict[int, Resumed] = {}
        """Partial rollouts: what each paused sample generated so far."""

    def put(self, iteration: int, batch: Batch, versions: Sequence[Sequence[int]]) -> None:
        """Keep ``batch``'s rows (all or some of ``iteration``'s), each with its tokens' versions."""
        piece = batch.columns(self.keys)
        piece.update({VERSIONS: [tuple(v) for v in versions]})
        kept = self.batches.get(iteration)
        self.batches[iteration] = piece if kept is None else Batch.concat([kept, piece])

    def take(self, iteration: int, ids: Sequence[int], stats: dict[str, float]) -> Batch:
        """The batch generated for ``iteration`` (whose sample ids must be ``ids``), in that order, removed; its
        staleness into ``stats``."""
        if iteration not in self.batches:
            raise RuntimeError(
                f"iteration {iteration}: no batch was generated ahead for it (generated: {sorted(self.batches)})"
            )
        batch = self.batches.pop(iteration)
        if sorted(batch.ids) != sorted(ids):
            raise RuntimeError(f"iteration {iteration}: the batch generated ahead holds other samples")
        index = {sid: i for i, sid in enumerate(batch.ids)}
        batch = batch.select([index[s] for s in ids])
        versions = [v for row in batch[VERSIONS] for v in row]
        merge_stats(stats, staleness_stats(iteration, [version_summary(versions)]), "asynchronous training")
        return batch.columns(self.keys)

    def iterations(self) -> list[int]:
        """The iterations with samples generated ahead: finished, or paused to continue."""
        return sorted({*self.batches, *(r.iteration for r in self.resumed.values())})

    def state_dict(self) -> dict[Any, Any]:
        """Plain data for a checkpoint: iteration → (columns, sample ids, oldest version), and the paused samples
        under :data:`IN_FLIGHT` (their rows' columns, sample ids, and what each generated)."""
        out: dict[Any, Any] = {}
        for i, b in self.batches.items():
            oldest = min((v for row in b[VERSIONS] for v in row), default=i)
            out[i] = (b.as_dict(), list(b.ids), oldest)
        if self.in_flight is not None:
            resumed = {sid: r.plain() for sid, r in self.resumed.items()}
            out[IN_FLIGHT] = (self.in_flight.as_dict(), list(self.in_flight.ids), resumed)
        return out

    def load_state_dict(self, state: Mapping[Any, Any]) -> None:
        state = dict(state)
        in_flight = state.pop(IN_FLIGHT, None)
        self.batches = {}
        for i, (cols, ids, version) in state.items():
            batch = Batch(ids, dict(cols))
            if VERSIONS not in batch:  # written by the Ray runtime: one version for the whole batch
                batch.update({VERSIONS: [(int(version),) * n for n in response_tokens(batch)]})
            self.batches[int(i)] = batch
        self.in_flight, self.resumed = None, {}
        if in_flight is not None:
            cols, ids, resumed = in_flight[:3]  # the Ray runtime also writes each sample's controller
            self.in_flight = Batch(ids, dict(cols))
            self.resumed = {int(sid): Resumed.of_plain(r) for sid, r in resumed.items()}


def observed_lengths(batch: Batch) -> list[int]:
    """Every sample's response length in sampled tokens (:func:`response_tokens`), in batch order: what the Ray
    controllers count of a sample (its prompt's length until a response exists), so both executors report the
    same workload."""
    if "response_ids" in batch:
        return response_tokens(batch)
    return [len(r) for r in batch["prompt_ids"]] if "prompt_ids" in batch else [0] * len(batch)


class ReferenceExecutor(Executor):
    """Runs a schedule's calls one after another, on roles held in this process; the schedule's other steps
    (reallocations, frees, syncs, offloading) are placement, which one process does not have."""

    def __init__(
        self,
        schedule: Schedule,
        roles: dict[str, Role],
        seed: int,
        pad_id: int,
        eos_id: int,
        decode: Callable[[list[int]], str],
        metrics_fn: Callable[[Batch], dict] | None = None,
        evaluate_fn: Callable[[Any, Sequence], dict] | None = None,
        tokenizer: Any = None,
    ):
        calls = schedule.calls()
        missing = sorted({s.role for s in calls if s.role is not None} - set(roles))
        if missing:
            raise ValueError(f"workflow needs roles {missing} that were not built")
        self.calls, self.roles = calls, roles
        self.ahead = frozenset(schedule.ahead)
        """Asynchronous plans: the calls that generate a later batch (:class:`~loomrl.plan.plan.AsyncTraining`)."""
        self.pending = PendingRollouts(schedule.ahead_keys())
        """Batches generated ahead of their iteration, with the policy version that generated each."""
        setting = schedule.asynchronous
        self.asynchronous = setting
        self.partial_rollout = setting is not None and setting.partial_rollout
        """Whether the rollout generation pauses samples and continues them in the next iteration."""
        self.seed, self.pad_id, self.eos_id, self.decode = seed, pad_id, eos_id, decode
        self.metrics_fn, self.evaluate_fn, self.tokenizer = metrics_fn, evaluate_fn, tokenizer

    def _context(self, step: Step, iteration: int, batch: Batch) -> OpContext:
        """The call's context: its plan's micro-batches and recomputation (what bounds its memory; the sums they
        change are within the executors' tolerances), none of its placement."""
        mfc = step.mfc
        role = self.roles[mfc.role] if mfc.role is not None else None
        steps: tuple = ()
        if mfc.kind == MFCKind.TRAIN:
            schedule = minibatch_steps(response_tokens(batch), mfc.epochs, mfc.minibatches, self.seed, iteration)
            steps = tuple((s.rows_per_rank[0], 1.0) for s in schedule)
        encode = None if self.tokenizer is None else partial(encode_prompt, self.tokenizer)
        return OpContext(
            role,
            self.seed,
            iteration,
            self.pad_id,
            self.eos_id,
            self.decode,
            encode=encode,
            tokenizer=self.tokenizer,
            train_steps=steps,
            micro_batches=step.alloc.micro_batches,
            recompute=step.alloc.recompute,
            loss_unit=mfc.loss_unit,
        )

    def generate_ahead(self, iteration: int, batch: Batch, version: int) -> None:
        """Generate ``batch``, the prompts of ``iteration``, now with the current weights (policy ``version``), and
        keep it for its iteration: an asynchronous run's pipeline fill (whole: under partial rollouts too, each
        of these batches has until its iteration)."""
        self._generate(iteration, batch, version, IterationResult())

    def _generate(
        self, iteration: int, batch: Batch | None, version: int, result: IterationResult, whole: bool = True
    ) -> None:
        """The rollout generation of ``batch`` (``iteration``'s prompts) with policy ``version``, traced into
        ``result``, kept; under partial rollouts (unless ``whole``) with the samples paused before, and what it
        pauses kept to continue (:meth:`_generate_partial`)."""
        steps = [s for s in self.calls if s.id in self.ahead]
        if self.partial_rollout and not whole:
            self._generate_partial(steps, iteration, batch, version, result)
            return
        assert batch is not None
        self._run_calls(steps, iteration, batch, result)
        self.pending.put(iteration, batch, [(version,) * n for n in response_tokens(batch)])

    def _generate_partial(
        self, steps: Sequence[Step], iteration: int, batch: Batch | None, version: int, result: IterationResult
    ) -> None:
        """One generate call over ``iteration``'s new prompts and every sample paused before: the samples due in
        the next iteration run to their end, the others pause after their segment
        (:class:`~loomrl.algorithms.context.PartialRollout`). Finished samples join their iteration's batch."""
        (step,) = steps  # partial rollouts take one rollout generate call (checked with the plan)
        mfc, pending, setting = step.mfc, self.pending, self.asynchronous
        parts = [b for b in (pending.in_flight, batch and batch.columns(mfc.inputs)) if b is not None]
        if not parts:
            return
        rows = Batch.concat(parts) if len(parts) > 1 else parts[0]
        control = PartialRollout(version, setting.max_staleness, setting.segment_tokens, dict(pending.resumed))
        start = time.time()
        out = mfc.op(dataclasses.replace(self._context(step, iteration, rows), partial=control), rows)
        result.traces.append(StepTrace.of(step, iteration, "iteration", {0: {"start": start, "end": time.time()}}))
        generated = Batch(rows.ids, {**rows.as_dict(), **out})
        paused = [i for i, sid in enumerate(rows.ids) if sid in control.paused]
        pending.in_flight = rows.select(paused) if paused else None
        pending.resumed = {rows.ids[i]: control.paused[rows.ids[i]] for i in paused}
        owner = {sid: control.resumed[sid].iteration if sid in control.resumed else iteration for sid in rows.ids}
        for it in sorted({owner[sid] for sid in rows.ids if sid not in control.paused}):
            done = [i for i, sid in enumerate(rows.ids) if sid not in control.paused and owner[sid] == it]
            pending.put(it, generated.select(done), [control.versions[rows.ids[i]] for i in done])

    def run_iteration(
        self, iteration: int, batch: Batch, waves: Waves | None = None, ahead: tuple[int, Batch] | None = None
    ) -> IterationResult:
        """Every call on ``batch``; with ``waves`` (dynamic sampling), ``batch`` is the first wave: the calls that
        make the rewards run on each wave, the others on the samples the waves keep. An asynchronous plan's
        generate calls run first on ``ahead`` (``(its iteration, its prompts)``, or none near the run's end) with
        the weights of this iteration's start, and ``batch`` takes what they generated for it earlier. Under
        partial rollouts they also continue the samples paused before, near the run's end with no new prompts."""
        result = IterationResult(batch=batch)
        calls = self.calls
        if self.ahead:
            if ahead is not None or self.pending.in_flight is not None:
                later, prompts = ahead if ahead is not None else (iteration, None)
                self._generate(later, prompts, iteration, result, whole=False)
            batch.update(self.pending.take(iteration, batch.ids, result.stats).as_dict())
            calls = [s for s in calls if s.id not in self.ahead]
        if waves is not None:
            head, _, tail = split_for_sampling(self.calls, waves.producer)
            parts = []
            while batch is not None:
                self._run_calls(head, iteration, batch, result)
                parts.append(batch)
                batch = waves.offer(batch.ids, batch[waves.key].tolist())
            whole = Batch.concat(parts)
            index = {sid: i for i, sid in enumerate(whole.ids)}
            batch = result.batch = whole.select([index[s] for s in waves.kept()])
            merge_stats(result.stats, waves.stats(), "dynamic sampling")
            calls = tail
        self._run_calls(calls, iteration, batch, result)
        result.response_lengths = observed_lengths(batch)
        if self.metrics_fn is not None:
            merge_stats(result.stats, self.metrics_fn(batch), "metrics")
        return result

    def _run_calls(self, calls: Sequence[Step], iteration: int, batch: Batch, result: IterationResult) -> None:
        for step in calls:
            mfc = step.mfc
            start = time.time()
            out = mfc.op(self._context(step, iteration, batch), batch.columns(mfc.inputs))
            if mfc.kind == MFCKind.TRAIN:
                merge_stats(result.stats, out.pop("stats", {}), mfc.name)
            if set(out) != set(mfc.outputs):
                raise RuntimeError(f"MFC '{mfc.name}' returned {sorted(out)}, declared {sorted(mfc.outputs)}")
            batch.update(out)
            result.traces.append(StepTrace.of(step, iteration, "iteration", {0: {"start": start, "end": time.time()}}))

    def apply_plan(self, plan: ExecutionPlan) -> None:
        """Nothing moves in one process: a plan change never changes what is computed."""

    def drain_traces(self) -> list[StepTrace]:
        """No steps run outside iterations here."""
        return []

    # ------------------------------------------------------------------ evaluation and checkpoints
    def trainable(self) -> dict[str, Role]:
        """The roles that train (those with an optimizer): what a checkpoint holds."""
        return {name: r for name, r in self.roles.items() if r.optimizer is not None}

    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Greedy evaluation of the actor held in this process."""
        return self.evaluate_fn(self.roles["actor"].model, examples)

    def check_shared_dir(self, path: Path) -> None:
        """One process writes and reads every checkpoint: any directory will do."""

    def save(
        self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int, sharded: bool = True
    ) -> Path:
        """Checkpoint the trained roles, sharded (one shard per role: the same form the Ray executor writes) or
        whole (``sharded=False``)."""
        roles = self.trainable()
        if sharded:
            return save_sharded_checkpoint(
                run_dir,
                iteration,
                {n: (r.model, r.optimizer) for n, r in roles.items()},
                self.tokenizer,
                state,
                keep_last=keep_last,
                pending=self._pending_state(),
            )
        return save_checkpoint(
            run_dir,
            iteration,
            {n: r.model for n, r in roles.items()},
            self.tokenizer,
            {n: FullOptimizerState(r.model, r.optimizer) for n, r in roles.items()},
            state,
            keep_last=keep_last,
            pending=self._pending_state(),
        )

    def _pending_state(self) -> dict | None:
        return self.pending.state_dict() if self.ahead else None

    def load(self, path: Path) -> dict[str, Any]:
        """Load the trained roles' weights and optimizer states; the run state saved with them."""
        roles = self.trainable()
        state = load_checkpoint(
            path,
            {n: r.model for n, r in roles.items()},
            {n: FullOptimizerState(r.model, r.optimizer) for n, r in roles.items()},
        )
        pending = read_pending(path)
        if self.ahead and pending is not None:
            self.pending.load_state_dict(pending)
        return {**state, GENERATED_AHEAD: self.pending.iterations()}

    def close(self) -> None:
        """Stop the rollout engines of other processes its roles started (vLLM's); nothing else to release."""
        for role in self.roles.values():
            if role.generator is not None:
                role.generator.close()
                role.generator = None
