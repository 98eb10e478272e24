"""One device's worker: the shards of every role placed on the device, and the MFC calls run on them.

A plain class, so tests can build it without Ray; :mod:`loomrl.runtime.ray_executor` wraps it as one Ray actor
per device. The worker builds its roles itself from the run's config (same seed, so data-parallel replicas
start identical), applies each role's tensor-parallel layout, and runs the workflow's MFC functions on the
rows the controller assigns it. Inputs arrive as Ray object references to other workers' output shards, and
outputs leave the same way: the controller sees references and scalars, never tokens.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
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
from loomrl.parallel import Layout, ProcessGroups, apply_tensor_parallel, check_layout, sync_gradients
from loomrl.runtime.state_io import FullOptimizerState, full_model_state
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
    """
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
    """The roles on one device and the MFC calls that run on them."""

    def __init__(self, rank: int, world: int, cfg: TrainConfig):
        self.rank, self.world, self.cfg = rank, world, cfg
        quiet_libraries()
        threads = cfg.runtime.threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        self.device = common.resolve_device(cfg.runtime.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def pid(self) -> int:
        return os.getpid()

    def setup(self, master_addr: str, master_port: int, layouts: dict[str, Layout]) -> dict:
        """Join the process group, build the roles and shard them; returns parameter counts."""
        from loomrl.train.rl import build_roles  # the same builder the reference executor uses

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=self.cfg.runtime.timeout_s))
        self.groups = ProcessGroups(self.rank, self.world, layouts, self.device.type)
        self.tokenizer = common.tokenizer_for(self.cfg.actor.model)
        self.task = common.build_task(self.cfg.task)
        self.roles = build_roles(self.cfg, self.tokenizer, self.task, self.device, parallelize=self._parallelize)
        self.workflow = build_workflow(self.cfg.algo, self.cfg.rollout)
        self.decode = partial(common.decode_response, self.tokenizer)
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device)}

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def _parallelize(self, name: str, model: torch.nn.Module) -> None:
        groups = self.groups[name]
        check_layout(groups.layout, model.config, self.world, where=f"runtime.layouts.{name}")
        if groups.tp_size > 1:
            apply_tensor_parallel(model, groups.tp_mesh)

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    # -------------------------------------------------------------------------------------- MFC calls
    def run_mfc(self, call: MFCCall) -> dict:
        mfc = self.workflow[call.mfc]
        start = time.time()
        try:
            shards = _get(list(call.inputs))
            batch = gather_rows(shards, call.sample_ids, mfc.inputs)
            out = mfc.op(self._context(mfc, call), batch)
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
        role = self.roles[mfc.role] if mfc.role is not None else None
        sync = None
        if mfc.kind == MFCKind.TRAIN and self.groups[mfc.role].dp_size > 1:
            sync = partial(sync_gradients, dp_group=self.groups[mfc.role].dp_group)
        tok = self.tokenizer
        return OpContext(role, self.cfg.seed, call.iteration, tok.pad_token_id, tok.eos_token_id, self.decode,
                         train_steps=call.train_steps, sync_grads=sync)

    def metrics(self, sample_ids: Sequence[int], inputs: Sequence[Any]) -> dict[str, float]:
        shards = _get(list(inputs))
        keys = ("response_ids", "prompt_text", "answer", "score", "kl")
        return rollout_metrics(gather_rows(shards, sample_ids, keys), self.decode, self.task)

    def evaluate(self, examples: Sequence, publish: bool) -> dict[str, float] | None:
        """Greedy evaluation of this worker's share; returns sums (only from publishing ranks)."""
        out = evaluate_policy(self.roles["actor"].model, self.tokenizer, self.task, examples,
                              self.cfg.rollout.max_new_tokens) if examples else {"exact_match": 0.0, "score": 0.0}
        return {k: v * len(examples) for k, v in out.items()} if publish else None

    def save(self, run_dir: str, iteration: int, state: dict, keep_last: int) -> str | None:
        """Gather full weights and optimizer states (collectives on every rank); rank 0 writes the checkpoint."""
        models, optims = {}, {}
        for name, role in self.roles.items():
            if role.optimizer is None:
                continue
            weights = full_model_state(role.model)
            optims[name] = FullOptimizerState(role.model, role.optimizer,
                                              gathered=FullOptimizerState(role.model, role.optimizer).state_dict())
            if self.rank == 0:
                models[name] = role.model if self.groups[name].tp_size == 1 else _plain_copy(role.model, weights)
        path = None
        if self.rank == 0:
            path = str(save_checkpoint(Path(run_dir), iteration, models, self.tokenizer, optims, state,
                                       keep_last=keep_last))
        dist.barrier()
        return path

    def load(self, path: str) -> dict:
        trainable = {n: r for n, r in self.roles.items() if r.optimizer is not None}
        return load_checkpoint(Path(path), {n: r.model for n, r in trainable.items()},
                               {n: FullOptimizerState(r.model, r.optimizer) for n, r in trainable.items()},
                               restore_rng=self.rank == 0)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _plain_copy(model, weights: dict[str, torch.Tensor]):
    """An unsharded CPU copy of a tensor-parallel model holding its full weights (for save_pretrained)."""
    plain = type(model)(model.config)
    plain.load_state_dict(weights)
    return plain


def _get(ref):
    import ray

    return ray.get(ref)


def _put(value):
    import ray

    return ray.put(value)
