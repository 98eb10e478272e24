"""Running pipeline stages together: GPipe micro-batch schedules over point-to-point sends, and global clipping.

Every rank of a pipeline group holds one :class:`~loomrl.parallel.pipeline.PipelineStage` and calls the same
:class:`PipelineRunner` method with the same rows at the same time (all stages need the attention mask; only
stage 0 needs the token ids). Rows are cut into contiguous micro-batches (:func:`micro_batch_slices`); stage
``r`` receives a micro-batch's hidden states from ``r-1``, runs its layers and sends the result to ``r+1``.

Schedule: GPipe. Training runs every micro-batch forward, then every backward in reverse order; the last stage
back-propagates ``loss_fn`` of each micro-batch, earlier stages back-propagate the gradient received for their
output, and each stage sends the gradient of its input to the previous one. Gradients accumulate in the
parameters exactly as one backward of the summed micro-batch losses would. GPipe keeps every micro-batch's
activations until the backward phase (as the unpipelined full-batch step does); 1F1B would bound that by the
number of stages, and is not built.

With tensor parallelism too (pp×tp), each TP rank of a stage runs its own runner whose ``pp_group`` is the line
of the mesh through the same TP (and DP) rank of every stage: the hidden states and their gradients are the
replicated residual stream, identical on every TP rank of a stage, so TP rank t of stage r exchanges them with TP
rank t of stages r ± 1 only, and the TP collectives stay inside each stage.

Messages between two neighbours always flow in one order (forwards up, then backwards down), so blocking
``send``/``recv`` cannot deadlock, on gloo or nccl alike. Each tensor is preceded by a small header (dtype and
shape): sequence lengths change from call to call, and a header that disagrees with what the receiver expects
turns a batch mismatch between ranks into an error instead of garbage.

Legend: B rows, L tokens per row, H hidden size, V vocabulary, M micro-batches.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loomrl.parallel.pipeline import PipelineStage

LossFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(last-stage output of micro-batch k, k) → scalar loss of that micro-batch."""

OutputFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(last-stage output of micro-batch k, k) → what to keep of it (e.g. log-probs instead of B×L×V logits)."""

# Dtypes a header can name; hidden states, gradients and results are floating point.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 4
_HEADER = 2 + _MAX_DIMS  # dtype code, ndim, shape padded with zeros


def micro_batch_slices(rows: int, micro_batches: int) -> list[slice]:
    """Contiguous row ranges of ``micro_batches`` near-equal micro-batches (sizes differ by at most one)."""
    if not 1 <= micro_batches <= rows:
        raise ValueError(f"micro_batches must be between 1 and the number of rows ({rows}), got {micro_batches}")
    base, extra = divmod(rows, micro_batches)
    slices, start = [], 0
    for k in range(micro_batches):
        stop = start + base + (1 if k < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices


class PipelineRunner:
    """GPipe inference and training of one stage, in step with the other ranks of ``pp_group``."""

    def __init__(self, stage: PipelineStage, pp_group: dist.ProcessGroup | None, pp_rank: int, pp_size: int):
        """``pp_group`` may be None only when ``pp_size`` is 1 (nothing is communicated then)."""
        if (stage.pp_rank, stage.pp_size) != (pp_rank, pp_size):
            raise ValueError(f"stage {stage.pp_rank} of {stage.pp_size} given to runner rank {pp_rank} of {pp_size}")
        if pp_size > 1 and (dist.get_rank(pp_group), dist.get_world_size(pp_group)) != (pp_rank, pp_size):
            raise ValueError(f"pipeline rank {pp_rank} of {pp_size} disagrees with the group (rank "
                             f"{dist.get_rank(pp_group)} of {dist.get_world_size(pp_group)})")
        self.stage, self.group = stage, pp_group
        self.pp_rank, self.pp_size = pp_rank, pp_size

    # ------------------------------------------------------------------------------------------ inference
    @torch.no_grad()
    def forward(self, input_ids_BL: torch.Tensor | None, attention_mask_BL: torch.Tensor, micro_batches: int = 1,
                *, position_ids_BL: torch.Tensor | None = None, output_fn: OutputFn | None = None,
                broadcast_result: bool = False) -> torch.Tensor | None:
        """The last stage's output for all rows (logits B×L×V, values B×L, or ``output_fn`` of each micro-batch,
        concatenated over rows) on the last stage, None elsewhere; on every stage with ``broadcast_result``.

        ``input_ids_BL`` may be None except on stage 0. ``output_fn`` runs on the last stage only, per
        micro-batch, so large logits never need to exist for the whole batch nor travel.
        """
        batch, slices = self._prepare(input_ids_BL, attention_mask_BL, position_ids_BL, micro_batches)
        kept: list[torch.Tensor] = []
        for k, rows in enumerate(slices):
            _, out = self._forward_micro_batch(batch, rows)
            if self.stage.is_last:
                kept.append(output_fn(out, k) if output_fn is not None else out)
        result = torch.cat(kept) if self.stage.is_last else None
        return self._broadcast(result) if broadcast_result else result

    # ------------------------------------------------------------------------------------------- training
    def train_step_backward(self, input_ids_BL: torch.Tensor | None, attention_mask_BL: torch.Tensor,
                            loss_fn: LossFn, micro_batches: int = 1, *, position_ids_BL: torch.Tensor | None = None,
                            broadcast_result: bool = False) -> float:
        """Forward and backward of every micro-batch (GPipe); gradients accumulate into the stage's parameters.

        The last stage calls ``loss_fn(output, k)`` for micro-batch ``k`` (rows ``micro_batch_slices(B, M)[k]``)
        and back-propagates it; scale each micro-batch's loss so that their SUM is the loss you mean. Returns the
        summed loss on the last stage, 0.0 on the others, or the sum everywhere with ``broadcast_result``.
        The caller zeroes gradients, clips (:func:`clip_grad_norm_pp`) and steps.
        """
        batch, slices = self._prepare(input_ids_BL, attention_mask_BL, position_ids_BL, micro_batches)
        saved = [self._forward_micro_batch(batch, rows, requires_grad=True) for rows in slices]
        total = torch.zeros((), dtype=torch.float64, device=self.stage.device)
        for k in reversed(range(len(slices))):
            x, y = saved[k]
            saved[k] = None  # drop this micro-batch's graph as soon as it has been back-propagated
            if self.stage.is_last:
                loss = loss_fn(y, k)
                if loss.dim() != 0:
                    raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
                loss.backward()
                total += loss.detach().double()
            else:
                grad = self._recv(self.pp_rank + 1, expected=tuple(y.shape))
                torch.autograd.backward(y, grad)
            if not self.stage.is_first:
                self._send(x.grad if x.grad is not None else torch.zeros_like(x), self.pp_rank - 1)
        if broadcast_result:
            total = self._broadcast(total if self.stage.is_last else None)
        return float(total)

    # ------------------------------------------------------------------------------------------ internals
    def _prepare(self, input_ids_BL: torch.Tensor | None, attention_mask_BL: torch.Tensor,
                 position_ids_BL: torch.Tensor | None, micro_batches: int
                 ) -> tuple[tuple[torch.Tensor | None, ...], list[slice]]:
        """The batch on the stage's device, and the micro-batches' row ranges."""
        if self.stage.is_first and input_ids_BL is None:
            raise ValueError("the first pipeline stage needs input_ids")
        device = self.stage.device
        batch = tuple(None if t is None else t.to(device) for t in (input_ids_BL, attention_mask_BL, position_ids_BL))
        return batch, micro_batch_slices(attention_mask_BL.shape[0], micro_batches)

    def _forward_micro_batch(self, batch: tuple[torch.Tensor | None, ...], rows: slice,
                             requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(this stage's input, its output) for ``rows``; receives the input from and sends the output onward."""
        ids_BL, mask_BL, pos_BL = batch
        if self.stage.is_first:
            x = ids_BL[rows]
        else:
            x = self._recv(self.pp_rank - 1, expected=(rows.stop - rows.start, mask_BL.shape[1],
                                                        self.stage.hidden_size))
            x.requires_grad_(requires_grad)  # its gradient is what the previous stage back-propagates
        y = self.stage.forward(x, mask_BL[rows], None if pos_BL is None else pos_BL[rows])
        if not self.stage.is_last:
            self._send(y.detach(), self.pp_rank + 1)
        return x, y

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        dist.send(_header(tensor, self.stage.device), group=self.group, group_dst=to)
        dist.send(tensor.contiguous(), group=self.group, group_dst=to)

    def _recv(self, source: int, expected: tuple[int, ...]) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.stage.device)
        dist.recv(header, group=self.group, group_src=source)
        dtype, shape = _decode(header)
        if shape != expected:
            raise RuntimeError(f"pipeline stage {self.pp_rank}: got a tensor of shape {shape} from stage {source}, "
                               f"expected {expected} (do all stages have the same rows?)")
        tensor = torch.empty(shape, dtype=dtype, device=self.stage.device)
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor

    def _broadcast(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage (header first: only the last stage knows its shape)."""
        if self.pp_size == 1:
            return tensor
        last, device = self.pp_size - 1, self.stage.device
        header = _header(tensor, device) if tensor is not None else torch.empty(_HEADER, dtype=torch.int64,
                                                                               device=device)
        dist.broadcast(header, group=self.group, group_src=last)
        dtype, shape = _decode(header)
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor.contiguous(), group=self.group, group_src=last)
        return tensor


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise TypeError(f"pipeline messages carry floating tensors of at most {_MAX_DIMS} dims, "
                        f"got {tensor.dtype} of shape {tuple(tensor.shape)}")
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64, device=device)


def _decode(header: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    code, ndim, *shape = header.tolist()
    return _DTYPES[code], tuple(shape[:ndim])


@torch.no_grad()
def clip_grad_norm_pp(stage: PipelineStage, max_norm: float, pp_group: dist.ProcessGroup | None,
                      eps: float = 1e-6) -> float:
    """Clip the whole model's gradients (all stages) to ``max_norm``; returns the global norm before clipping.

    Every stage all-reduces the sum of its squared gradient norm over ``pp_group``, so all stages compute the
    same norm and scale factor as ``torch.nn.utils.clip_grad_norm_`` over the unsplit model would. Call it on
    every stage (it is a collective), after any data-parallel gradient sum. DTensor (tensor-parallel)
    gradients count with their full norm: a stage's norm is first completed over its TP group (a sharded
    gradient's pieces summed once, a replicated one counted once), so every TP rank of a stage holds the same
    stage norm and the sum over ``pp_group`` (one TP rank per stage) counts each stage once. With pp×tp the
    call is also collective over each stage's TP group.
    """
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if isinstance(local, DTensor):
        local = local.full_tensor()
    squared = local.to(device=stage.device, dtype=torch.float64) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    total = math.sqrt(float(squared))
    coef = max_norm / (total + eps)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
