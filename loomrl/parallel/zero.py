"""ZeRO stage 1 and mixed precision: AdamW whose fp32 state is sharded over the data-parallel group.

Plain data parallelism replicates the optimizer state: every rank keeps Adam's two fp32 moments of every
parameter (8 bytes each, as much as four bf16 copies of the weights), and under bf16 mixed precision an fp32
master copy of the weights too (4 more bytes: the update is applied to it, as rounding each update into bf16
would lose the small ones). Under ZeRO-1 rank r of a data-parallel group of n keeps that state only for chunk
r of every parameter's flat local tensor (``torch.chunk``'s split), updates only that chunk, and the updated
chunks are all-gathered so that every rank holds the new weights again. Weights and gradients stay whole on
every rank, exactly as without ZeRO: the gradients are still summed over the group first
(:func:`loomrl.parallel.sync_gradients`), so clipping and everything before the step are unchanged. Adam's
update is elementwise, so the result equals the unsharded AdamW's. Without a group (``dp_group=None``) the
one rank owns every chunk: that is how a bf16 model without ZeRO gets its master weights.

For fp32 weights the chunks are the parameters' own memory: torch's AdamW runs over leaf tensors that view
each chunk (they share its storage), so its arithmetic is the library's and its in-place update lands in the
model. For 16-bit weights each chunk's leaf is an fp32 master copy instead, its gradient the 16-bit gradient
chunk in fp32, and after the update the master chunk is rounded into the weights (as Megatron's and
DeepSpeed's mixed-precision optimizers do). A tensor-parallel (DTensor) parameter is chunked within its local
tensor (its gradient first brought to the parameter's placements: a replicated parameter's gradient may be a
partial sum), a pipeline stage chunks its own parameters. Checkpoints hold the full, name-keyed state, the
form ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives for the unsharded optimizer
(:meth:`ZeroAdamW.full_state_dict`, :meth:`ZeroAdamW.load_full_state_dict`), plus each parameter's
``master`` weights when they are kept, so any layout resumes them exactly.

Traffic per step: the weights' all-gather on top of the gradient all-reduce. DeepSpeed's ZeRO-1 reduce-scatters
the gradients instead of all-reducing them, saving that much again; it is not done here because clipping
would then need the norm of gradients sharded differently from the parameters' DTensor layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from loomrl.parallel.data_parallel import DEFAULT_BUCKET_BYTES, buckets, local_shard
from loomrl.parallel.main_grad import clear_grad, grad_of
from loomrl.plan.shards import chunk

__all__ = ["MASTER", "ZeroAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_STATE_DTYPE = torch.float32
"""Adam's moments and master weights."""
MASTER = "master"
"""Key of a parameter's fp32 master weights in the full optimizer state (16-bit weights only)."""


class ZeroAdamW:
    """AdamW over ``named_params`` with its state sharded over ``dp_group`` (see the module docstring), and
    fp32 master weights for parameters of a 16-bit dtype.

    Duck-types the parts of ``torch.optim.Optimizer`` the training loop uses (``zero_grad``, ``step``,
    ``param_groups``); every rank of ``dp_group`` must call :meth:`step` together (it all-gathers). With
    ``dp_group=None`` this rank keeps the whole state and nothing is communicated."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        dp_group: dist.ProcessGroup | None,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self.group = dp_group
        self.rank, self.size = (0, 1) if dp_group is None else (dist.get_rank(dp_group), dist.get_world_size(dp_group))
        self.params = [(name, p) for name, p in named_params if p.requires_grad]
        self.bucket_bytes = bucket_bytes
        self._flats = [_flat(name, p) for name, p in self.params]
        self._spans = [chunk(flat.numel(), self.size, self.rank) for flat in self._flats]  # this rank's chunks
        # the leaf tensors AdamW updates, one per chunk (None where this rank's chunk is empty): views sharing
        # the fp32 weights' storage, or fp32 master copies of 16-bit weights
        self._shards = [
            nn.Parameter(_master_of(flat[lo:hi])) if hi > lo else None
            for flat, (lo, hi) in zip(self._flats, self._spans)
        ]
        self._device = self._flats[0].device if self._flats else torch.device("cpu")
        owned = [s for s in self._shards if s is not None]
        # the inner optimizer needs at least one tensor: a rank owning no chunk gets an inert empty one
        self.inner = torch.optim.AdamW(
            owned or [nn.Parameter(torch.zeros(0))], lr=lr, betas=betas, weight_decay=weight_decay
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.params:
            if set_to_none:
                clear_grad(p)
            elif grad_of(p) is not None:
                grad_of(p).zero_()
        for shard in self._shards:
            if shard is not None:
                shard.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's chunk of every parameter that has a gradient (its master copy, then the weights
        rounded from it), then all-gather the chunks."""
        self._attach_grads()
        self.inner.step()
        for flat, (lo, hi), shard in zip(self._flats, self._spans, self._shards):
            if shard is not None and shard.grad is not None and not _shares_storage(flat, shard):
                flat[lo:hi].copy_(shard)
        self._all_gather(self._flats)

    def _attach_grads(self) -> None:
        for (name, p), (lo, hi), shard in zip(self.params, self._spans, self._shards):
            if shard is not None:
                grad = grad_of(p)
                grad = None if grad is None else _flat(name, _laid_out_like(p, grad))[lo:hi]
                shard.grad = None if grad is None else grad.to(shard.dtype)

    def _all_gather(self, flats: list[torch.Tensor]) -> None:
        """Every rank's chunk of each of ``flats`` into every rank's copy, a bucket of tensors per collective."""
        if self.size == 1:
            return
        chunk_bytes = lambda f: -(-f.numel() // self.size) * f.element_size()  # noqa: E731
        for bucket in buckets(flats, self.bucket_bytes, chunk_bytes):
            sizes = [-(-f.numel() // self.size) for f in bucket]  # chunk length (the last ones may be shorter)
            mine = torch.zeros(sum(sizes), dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for f, size in zip(bucket, sizes):
                lo, hi = chunk(f.numel(), self.size, self.rank)
                mine[offset : offset + hi - lo] = f[lo:hi]
                offset += size
            gathered = [torch.empty_like(mine) for _ in range(self.size)]
            dist.all_gather(gathered, mine, group=self.group)
            for r, part in enumerate(gathered):
                if r == self.rank:
                    continue
                offset = 0
                for f, size in zip(bucket, sizes):
                    lo, hi = chunk(f.numel(), self.size, r)
                    f[lo:hi] = part[offset : offset + hi - lo]
                    offset += size

    # ------------------------------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, keyed by parameter name, as full (unsharded) CPU tensors. Collective over
        the data-parallel group (and each DTensor's mesh)."""
        has_state = [shard is not None and shard in self.inner.state for shard in self._shards]
        flags = torch.tensor(has_state, dtype=torch.int32, device=self._device)  # NCCL reduces device tensors
        self._all_reduce_max(flags)
        state: dict[str, dict[str, torch.Tensor]] = {}
        stepped = [(i, name, p) for i, ((name, p), flag) in enumerate(zip(self.params, flags.tolist())) if flag]
        steps = self._step_counts([i for i, _, _ in stepped])
        for key in (*_MOMENTS, MASTER):
            kept = [(i, name, p) for i, name, p in stepped if key != MASTER or self._flats[i].dtype != _STATE_DTYPE]
            locals_ = [torch.zeros_like(self._flats[i], dtype=_STATE_DTYPE) for i, _, _ in kept]
            for (i, _, _), buffer in zip(kept, locals_):
                shard = self._shards[i]
                if shard is not None and shard in self.inner.state:
                    lo, hi = self._spans[i]
                    buffer[lo:hi] = shard.detach() if key == MASTER else self.inner.state[shard][key]
            self._all_gather(locals_)
            for (i, name, p), buffer in zip(kept, locals_):
                full = _full(p, buffer.view(local_shard(p.detach()).shape))
                state.setdefault(name, {"step": steps[i]})[key] = full.detach().cpu()
        group = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": [name for name, _ in self.params]}]}

    def _step_counts(self, indices: list[int]) -> dict[int, torch.Tensor]:
        """Optimizer steps each of these parameters has taken (all chunks of one step together; the ranks owning
        none of a parameter learn it from the others), as float32 scalars like AdamW's."""
        counts = torch.zeros(len(indices), dtype=torch.float64, device=self._device)
        for k, i in enumerate(indices):
            shard = self._shards[i]
            if shard is not None and shard in self.inner.state:
                counts[k] = float(self.inner.state[shard]["step"])
        self._all_reduce_max(counts)
        return {i: torch.tensor(float(c), dtype=torch.float32) for i, c in zip(indices, counts.tolist())}

    def _all_reduce_max(self, tensor: torch.Tensor) -> None:
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Take this rank's chunks of a full, name-keyed state (:meth:`full_state_dict`'s form; parameters it
        does not name start fresh). Master weights come from the state's ``master`` entries, or, where it has
        none (a state saved by an fp32 run, a parameter never stepped), from the weights as they are now: load
        the weights first. No communication: every rank reads the whole state."""
        groups = full.get("param_groups") or [{}]
        for key, value in groups[0].items():
            if key != "params":
                self.inner.param_groups[0][key] = value
        for (name, p), flat, (lo, hi), shard in zip(self.params, self._flats, self._spans, self._shards):
            saved = full["state"].get(name)
            if shard is None:
                continue
            if not _shares_storage(flat, shard):
                master = flat if saved is None or MASTER not in saved else _local_of(p, saved[MASTER]).reshape(-1)
                with torch.no_grad():
                    shard.copy_(master[lo:hi])
            if saved is None:
                continue
            entry = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).clone()}
            for key in _MOMENTS:
                local = _local_of(p, saved[key])
                entry[key] = local.reshape(-1)[lo:hi].to(device=flat.device, dtype=shard.dtype).clone()
            self.inner.state[shard] = entry

    # ------------------------------------------------------------------------------------------ plan changes
    def named_state(self, key: str) -> dict[str, torch.Tensor]:
        """This rank's chunk of every parameter's ``key`` state (``exp_avg``, ``exp_avg_sq`` or ``master``), as
        1-D fp32 tensors keyed by parameter name, for the parameters it owns a chunk of (and, but for the
        master weights, that have stepped). The master weights of fp32 parameters are the weights themselves."""
        out = {}
        for (name, _), shard in zip(self.params, self._shards):
            if shard is None:
                continue
            if key == MASTER:
                out[name] = shard.detach()
            elif shard in self.inner.state:
                out[name] = self.inner.state[shard][key]
        return out

    def named_steps(self) -> dict[str, float]:
        """Optimizer steps taken by each parameter this rank owns a stepped chunk of (a sharded checkpoint's
        record of them; a rank owning none of a parameter leaves it to the others)."""
        return {
            name: float(self.inner.state[shard]["step"])
            for (name, _), shard in zip(self.params, self._shards)
            if shard is not None and shard in self.inner.state
        }

    def init_state(self, step: int) -> None:
        """Zero moments at ``step`` optimizer steps for every chunk this rank owns: the tensors a moved state is
        written into."""
        for shard in self._shards:
            if shard is not None:
                self.inner.state[shard] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),
                    **{k: torch.zeros_like(shard) for k in _MOMENTS},
                }

    def steps_taken(self) -> int:
        """Optimizer steps taken so far (0 before the first; every chunk steps together)."""
        return max((int(st["step"]) for st in self.inner.state.values() if "step" in st), default=0)


def _master_of(chunk_: torch.Tensor) -> torch.Tensor:
    """What AdamW updates for a chunk of the weights: the chunk itself when it is fp32, else an fp32 copy."""
    return chunk_ if chunk_.dtype == _STATE_DTYPE else chunk_.to(_STATE_DTYPE)


def _shares_storage(flat: torch.Tensor, shard: torch.Tensor) -> bool:
    """Whether the updated leaf is the weights' own memory (fp32 weights), not a master copy."""
    return shard.dtype == flat.dtype


def _flat(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of a parameter's (or gradient's) local tensor: the same storage."""
    local = local_shard(tensor.detach())
    if not local.is_contiguous():
        raise ValueError(f"{name}: ZeRO needs a contiguous local tensor, got strides {local.stride()}")
    return local.view(-1)


def _laid_out_like(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient in its parameter's placements: a replicated DTensor parameter's gradient may still be a
    partial sum over the tensor-parallel ranks, which a DTensor optimizer step would reduce on the fly and a
    step over local tensors must reduce first (collective over the mesh)."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _full(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's piece, laid out like ``param`` (collective for a
    DTensor over its mesh)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False).full_tensor()
    return local


def _local_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full tensor laid out like ``param`` (no communication)."""
    full = full.to(local_shard(param.detach()).device)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full
