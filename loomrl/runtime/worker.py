"""One device's worker: the shards of every role placed on the device, and the MFC calls run on them.

A plain class, so tests can build it without Ray; :mod:`loomrl.runtime.ray_executor` wraps it as one Ray actor
per device. The worker builds its roles itself from the run's config (same seed, so data-parallel replicas
start identical), applies each role's layout (pipeline stages, tensor parallelism, or both), and runs the
workflow's MFC functions on the rows the controller assigns it. Inputs arrive as Ray object references to other
workers' output shards, and outputs leave the same way: the controller sees references and scalars, never
tokens.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from loomrl.algorithms.roles import OpContext
from loomrl.checkpoint import load_checkpoint, save_checkpoint
from loomrl.algorithms.workflows import build_workflow
from loomrl.config import TrainConfig
from loomrl.launch import quiet_libraries
from loomrl.parallel import (apply_fsdp, apply_tensor_parallel, build_broadcast_groups, check_layout,
                             execute_reallocation, full_state_dict, local_shard, sync_gradients)
from loomrl.parallel.allocations import AllocationGroups, AllocKey
from loomrl.plan.realloc_plan import ReallocPlan
from loomrl.parallel.pipeline import split_stages
from loomrl.parallel.pipeline_schedule import PipelineRunner
from loomrl.runtime.offload import HostCopy, bind_view, reclaim, release_storage
from loomrl.runtime.state_io import FullOptimizerState, merge_optimizer_states, with_masters
from loomrl.train import common
from loomrl.train.evaluate import evaluate_policy
from loomrl.train.metrics import rollout_metrics
from loomrl.workflow import MFCKind
from loomrl.workflow.batch import Batch


class WorkerError(RuntimeError):
    """An MFC failed on a worker; the message names the worker, the role and the MFC."""


@dataclass(frozen=True)
class MFCCall:
    """What the controller sends a worker for one MFC: metadata only."""

    mfc: str
    iteration: int
    sample_ids: tuple[int, ...]
    """This worker's rows, in order."""
    inputs: tuple[Any, ...]
    """Object references to the output shards holding the rows' input columns (each wrapped in a 1-tuple so
    Ray passes the reference, not its value)."""
    train_steps: tuple[tuple[tuple[int, ...], float], ...] = ()
    """Per optimizer step: positions in ``sample_ids`` and the loss weight (train MFCs)."""
    publish: bool = True
    """Whether this worker's outputs are published (one tensor-parallel rank per data-parallel group)."""


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


@dataclass(frozen=True)
class RuntimePlacement:
    """What the controller derives from the execution plan and every worker needs to know."""

    mfc_keys: dict[str, AllocKey]
    """The allocation each MFC runs on."""
    canonical: dict[str, AllocKey]
    """Where each role's weights live: its train call's allocation, else its first call's."""
    reallocs: tuple[tuple[str, AllocKey, AllocKey, ReallocPlan], ...]
    """(role, from, to, transfer plan) for every other allocation of a role, in a fixed order."""
    mfc_micro_batches: dict[str, int] = field(default_factory=dict)
    """The micro-batches each MFC's rows on a rank run as (the plan's; 1 for an MFC not listed)."""
    mfc_recompute: frozenset[str] = frozenset()
    """Train MFCs that recompute activations in the backward (the plan's ``rc``)."""
    offloaded: frozenset[str] = frozenset()
    """Frozen roles kept in host memory between their calls (the plan's offloaded roles; on accelerators)."""
    zero: frozenset[str] = frozenset()
    """Trained roles whose optimizer state is sharded over their training allocation's dp group (ZeRO-1)."""

    def keys_of(self, role: str, workflow) -> list[AllocKey]:
        keys = [self.canonical[role]] + [self.mfc_keys[m.name] for m in workflow.mfcs_of_role(role)]
        return sorted(set(keys))


class DeviceWorker:
    """The roles on one device, in every layout the plan gives them here, and the MFC calls run on them."""

    def __init__(self, rank: int, world: int, cfg: TrainConfig):
        self.rank, self.world, self.cfg = rank, world, cfg
        quiet_libraries()
        threads = cfg.runtime.threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        self.device = common.resolve_device(cfg.runtime.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = common.resolve_dtype(cfg.runtime.precision, self.device)
        """The run's weight type: that of every copy a reallocation fills (FSDP keeps fp32 shards)."""

    def pid(self) -> int:
        return os.getpid()

    def setup(self, master_addr: str, master_port: int, placement: RuntimePlacement) -> dict:
        """Join the process group, build and shard this device's models, create every communicator."""
        from loomrl.train.rl import build_role_model, make_role  # the reference executor's builders

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=self.cfg.runtime.timeout_s))
        self.placement = placement
        all_keys = list(placement.mfc_keys.values()) + list(placement.canonical.values())
        self.groups = AllocationGroups(self.rank, all_keys, self.device.type)
        self.tokenizer = common.tokenizer_for(self.cfg.actor.model)
        self.task = common.build_task(self.cfg.task)
        self.workflow = build_workflow(self.cfg.algo, self.cfg.rollout)
        self.decode = partial(common.decode_response, self.tokenizer)
        trained = {m.role for m in self.workflow if m.kind == MFCKind.TRAIN}
        self.roles: dict[tuple[str, AllocKey], Any] = {}
        self.views: dict[tuple[str, AllocKey], frozenset[str]] = {}
        """Parameters of a role's copy bound to views of its training shards here (see :meth:`reallocate`)."""
        for role in self.workflow.roles():
            for key in placement.keys_of(role, self.workflow):
                if key in self.groups:
                    model = build_role_model(self.cfg, role, self.tokenizer, self.device)
                    model, pipeline = self._parallelize(role, key, model)
                    if role in trained and key != placement.canonical[role] and model is not None:
                        _own_storage(model)  # a copy that is freed and refilled every iteration
                    trainable = role in trained and key == placement.canonical[role]
                    zero_group = self.groups[key].dp_group if trainable and role in placement.zero and key.dp > 1 \
                        else None
                    self.roles[(role, key)] = make_role(self.cfg, role, model, self.task, trainable, zero_group)
                    self.roles[(role, key)].pipeline = pipeline
        # Offloading to host memory frees device memory only where the device is not the host itself.
        self.host_copies = {} if self.device.type == "cpu" else {
            (role, key): HostCopy(handle.model) for (role, key), handle in self.roles.items()
            if role in placement.offloaded and handle.model is not None}
        for copy in self.host_copies.values():
            copy.release()
        # Creating groups is collective: every rank builds every transfer's broadcast groups, in order.
        self.bcast = [build_broadcast_groups(plan) for _, _, _, plan in placement.reallocs]
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device)}

    def _parallelize(self, role: str, key: AllocKey, model: torch.nn.Module | None):
        """Shard a freshly built model for allocation ``key`` (before any optimizer sees its parameters);
        returns the model this device keeps and, for pipeline stages, the runner that drives them.

        pp > 1 keeps this device's stage (its layers, and the embedding / head where they live); tp > 1 then
        shards what is kept over the TP ranks of the stage, so a pp×tp device holds one TP slice of one stage.
        An FSDP allocation (pp = 1) then shards each TP slice over the data-parallel ranks (FSDP2 on the dp
        dimension of the dp × tp mesh).
        """
        if model is None:
            return None, None
        check_layout(key.layout, model.config, len(key.devices), where=f"runtime.plan ({role})")
        groups = self.groups[key]
        stage = split_stages(model, groups.pp_rank, key.pp) if key.pp > 1 else None
        if key.tp > 1:
            apply_tensor_parallel(model, groups.tp_mesh)
        if key.fsdp:
            return apply_fsdp(model, groups.dp_mesh, self.dtype), None
        if stage is None:
            return model, None
        return stage.model, PipelineRunner(stage, groups.pp_group, groups.pp_rank, key.pp)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    # -------------------------------------------------------------------------------------- MFC calls
    def run_mfc(self, call: MFCCall) -> dict:
        mfc = self.workflow[call.mfc]
        start = time.time()
        offloaded = self.host_copies.get((mfc.role, self.placement.mfc_keys[mfc.name]))
        try:
            shards = _get(list(call.inputs))
            batch = gather_rows(shards, call.sample_ids, mfc.inputs)
            if not call.sample_ids and mfc.kind != MFCKind.TRAIN:
                out = {}  # a replica given no rows computes nothing (train calls still join the step's collectives)
            else:
                if offloaded is not None:
                    offloaded.restore()
                out = mfc.op(self._context(mfc, call), batch)
                if offloaded is not None:
                    offloaded.release()
        except Exception as exc:
            raise WorkerError(f"worker {self.rank} failed in MFC '{mfc.name}' (role {mfc.role}): "
                              f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from None
        stats = out.pop("stats", {}) if mfc.kind == MFCKind.TRAIN else {}
        meta: dict[str, Any] = {"start": start, "end": time.time(), "rank": self.rank}
        if call.publish:
            meta["stats"] = stats
            if out:
                meta["shard"] = (_put(Batch(call.sample_ids, out)),)
            if "response_ids" in out:  # token counts steer the controller's balancing and train schedules
                meta["tokens"] = {sid: len(r) for sid, r in zip(call.sample_ids, out["response_ids"])}
        return meta

    def _context(self, mfc, call: MFCCall) -> OpContext:
        key = self.placement.mfc_keys[mfc.name]
        role = self.roles[(mfc.role, key)] if mfc.role is not None else None
        sync = None
        if mfc.kind == MFCKind.TRAIN and key.dp > 1 and not key.fsdp:  # FSDP reduce-scatters in the backward
            sync = partial(sync_gradients, dp_group=self.groups[key].dp_group)
        tok = self.tokenizer
        return OpContext(role, self.cfg.seed, call.iteration, tok.pad_token_id, tok.eos_token_id, self.decode,
                         train_steps=call.train_steps, sync_grads=sync,
                         micro_batches=self.placement.mfc_micro_batches.get(mfc.name, 1),
                         recompute=mfc.name in self.placement.mfc_recompute,
                         lockstep=mfc.kind == MFCKind.TRAIN and key.fsdp and key.dp > 1)

    def reallocate(self, index: int) -> dict:
        """Move a role's weights from its canonical layout to another (every source and destination calls)."""
        start = time.time()
        role, src, dst, plan = self.placement.reallocs[index]
        src_role, dst_role = self.roles.get((role, src)), self.roles.get((role, dst))
        dtype = self.dtype  # FSDP's fp32 shards are rounded to the copy's type (a no-op otherwise)
        src_tensors = {n: local_shard(p).detach().to(dtype) for n, p in src_role.model.named_parameters()} \
            if src_role else {}
        # the transfer writes straight into the copy's parameters, taking back their memory if freed; a shard
        # that is a contiguous span of the training shard here becomes a view of it instead (no copy, no memory)
        views = {n for n, _ in dst_role.model.named_parameters() if plan.aliased(self.rank, n)} if dst_role else set()
        targets = None if dst_role is None else {n: reclaim(p) for n, p in dst_role.model.named_parameters()
                                                 if n not in views}
        out = execute_reallocation(plan, src_tensors, self.rank, groups=self.bcast[index], dtypes=dtype,
                                   device=self.device, verify=self.cfg.runtime.verify_reallocation, out=targets)
        if views:
            params = dict(dst_role.model.named_parameters())
            for name in views:
                bind_view(params[name], out[name])
            self.views[(role, dst)] = frozenset(views)
        return {"start": start, "end": time.time(), "rank": self.rank}

    def free_view(self, role: str, key: AllocKey) -> dict:
        """Release a trained role's copy in a non-training layout after its last use in an iteration: going back
        to the training layout is a free, not a copy (the next reallocation refills it)."""
        handle = self.roles.get((role, key))
        if handle is not None:
            release_storage(handle.model, self.views.get((role, key), frozenset()))
        return {"rank": self.rank}

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters this device holds per (role, allocation), e.g. to see freed copies."""
        report = {}
        for (role, key), handle in self.roles.items():
            if handle.model is not None:
                views = self.views.get((role, key), frozenset())  # storage of the training copy
                held = sum(local_shard(p).untyped_storage().size() for n, p in handle.model.named_parameters()
                           if n not in views)
                report[f"{role}@{key.devices}:dp{key.dp}tp{key.tp}pp{key.pp}{'fsdp' * key.fsdp}"] = held
        return report

    def metrics(self, sample_ids: Sequence[int], inputs: Sequence[Any]) -> dict[str, float]:
        shards = _get(list(inputs))
        keys = ("prompt_ids", "response_ids", "prompt_text", "answer", "score", "kl")
        return rollout_metrics(gather_rows(shards, sample_ids, keys), self.decode, self.task)

    def evaluate(self, examples: Sequence, key: AllocKey, publish: bool) -> dict[str, float] | None:
        """Greedy evaluation of this worker's share with the actor in allocation ``key``; sums."""
        model = self.roles[("actor", key)].model
        out = evaluate_policy(model, self.tokenizer, self.task, examples, self.cfg.rollout.max_new_tokens) \
            if examples else {"exact_match": 0.0, "score": 0.0}
        return {k: v * len(examples) for k, v in out.items()} if publish else None

    # ----------------------------------------------------------------------------------- checkpoints
    def export_role(self, role: str) -> dict:
        """Full weights and optimizer state of a trained role (collective over its canonical mesh); the mesh's
        first device publishes them for the checkpoint writer."""
        key = self.placement.canonical[role]
        handle = self.roles[(role, key)]
        weights = full_state_dict(handle.model)
        optim = FullOptimizerState(handle.model, handle.optimizer).state_dict()
        if key.fsdp:  # its fp32 shards are the master weights of a 16-bit run
            weights, optim = with_masters(weights, optim, self.dtype)
        pp_rank, dp_rank, tp_rank = key.coords(self.rank)
        if dp_rank or tp_rank:  # one device per pipeline stage publishes that stage's part
            return {}
        model_cls = type(handle.model)
        return {"state": (_put({"weights": weights, "optim": optim, "cls": model_cls,
                                "config": handle.model.config}),)}

    def save(self, run_dir: str, iteration: int, state: dict, keep_last: int, exports: dict) -> str:
        """Write the checkpoint from the roles' exported states (this worker need not hold any of them)."""
        models, optims = {}, {}
        for role, refs in exports.items():
            parts = _get([ref[0] for ref in refs])  # one per pipeline stage
            weights = {k: v for part in parts for k, v in part["weights"].items()}
            models[role] = _plain_copy(parts[0]["cls"], parts[0]["config"], weights)
            optims[role] = FullOptimizerState(models[role], None, gathered=merge_optimizer_states(
                [part["optim"] for part in parts]))
        return str(save_checkpoint(Path(run_dir), iteration, models, self.tokenizer, optims, state,
                                   keep_last=keep_last))

    def load(self, path: str) -> dict:
        """Every holder of a trained role's canonical weights loads them (and its optimizer state)."""
        trained = {m.role for m in self.workflow if m.kind == MFCKind.TRAIN}
        mine = {role: self.roles[(role, key)] for role, key in self.placement.canonical.items()
                if role in trained and (role, key) in self.roles}
        return load_checkpoint(Path(path), {n: r.model for n, r in mine.items()},
                               {n: FullOptimizerState(r.model, r.optimizer) for n, r in mine.items()},
                               restore_rng=self.rank == 0)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


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

