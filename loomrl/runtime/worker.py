"""One device's worker: the models the plan puts on the device, and the schedule steps run on them.

A plain class, so tests can build it without Ray; :mod:`loomrl.runtime.ray_executor` wraps it as one Ray actor
per device. The worker receives its roles' specs and the plan's schedule (:mod:`loomrl.runtime.spec`), builds
the model of every (role, shards) the schedule places on its device, in the layout those shards say (pipeline
stages, tensor parallelism, FSDP), and runs the steps the controller names: calls on the rows it is given,
copies and syncs with their transfer plans, frees, reloads and offloads. Inputs arrive as Ray object
references to other workers' output shards, and outputs leave the same way: the controller sees references and
scalars, never tokens.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loomrl.algorithms.context import OpContext, PartialRollout, Role
from loomrl.algorithms.evaluate import evaluate_policy
from loomrl.algorithms.metrics import rollout_metrics
from loomrl.checkpoint.optim_state import FullOptimizerState, merge_optimizer_states, with_masters
from loomrl.checkpoint.shards import check_pieces, place_of, role_pieces, write_role_shards
from loomrl.checkpoint.store import begin_save, finish_sharded_save, load_checkpoint, save_checkpoint
from loomrl.data.sources import build_task
from loomrl.models.lora import moving_parameters
from loomrl.models.tokenizer import decode_response, encode_prompt, task_tokenizer
from loomrl.parallel import (
    apply_fsdp,
    apply_tensor_parallel,
    build_broadcast_groups,
    check_layout,
    execute_reallocation,
    full_state_dict,
    local_shard,
)
from loomrl.parallel.allocations import AllocationGroups
from loomrl.parallel.pipeline import split_stages
from loomrl.parallel.pipeline_runner import PipelineRunner
from loomrl.parallel.role_state import init_state, state_tensors, steps_taken
from loomrl.plan.allocation import Allocation
from loomrl.plan.schedule import Step, StepKind
from loomrl.role import ModelPasses, build_model, make_role, resolve_device, resolve_dtype
from loomrl.runtime.ahead import IN_FLIGHT, VERSIONS
from loomrl.runtime.launch import quiet_libraries
from loomrl.runtime.migration import MigrationControl, StreamSpec
from loomrl.runtime.offload import HostCopy, TrainingState, bind_view, reclaim, release_storage
from loomrl.runtime.pipeline_fusion import run_pipeline_fusion
from loomrl.runtime.plan_change import Move
from loomrl.runtime.spec import SHARD_FOLLOWS, CallData, PipelineFusionData, WorkerPlan, WorkerSpec
from loomrl.workflow import MFCKind
from loomrl.workflow.batch import Batch, response_tokens

Holding = tuple[str, Allocation]
"""``(role, shards)``: one model this device holds, in one layout."""


class WorkerError(RuntimeError):
    """A step failed on a worker; the message names the worker, the role and the step."""


def gather_pending(entries: dict | None) -> dict | None:
    """An asynchronous run's batches generated ahead, for a checkpoint: ``entries`` maps an iteration to
    ``(sample ids, references of the output shards holding them, columns, each sample's token versions)``; the
    result maps it to ``(columns with the versions', sample ids, oldest version)``, and the paused samples of
    partial rollouts (:data:`~loomrl.runtime.ahead.IN_FLIGHT`) to ``(their input columns, sample ids, what each
    generated)``: :class:`~loomrl.runtime.reference.PendingRollouts`' form."""
    if entries is None:
        return None
    out: dict[Any, tuple] = {}
    for iteration, entry in entries.items():
        if iteration == IN_FLIGHT:  # each controller's (index, paused samples)
            parts = [
                (k, gather_rows(_get(list(refs)), ids, keys), resumed) for k, (ids, refs, keys, resumed, _) in entry
            ]
            rows = Batch.concat([p for _, p, _ in parts])
            resumed = {s: r for _, _, held in parts for s, r in held.items()}
            owners = [k for k, p, _ in parts for _ in p.ids]
            out[IN_FLIGHT] = (rows.as_dict(), list(rows.ids), resumed, owners)
            continue
        ids, refs, keys, versions = entry
        columns = {**gather_rows(_get(list(refs)), ids, keys).as_dict(), VERSIONS: [tuple(v) for v in versions]}
        out[iteration] = (columns, list(ids), min((v for row in versions for v in row), default=iteration))
    return out


def gather_rows(shards: Sequence[Batch], sample_ids: Sequence[int], keys: Sequence[str]) -> Batch:
    """The requested rows, in the requested order, of ``keys`` found across the shards.

    Per-token columns are response-aligned and right-padded; shards made by different workers are padded to
    their own longest response, so every 2-D column is padded again to one common width, as in the reference.
    No rows (a data-parallel replica given none this call): an empty batch, with no inputs.
    """
    if not sample_ids:
        return Batch([])
    columns = {}
    for key in keys:
        parts = [s for s in shards if key in s]
        if not parts:
            raise KeyError(f"no input shard holds key '{key}'")
        whole = Batch.concat([p.columns([key]) for p in parts]) if len(parts) > 1 else parts[0].columns([key])
        index = {sid: i for i, sid in enumerate(whole.ids)}
        columns[key] = whole.select([index[s] for s in sample_ids], [key])[key]
    width = max((v.shape[1] for v in columns.values() if isinstance(v, torch.Tensor) and v.dim() == 2), default=0)
    for key, value in columns.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] < width:
            columns[key] = torch.nn.functional.pad(value, (0, width - value.shape[1]))
    return Batch(sample_ids, columns)


class DeviceWorker:
    """The models on one device, in every layout the plan gives them here, and the steps run on them."""

    def __init__(self, rank: int, world: int, spec: WorkerSpec):
        self.rank, self.world, self.spec = rank, world, spec
        quiet_libraries()
        threads = spec.threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        self.device = resolve_device(spec.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(spec.precision, self.device)
        """The run's weight type: that of every copy a reallocation fills (FSDP keeps fp32 shards)."""
        self.tokenizer = task_tokenizer(spec.task, spec.tokenizer)
        self.task = build_task(spec.task)
        self.decode = partial(decode_response, self.tokenizer)
        self.holdings: dict[Holding, Role] = {}
        self.views: dict[Holding, frozenset[str]] = {}
        """Parameters of a copy bound to views of its role's training shards here by its latest reallocation
        (see :meth:`_reallocate`), and pointed at placeholders when it is freed."""
        self.host_copies: dict[Holding, HostCopy | TrainingState] = {}
        self.kinds: dict[Holding, str] = {}
        """What each holding is (:meth:`_kind`): a holding whose kind a plan change alters is built anew."""
        self.transfers: dict[tuple, tuple] = {}
        """(role, source, destination) → (its transfer plan, the broadcast groups it needs)."""

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def sees(self, path: str) -> bool:
        """Whether ``path`` exists on this worker's machine (the run directory must be shared storage)."""
        return os.path.exists(path)

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    # --------------------------------------------------------------------------------------------- set-up
    def setup(self, master_addr: str, master_port: int, plan: WorkerPlan) -> dict:
        """Join the process group, then install ``plan``: its communicators and this device's models."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=self.spec.timeout_s),
        )
        self.groups = AllocationGroups(self.rank, (), self.device.type)
        self.install(plan)
        import ray

        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "node": ray.get_runtime_context().get_node_id(),
        }

    def install(self, plan: WorkerPlan, extra: Sequence[Allocation] = ()) -> None:
        """Make ``plan`` the one this worker executes: create the communicators of its allocations (and of
        ``extra`` ones) and the broadcast groups of its transfers (collective: every worker installs the same
        plan, in the same order) and build the models it places here that this device does not hold yet."""
        self.plan, self.steps, self.training = plan, plan.steps(), plan.training()
        holdings = plan.schedule.holdings()
        computes = [s.alloc for s in plan.schedule.calls() if s.role is None and s.alloc.layout.dp > 1]
        self.groups.add([alloc for _, alloc in holdings] + list(self.training.values()) + computes + list(extra))
        self.transfers = {
            t: self.transfers[t] if t in self.transfers else (p, build_broadcast_groups(p))
            for t, p in plan.transfers.items()
        }
        for role, alloc in holdings:
            key = (role, alloc)
            if self.rank in alloc.mesh and (key not in self.holdings or self.kinds[key] != self._kind(role, alloc)):
                self.holdings[key] = self._build(role, alloc)
        if self.device.type != "cpu":  # a CPU device is its host: offloading would free nothing
            for key in plan.offloaded():
                if key in self.holdings and key not in self.host_copies:
                    self.host_copies[key] = self._host_copy(key)

    def _host_copy(self, key: tuple[str, Allocation]) -> HostCopy | TrainingState:
        """What offloads a holding: a trained role's whole training state, moved out at each offload (it is
        resident until then), or a frozen role's weights, copied to the host once and released at once."""
        handle = self.holdings[key]
        if self.kinds[key].startswith("training"):
            return TrainingState(handle.model, handle.optimizer)
        copy = HostCopy(handle.model)
        copy.release()
        return copy

    def _kind(self, role: str, alloc: Allocation) -> str:
        """What a holding is under the installed plan: the role's training state (with its optimizer's
        sharding), a copy or shadow of a trained role's weights, or a frozen role's weights."""
        training = self.training.get(role)
        if training is None:
            return "frozen"  # no train call in this workflow, whatever its spec could train
        return f"training{'/zero' if training.zero else ''}" if alloc == training.shards else "copy"

    def _build(self, role: str, alloc: Allocation) -> Role:
        """A role's model built from its spec and sharded for ``alloc`` here (before any optimizer exists); the
        role's training allocation gets the optimizer and the engine that sums and clips its gradients; a copy
        is left empty, to be filled before each use."""
        spec = self.spec.roles[role]
        training = self.training.get(role)
        kind = self._kind(role, alloc)
        trainable = kind.startswith("training")
        model, pipeline = self._parallelize(role, alloc, build_model(spec, self.tokenizer, self.device, self.dtype))
        self.kinds[(role, alloc)] = kind
        if model is None:
            return make_role(spec, None, self.task, None, trainable=False)
        groups = self.groups[alloc]
        sharded = alloc.layout.dp > 1
        engine = ModelPasses(
            model,
            pipeline=pipeline,
            dp_group=groups.dp_group if trainable and sharded and not alloc.fsdp else None,
            lockstep=trainable and sharded and alloc.fsdp,
        )
        zero_group = groups.dp_group if trainable and sharded and training.zero else None
        handle = make_role(spec, model, self.task, engine, trainable=trainable, zero_group=zero_group)
        if kind == "copy":
            _own_storage(model)  # freed and refilled around its uses (a LoRA copy's base stays: it never changes)
            release_storage(model, moving_only=True)
        return handle

    def _parallelize(self, role: str, alloc: Allocation, model: torch.nn.Module | None):
        """Shard a freshly built model for ``alloc``; returns the model this device keeps and, for pipeline
        stages, the runner that drives them.

        pp > 1 keeps this device's stage (its layers, and the embedding / head where they live); tp > 1 then
        shards what is kept over the TP ranks of the stage, so a pp×tp device holds one TP slice of one stage.
        An FSDP allocation (pp = 1) then shards each TP slice over the data-parallel ranks (FSDP2 on the dp
        dimension of the dp × tp mesh).
        """
        if model is None:
            return None, None
        layout = alloc.layout
        check_layout(layout, model.config, len(alloc.mesh), where=f"runtime.plan ({role})")
        groups = self.groups[alloc]
        stage = split_stages(model, groups.pp_rank, layout.pp) if layout.pp > 1 else None
        if layout.tp > 1:
            apply_tensor_parallel(model, groups.tp_mesh)
        if alloc.fsdp:
            return apply_fsdp(model, groups.dp_mesh, self.dtype), None
        if stage is None:
            return model, None
        return stage.model, PipelineRunner(
            stage, groups.pp_group, groups.pp_rank, layout.pp, groups.stage_ranks, groups.tied_group
        )

    # --------------------------------------------------------------------------------------------- steps
    def run_step(self, step_id: str, data: Any = None) -> dict:
        """Run one step of the installed plan (``data``: a call's :class:`CallData`, an evaluation's examples)."""
        step = self.steps[step_id]
        start = time.time()
        try:
            out = self._run(step, data)
        except Exception as exc:
            what = f"MFC '{step.id}'" if step.kind is StepKind.CALL else f"step '{step.id}'"
            raise WorkerError(
                f"worker {self.rank} failed in {what} (role {step.role}): "
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            ) from None
        return {"start": start, "end": time.time(), "rank": self.rank, **out}

    def _run(self, step: Step, data: Any) -> dict:
        kind = step.kind
        if kind is StepKind.CALL:
            return self._call(step, data)
        if kind is StepKind.PIPELINE_FUSION:
            return self._pipeline_fusion(step, data)
        if kind is StepKind.EVALUATE:
            return self._evaluate(step, data)
        if step.moves_bytes:
            self._reallocate(step)
        elif kind is StepKind.FREE:
            handle = self.holdings[(step.role, step.alloc)]
            release_storage(handle.model, self.views.get((step.role, step.alloc), frozenset()), moving_only=True)
        elif kind is StepKind.RELOAD and (step.role, step.alloc) in self.host_copies:
            self.host_copies[(step.role, step.alloc)].restore()
        elif kind is StepKind.OFFLOAD and (step.role, step.alloc) in self.host_copies:
            self.host_copies[(step.role, step.alloc)].release()
        return {}

    def run_stream(self, step_id: str, call: CallData, spec: StreamSpec):
        """A fused stage's generation on this device, streamed (a Ray generator): yields the finished rows in
        chunks as they come (each chunk's rows and token counts, then its shard), taking part in the tail's
        migration (:mod:`loomrl.runtime.migration`), and last a marker with the stream's start and end. A chunk's
        shard is its own item, right after its metadata (:data:`~loomrl.runtime.spec.SHARD_FOLLOWS`), so that
        the controller owns its reference."""
        step = self.steps[step_id]
        start = time.time()
        coords = step.alloc.coords(self.rank)
        control = MigrationControl(
            spec, self.groups[step.alloc].mesh_group, coords.dp, coords.tp == 0, step.alloc.layout.dp, self.device
        )
        try:
            batch = gather_rows(_get(list(call.inputs)), call.sample_ids, step.mfc.inputs)
            ctx = dataclasses.replace(self._context(step, call), stream=control)
            for ids, columns in step.mfc.stream(ctx, batch):
                meta: dict[str, Any] = {"rows": list(ids)}
                if not call.publish:
                    yield meta
                    continue
                responses = next(v for k, v in columns.items() if k.endswith("response_ids"))
                meta["tokens"] = {sid: len(r) for sid, r in zip(ids, responses)}
                yield meta | {"shard": SHARD_FOLLOWS}
                yield Batch(ids, columns)
        except Exception as exc:
            raise WorkerError(
                f"worker {self.rank} failed in MFC '{step.id}' (role {step.role}): "
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            ) from None
        yield {"done": True, "start": start, "end": time.time(), "rank": self.rank, "migrated_at": control.migrated_at}

    def _call(self, step: Step, call: CallData) -> dict:
        mfc = step.mfc
        shards = _get(list(call.inputs))
        batch = gather_rows(shards, call.sample_ids, mfc.inputs)
        if not call.sample_ids and mfc.kind != MFCKind.TRAIN:
            out = {}  # a replica given no rows computes nothing (train calls still join the step's collectives)
        else:
            ctx = self._context(step, call)
            out = mfc.op(ctx, batch)
            if ctx.partial is not None:
                return self._partial_published(step, call, out, ctx.partial)
        return self._published(step, call, out)

    def _partial_published(self, step: Step, call: CallData, out: dict, partial: PartialRollout) -> dict:
        """A call's reply under partial rollouts: its finished rows published as :meth:`_published` does, with
        their tokens' versions; the paused rows' tokens, behaviour log-probs and versions as plain data, for the
        controller to continue them in the next call."""
        done = [i for i, sid in enumerate(call.sample_ids) if sid not in partial.paused]
        rows = Batch(call.sample_ids, out).select(done)
        meta = self._published(step, dataclasses.replace(call, sample_ids=tuple(rows.ids)), rows.as_dict())
        if call.publish:
            meta["rows"] = list(rows.ids)
            meta["versions"] = {sid: list(partial.versions[sid]) for sid in rows.ids}
            meta["paused"] = {sid: r.plain() for sid, r in partial.paused.items()}
        return meta

    def _pipeline_fusion(self, step: Step, data: PipelineFusionData) -> dict:
        """The two train calls of a ``fused_train`` step as one fused pipeline (:mod:`loomrl.runtime.pipeline_fusion`);
        each member's metadata as its own call's would be."""
        ops, roles, back_groups, stage_ranks = [], [], [], []
        for member in step.members:
            call = data.calls[member.id]
            ctx = self._context(member, call)
            batch = gather_rows(_get(list(call.inputs)), call.sample_ids, member.mfc.inputs)
            ops.append(partial(member.mfc.op, ctx, batch))
            roles.append(ctx.role)
            groups = self.groups[member.alloc]
            back_groups.append(groups.pp_back_group)
            stage_ranks.append(groups.stage_ranks)
        results = run_pipeline_fusion(ops, roles, data.order, back_groups, stage_ranks)
        return {"members": {m.id: self._published(m, data.calls[m.id], out) for m, out in zip(step.members, results)}}

    def _published(self, step: Step, call: CallData, out: dict) -> dict:
        """A call's reply: its statistics, a reference to its output shard and its rows' token counts, where this
        worker publishes."""
        mfc = step.mfc
        stats = out.pop("stats", {}) if mfc.kind == MFCKind.TRAIN else {}
        meta: dict[str, Any] = {}
        if call.publish:
            meta["stats"] = stats
            if out:
                meta["shard"] = (_put(Batch(call.sample_ids, out)),)
            if "response_ids" in out:  # token counts steer the controller's balancing and train schedules
                meta["tokens"] = dict(zip(call.sample_ids, response_tokens(Batch(call.sample_ids, out))))
        return meta

    def _context(self, step: Step, call: CallData) -> OpContext:
        role = self.holdings[(step.role, step.alloc.shards)] if step.role is not None else None
        tok = self.tokenizer
        reduce = None
        if step.role is None and step.alloc.layout.dp > 1:  # a compute call on one shard per controller
            reduce = partial(_summed, group=self.groups[step.alloc].dp_group, device=self.device)
        return OpContext(
            role,
            self.spec.seed,
            call.iteration,
            tok.pad_token_id,
            tok.eos_token_id,
            self.decode,
            encode=partial(encode_prompt, tok),
            tokenizer=tok,
            train_steps=call.train_steps,
            micro_batches=step.alloc.micro_batches,
            recompute=step.alloc.recompute,
            reduce=reduce,
            loss_unit=step.mfc.loss_unit,
            partial=call.partial,
        )

    def _reallocate(self, step: Step) -> None:
        """Move a role's weights from its training layout into a copy or shadow (every source and destination
        device runs it): all of them, or a LoRA role's adapters (its copies hold the frozen base already)."""
        role, src, dst = step.transfer
        plan, groups = self.transfers[step.transfer]
        src_role, dst_role = self.holdings.get((role, src)), self.holdings.get((role, dst))
        # FSDP's fp32 shards are rounded to the copy's type (a no-op otherwise); adapters stay fp32
        dtype = torch.float32 if self.spec.roles[role].lora is not None else self.dtype
        src_tensors = (
            {n: local_shard(p).detach().to(dtype) for n, p in moving_parameters(src_role.model)} if src_role else {}
        )
        # the transfer writes straight into the copy's parameters, taking back their memory if freed; a shard
        # that is a contiguous span of the training shard here becomes a view of it instead (no copy, no memory)
        moving = dict(moving_parameters(dst_role.model)) if dst_role else {}
        views = {n for n in moving if plan.aliased(self.rank, n)}
        targets = None if dst_role is None else {n: reclaim(p) for n, p in moving.items() if n not in views}
        out = execute_reallocation(
            plan,
            src_tensors,
            self.rank,
            groups=groups,
            dtypes=dtype,
            device=self.device,
            verify=self.spec.verify_reallocation,
            out=targets,
        )
        if dst_role is not None:
            for name in views:
                bind_view(moving[name], out[name])
            self.views[(role, dst)] = frozenset(views)  # bound to the training shards until freed

    def _evaluate(self, step: Step, examples: tuple[Sequence, bool]) -> dict:
        """Greedy evaluation of this worker's share of examples with the actor in the step's layout; sums."""
        share, publish = examples
        model = self.holdings[(step.role, step.alloc)].model
        out = (
            evaluate_policy(model, self.tokenizer, self.task, share, self.spec.eval_max_new_tokens, env=self.spec.env)
            if share
            else {"exact_match": 0.0, "score": 0.0}
        )
        return {"sums": {k: v * len(share) for k, v in out.items()}} if publish else {}

    def metrics(self, sample_ids: Sequence[int], inputs: Sequence[Any], keys: Sequence[str]) -> dict[str, float]:
        return rollout_metrics(gather_rows(_get(list(inputs)), sample_ids, keys), self.decode, self.task)

    def column(self, sample_ids: Sequence[int], inputs: Sequence[Any], key: str) -> list[float]:
        """A per-sample scalar column of ``sample_ids``, as numbers (the rewards dynamic sampling filters on)."""
        return [float(x) for x in gather_rows(_get(list(inputs)), sample_ids, [key])[key].tolist()]

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters this device holds per (role, shards), e.g. to see freed copies."""
        report = {}
        for (role, alloc), handle in self.holdings.items():
            if handle.model is not None:
                views = self.views.get((role, alloc), frozenset())  # storage of the training copy
                report[f"{role}@{alloc.text}"] = sum(
                    local_shard(p).untyped_storage().size()
                    for n, p in handle.model.named_parameters()
                    if n not in views
                )
        return report

    # ---------------------------------------------------------------------------------------- plan changes
    def steps_taken(self, role: str) -> int:
        """Optimizer steps a trained role has taken (this device must hold its training state)."""
        handle = self.holdings[(role, self.training[role].shards)]
        return steps_taken(handle.optimizer)

    def apply_plan(self, plan: WorkerPlan, moves: Sequence[Move]) -> dict:
        """Switch to ``plan``: build the holdings it places here anew (a new training allocation, a new
        placement of a frozen role), move every role's state into them (collective over each move's devices, in
        the same order on every worker), drop what the new plan does not hold here, and install it."""
        start = time.time()
        old = dict(self.holdings)
        kept = set(plan.schedule.holdings())
        self.holdings = {k: v for k, v in old.items() if k in kept}
        self.install(plan, extra=[a for m in moves for a in (m.src, m.dst)])
        for move in moves:
            self._move(move, old.get((move.role, move.src.shards)), self.holdings.get((move.role, move.dst.shards)))
        for key, handle in old.items():  # gone, or built anew: what referred to the old model goes with it
            if self.holdings.get(key) is not handle:
                self.views.pop(key, None)
                self.host_copies.pop(key, None)
        return {"start": start, "end": time.time(), "rank": self.rank}

    def _move(self, move: Move, src: Role | None, dst: Role | None) -> None:
        """Run one role's move (:mod:`loomrl.runtime.plan_change`); ``src``/``dst``: this device's old and new
        holding of the role, if any. Every worker runs every move: building its groups is collective."""
        groups = {id(p): build_broadcast_groups(p) for p in (move.weights, move.state) if p is not None}
        if dst is not None and dst.optimizer is not None and move.step > 0:
            init_state(dst.model, dst.optimizer, move.step)
        for kind in move.kinds:
            plan = move.weights if kind == "weights" else move.state
            adapters = self.spec.roles[move.role].lora is not None  # a LoRA role's weights: its fp32 adapters
            dtype = self.dtype if kind == "weights" and not adapters else torch.float32
            sent = (
                {n: t.detach().to(dtype) for n, t in state_tensors(src.model, src.optimizer, kind).items()}
                if src is not None
                else {}
            )
            targets = state_tensors(dst.model, dst.optimizer, kind) if dst is not None else None
            got = execute_reallocation(
                plan,
                sent,
                self.rank,
                groups=groups[id(plan)],
                dtypes=dtype,
                device=self.device,
                verify=self.spec.verify_reallocation,
                out=targets,
            )
            with torch.no_grad():
                for name, tensor in got.items():  # shards the plan aliases come back as views of the old ones
                    if targets is not None and name in targets and tensor.data_ptr() != targets[name].data_ptr():
                        targets[name].copy_(tensor.view_as(targets[name]))

    # ----------------------------------------------------------------------------------------- checkpoints
    def export_role(self, role: str) -> dict:
        """Full weights and optimizer state of a trained role (collective over its training mesh); the mesh's
        first device of each pipeline stage publishes that stage's part for the checkpoint writer."""
        alloc = self.training[role]
        handle = self.holdings[(role, alloc.shards)]
        weights = full_state_dict(handle.model)
        optim = FullOptimizerState(handle.model, handle.optimizer).state_dict()
        if alloc.fsdp:  # its fp32 shards are the master weights of a 16-bit run
            weights, optim = with_masters(weights, optim, self.dtype)
        coords = alloc.coords(self.rank)
        if coords.dp or coords.tp:
            return {}
        return {
            "state": (
                _put({"weights": weights, "optim": optim, "cls": type(handle.model), "config": handle.model.config}),
            )
        }

    def save(
        self, run_dir: str, iteration: int, state: dict, keep_last: int, exports: dict, pending: dict | None = None
    ) -> str:
        """Write the checkpoint from the roles' exported states (this worker need not hold any of them), with an
        asynchronous run's ``pending`` batches (:func:`gather_pending`)."""
        models, optims = {}, {}
        for role, refs in exports.items():
            parts = _get([ref[0] for ref in refs])  # one per pipeline stage
            weights = {k: v for part in parts for k, v in part["weights"].items()}
            models[role] = _plain_copy(parts[0]["cls"], parts[0]["config"], weights)
            optims[role] = FullOptimizerState(
                models[role], None, gathered=merge_optimizer_states([part["optim"] for part in parts])
            )
        return str(
            save_checkpoint(
                Path(run_dir),
                iteration,
                models,
                self.tokenizer,
                optims,
                state,
                keep_last=keep_last,
                pending=gather_pending(pending),
            )
        )

    def _pieces(self) -> dict[str, tuple[Role, dict, dict]]:
        """Per trained role this device holds training state of: its holding, where its pieces sit and the
        pieces themselves (views of the state where it is on the CPU already)."""
        out = {}
        for role, alloc in sorted(self.training.items()):
            handle = self.holdings.get((role, alloc.shards))
            if handle is not None and handle.model is not None:
                place = place_of(alloc, self.rank)
                out[role] = (handle, place, role_pieces(handle.model, handle.optimizer, place, self.dtype))
        return out

    def check_shards(self) -> None:
        """Refuse non-finite pieces before any worker writes (a save's first round)."""
        for role, (_, _, pieces) in self._pieces().items():
            check_pieces(role, pieces)

    def begin_save(self, run_dir: str, iteration: int) -> str:
        """The temporary directory of a sharded save, named for this worker, which finishes it."""
        return str(begin_save(Path(run_dir), iteration))

    def save_shards(self, tmp: str) -> dict:
        """Write this device's pieces of every trained role into the save's directory (no communication)."""
        return {
            role: write_role_shards(Path(tmp), role, handle.model, handle.optimizer, place, pieces)
            for role, (handle, place, pieces) in self._pieces().items()
        }

    def finish_save(
        self, tmp: str, iteration: int, state_json: str, keep_last: int, parts: dict, pending: dict | None = None
    ) -> str:
        """Index, tokenizer, RNG, state, an asynchronous run's ``pending`` batches (:func:`gather_pending`) and
        manifest of a sharded save, then its rename into place."""
        return str(
            finish_sharded_save(
                Path(tmp), iteration, state_json, self.tokenizer, parts, keep_last, gather_pending(pending)
            )
        )

    def load(self, path: str) -> dict:
        """Every holder of a trained role's training weights loads them (and its optimizer state)."""
        mine = {
            role: self.holdings[(role, alloc.shards)]
            for role, alloc in self.training.items()
            if (role, alloc.shards) in self.holdings
        }
        return load_checkpoint(
            Path(path),
            {n: r.model for n, r in mine.items()},
            {n: FullOptimizerState(r.model, r.optimizer) for n, r in mine.items()},
            restore_rng=self.rank == 0,
            places={n: place_of(self.training[n], self.rank) for n in mine},
        )

    def shutdown(self) -> None:
        for role in self.holdings.values():
            if role.generator is not None:  # a vLLM engine's process
                role.generator.close()
                role.generator = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _summed(tensor: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """``tensor`` summed over ``group``, reduced on this worker's device (NCCL reduces CUDA tensors only) and
    returned where ``tensor`` lives (a new tensor; the argument is left as it is)."""
    out = tensor.detach().to(device, copy=True)
    dist.all_reduce(out, group=group)
    return out.to(tensor.device)


def _own_storage(model: torch.nn.Module) -> None:
    """Give parameters storage of their own: weights loaded from safetensors may be memory-mapped, and a
    mapped storage cannot be released (resized to 0) after a copy's last use."""
    with torch.no_grad():
        for param in model.parameters():
            # A DTensor's shard may be a view into the mapped full tensor; swap the shard's own data.
            local = getattr(param, "_local_tensor", param)
            if not local.untyped_storage().resizable():
                local.data = local.data.clone()


def _plain_copy(model_cls, config, weights: dict[str, torch.Tensor]):
    """An unsharded CPU model holding full weights, for save_pretrained."""
    plain = model_cls(config)
    plain.load_state_dict(weights)
    return plain


def _get(ref):
    import ray

    return ray.get(ref)


def _put(value):
    import ray

    return ray.put(value)
