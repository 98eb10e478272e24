"""Running pipeline stages together: micro-batch schedules over point-to-point sends, and global clipping.

Every rank of a pipeline group holds one :class:`~loomrl.parallel.pipeline.PipelineStage` and calls the same
:class:`PipelineRunner` method with the same rows at the same time (all stages need the attention mask; only
stage 0 needs the token ids). Rows are cut into contiguous micro-batches (:func:`micro_batch_slices`); stage
``r`` receives a micro-batch's hidden states from ``r-1``, runs its layers and sends the result to ``r+1``.

Inference streams the micro-batches through the stages one after another, keeping nothing but the last stage's
outputs. Training runs the 1F1B schedule (PipeDream-flush, as Megatron-LM's non-interleaved pipeline): stage
``r`` of ``P`` runs ``min(P − r − 1, M)`` warm-up forwards, then alternates one forward with one backward, then
drains the remaining backwards; the last stage back-propagates ``loss_fn`` of each micro-batch, earlier stages
the gradient received for their output, and each stage sends the gradient of its input to the previous one.
Gradients accumulate in the parameters as one backward of the summed micro-batch losses would (micro-batches in
order). A stage keeps at most ``P − r`` micro-batches' activations (GPipe, running every forward first, kept all
``M``), with the same bubble of ``P − 1`` slots.

With tensor parallelism too (pp×tp), each TP rank of a stage runs its own runner whose ``pp_group`` is the line
of the mesh through the same TP (and DP) rank of every stage: the hidden states and their gradients are the
replicated residual stream, identical on every TP rank of a stage, so TP rank t of stage r exchanges them with TP
rank t of stages r ± 1 only, and the TP collectives stay inside each stage.

In the steady phase two neighbours send to each other at the same time (an output up, a gradient down): those
pairs travel as one batch of ``isend``/``irecv`` (:meth:`PipelineRunner._exchange`), so neither waits for the
other to receive first (with NCCL a blocking send would deadlock there); the warm-up and drain use blocking
``send``/``recv``, whose order matches the neighbour's, on gloo or nccl alike. Each tensor is preceded by a small
header (dtype and shape): sequence lengths change from call to call, and a header that disagrees with what the
receiver expects turns a batch mismatch between ranks into an error instead of garbage.

A model whose head shares its input embedding keeps the matrix on the first and the last stage
(:mod:`loomrl.parallel.pipeline`): after the backward those two sum its gradient (:meth:`PipelineRunner.
sum_tied_gradient`, over the runner's ``tied_group``), and the global clipping norm counts it once.

Legend: B rows, L tokens per row, H hidden size, V vocabulary, M micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loomrl.parallel.data_parallel import local_shard, reduce_dtype
from loomrl.parallel.main_grad import grad_of, set_grad
from loomrl.parallel.pipeline import PipelineStage
from loomrl.workflow.batch import micro_batch_slices

LossFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(last-stage output of micro-batch k, k) → scalar loss of that micro-batch."""

OutputFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(last-stage output of micro-batch k, k) → what to keep of it (e.g. log-probs instead of B×L×V logits)."""

# Dtypes a header can name; hidden states, gradients and results are floating point.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 4
HEADER_LEN = 2 + _MAX_DIMS  # dtype code, ndim, shape padded with zeros


class PipelineRunner:
    """Pipelined inference and 1F1B training of one stage, in step with the other ranks of ``pp_group``."""

    def __init__(
        self,
        stage: PipelineStage,
        pp_group: dist.ProcessGroup | None,
        pp_rank: int,
        pp_size: int,
        stage_ranks: Sequence[int] | None = None,
        tied_group: dist.ProcessGroup | None = None,
    ):
        """``pp_group`` may be None only when ``pp_size`` is 1 (nothing is communicated then). ``stage_ranks``: the
        global rank holding each stage, in stage order, for a group whose rank order is not the stage order (a
        reversed layout puts stage 0 on the group's last rank); None: stage ``s`` is group rank ``s``.
        ``tied_group``: the first and the last stage's ranks of this line, over which a tied embedding's
        gradient is summed (needed on those two stages of a tied model)."""
        if (stage.pp_rank, stage.pp_size) != (pp_rank, pp_size):
            raise ValueError(f"stage {stage.pp_rank} of {stage.pp_size} given to runner rank {pp_rank} of {pp_size}")
        if stage.tied_weight is not None and tied_group is None:
            raise ValueError(f"pipeline stage {pp_rank} of {pp_size} holds a tied embedding but got no tied_group")
        self.peers = (
            tuple(range(pp_size))
            if stage_ranks is None or pp_size == 1
            else tuple(dist.get_group_rank(pp_group, r) for r in stage_ranks)
        )
        """The ``pp_group`` rank of each stage."""
        if pp_size > 1 and (dist.get_rank(pp_group), dist.get_world_size(pp_group)) != (self.peers[pp_rank], pp_size):
            raise ValueError(
                f"pipeline rank {pp_rank} of {pp_size} disagrees with the group (rank "
                f"{dist.get_rank(pp_group)} of {dist.get_world_size(pp_group)})"
            )
        self.stage, self.group, self.tied_group = stage, pp_group, tied_group
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.peak_in_flight = 0
        """Most micro-batches whose activations the last training step kept at once on this stage."""

    # ------------------------------------------------------------------------------------------ inference
    @torch.no_grad()
    def forward(
        self,
        input_ids_BL: torch.Tensor | None,
        attention_mask_BL: torch.Tensor,
        micro_batches: int = 1,
        *,
        position_ids_BL: torch.Tensor | None = None,
        output_fn: OutputFn | None = None,
        broadcast_result: bool = False,
    ) -> torch.Tensor | None:
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
    @torch.no_grad()
    def sum_tied_gradient(self) -> None:
        """Sum a tied embedding's gradient over the first and the last stage (its lookup's part and its head's),
        in fp32 at least, so both hold the gradient of the one shared matrix of the whole model. Call it on every
        stage after the backward (and any data-parallel sum); a no-op on the others and for untied models. Both
        stages ran the same rows, so both have a gradient or neither has."""
        weight = self.stage.tied_weight
        grad = None if weight is None else grad_of(weight)
        if weight is None or grad is None or self.tied_group is None:
            return
        if isinstance(grad, DTensor) and isinstance(weight, DTensor) and grad.placements != weight.placements:
            # a tensor-parallel lookup's gradient comes out replicated, the head's sharded like the weight:
            # both stages sum the weight's own shard (cutting a replicated tensor communicates nothing)
            grad = grad.redistribute(weight.device_mesh, weight.placements)
            set_grad(weight, grad)
        local = local_shard(grad)
        total = local.to(reduce_dtype(local.dtype))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.tied_group)
        local.copy_(total)

    def train_step_backward(
        self,
        input_ids_BL: torch.Tensor | None,
        attention_mask_BL: torch.Tensor,
        loss_fn: LossFn,
        micro_batches: int = 1,
        *,
        position_ids_BL: torch.Tensor | None = None,
        broadcast_result: bool = False,
    ) -> float:
        """Forward and backward of every micro-batch (1F1B); gradients accumulate into the stage's parameters.

        The last stage calls ``loss_fn(output, k)`` for micro-batch ``k`` (rows ``micro_batch_slices(B, M)[k]``)
        and back-propagates it; scale each micro-batch's loss so that their SUM is the loss you mean. Returns the
        summed loss on the last stage, 0.0 on the others, or the sum everywhere with ``broadcast_result``.
        The caller zeroes gradients, clips (:func:`clip_grad_norm_pp`) and steps.
        """
        batch, slices = self._prepare(input_ids_BL, attention_mask_BL, position_ids_BL, micro_batches)
        count = len(slices)
        warmup = min(self.pp_size - self.pp_rank - 1, count)
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.stage.device)
        self.peak_in_flight = 0

        def forward(k: int, x: torch.Tensor) -> torch.Tensor:
            y = self.stage.forward(x, batch[1][slices[k]], None if batch[2] is None else batch[2][slices[k]])
            saved[k] = x, y
            self.peak_in_flight = max(self.peak_in_flight, len(saved))
            return y

        def backward(k: int, grad: torch.Tensor | None) -> torch.Tensor | None:
            nonlocal total
            x, y = saved.pop(k)  # this micro-batch's graph is dropped once back-propagated
            if self.stage.is_last:
                loss = loss_fn(y, k)
                if loss.dim() != 0:
                    raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
                loss.backward()
                total = total + loss.detach().double()
            else:
                torch.autograd.backward(y, grad)
            if self.stage.is_first:
                return None
            return x.grad if x.grad is not None else torch.zeros_like(x)

        for k in range(warmup):
            y = forward(k, self._input(batch, slices[k]))
            self._send(y.detach(), self.pp_rank + 1)  # warm-up stages are never the last
        x = self._input(batch, slices[warmup]) if warmup < count else None
        for i in range(count - warmup):  # steady: one forward, one backward
            k = warmup + i
            y = forward(k, x)
            grad = (
                None
                if self.stage.is_last
                else self._exchange(y.detach(), self.pp_rank + 1, self._shape(batch, slices[i]))
            )
            dx = backward(i, grad)
            if k + 1 < count:
                x = self._input(batch, slices[k + 1], send_back=dx)
            elif dx is not None:
                self._send(dx, self.pp_rank - 1)
        for i in range(count - warmup, count):  # drain
            dx = backward(i, self._recv(self.pp_rank + 1, self._shape(batch, slices[i])))
            if dx is not None:
                self._send(dx, self.pp_rank - 1)
        if broadcast_result:
            total = self._broadcast(total if self.stage.is_last else None)
        return float(total)

    # ------------------------------------------------------------------------------------------ internals
    def _prepare(
        self,
        input_ids_BL: torch.Tensor | None,
        attention_mask_BL: torch.Tensor,
        position_ids_BL: torch.Tensor | None,
        micro_batches: int,
    ) -> tuple[tuple[torch.Tensor | None, ...], list[slice]]:
        """The batch on the stage's device, and the micro-batches' row ranges."""
        if self.stage.is_first and input_ids_BL is None:
            raise ValueError("the first pipeline stage needs input_ids")
        device = self.stage.device
        batch = tuple(None if t is None else t.to(device) for t in (input_ids_BL, attention_mask_BL, position_ids_BL))
        return batch, micro_batch_slices(attention_mask_BL.shape[0], micro_batches)

    def _forward_micro_batch(
        self, batch: tuple[torch.Tensor | None, ...], rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this stage's input, its output) for ``rows`` in inference; receives the input from and sends the
        output onward."""
        ids_BL, mask_BL, pos_BL = batch
        x = ids_BL[rows] if self.stage.is_first else self._recv(self.pp_rank - 1, self._shape(batch, rows))
        y = self.stage.forward(x, mask_BL[rows], None if pos_BL is None else pos_BL[rows])
        if not self.stage.is_last:
            self._send(y.detach(), self.pp_rank + 1)
        return x, y

    def _shape(self, batch: tuple[torch.Tensor | None, ...], rows: slice) -> tuple[int, int, int]:
        """Shape of the hidden states (and their gradients) of ``rows`` between two stages."""
        return rows.stop - rows.start, batch[1].shape[1], self.stage.hidden_size

    def _input(
        self, batch: tuple[torch.Tensor | None, ...], rows: slice, send_back: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This stage's input for ``rows`` in a training step: the token ids on the first stage, else the previous
        stage's output (needing its gradient). ``send_back``, the gradient of the previous micro-batch's input,
        goes to the previous stage in the same exchange (both neighbours send at once in the steady phase)."""
        if self.stage.is_first:
            return batch[0][rows]
        expected = self._shape(batch, rows)
        x = (
            self._recv(self.pp_rank - 1, expected)
            if send_back is None
            else self._exchange(send_back, self.pp_rank - 1, expected)
        )
        return x.requires_grad_(True)

    def _exchange(self, tensor: torch.Tensor, peer: int, expected: tuple[int, ...]) -> torch.Tensor:
        """Send ``tensor`` to ``peer`` and receive one of shape ``expected`` from it, both at once: headers in one
        batch of point-to-point operations, then the tensors in another."""
        device = self.stage.device
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        self._batch([(dist.isend, tensor_header(tensor, device)), (dist.irecv, header)], peer)
        dtype, shape = decode_header(header)
        if shape != expected:
            raise RuntimeError(
                f"pipeline stage {self.pp_rank}: got a tensor of shape {shape} from stage {peer}, "
                f"expected {expected} (do all stages have the same rows?)"
            )
        received = torch.empty(shape, dtype=dtype, device=device)
        self._batch([(dist.isend, tensor.contiguous()), (dist.irecv, received)], peer)
        return received

    def _batch(self, ops: list[tuple[Callable, torch.Tensor]], peer: int) -> None:
        works = dist.batch_isend_irecv(
            [dist.P2POp(op, t, group=self.group, group_peer=self.peers[peer]) for op, t in ops]
        )
        for work in works:
            work.wait()

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        dist.send(tensor_header(tensor, self.stage.device), group=self.group, group_dst=self.peers[to])
        dist.send(tensor.contiguous(), group=self.group, group_dst=self.peers[to])

    def _recv(self, source: int, expected: tuple[int, ...]) -> torch.Tensor:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.stage.device)
        dist.recv(header, group=self.group, group_src=self.peers[source])
        dtype, shape = decode_header(header)
        if shape != expected:
            raise RuntimeError(
                f"pipeline stage {self.pp_rank}: got a tensor of shape {shape} from stage {source}, "
                f"expected {expected} (do all stages have the same rows?)"
            )
        tensor = torch.empty(shape, dtype=dtype, device=self.stage.device)
        dist.recv(tensor, group=self.group, group_src=self.peers[source])
        return tensor

    def _broadcast(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage (header first: only the last stage knows its shape)."""
        if self.pp_size == 1:
            return tensor
        last, device = self.peers[self.pp_size - 1], self.stage.device
        header = (
            tensor_header(tensor, device)
            if tensor is not None
            else torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        )
        dist.broadcast(header, group=self.group, group_src=last)
        dtype, shape = decode_header(header)
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor.contiguous(), group=self.group, group_src=last)
        return tensor


def tensor_header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise TypeError(
            f"pipeline messages carry floating tensors of at most {_MAX_DIMS} dims, "
            f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    code, ndim, *shape = header.tolist()
    return _DTYPES[code], tuple(shape[:ndim])


@torch.no_grad()
def clip_grad_norm_pp(
    stage: PipelineStage, max_norm: float, pp_group: dist.ProcessGroup | None, eps: float = 1e-6
) -> float:
    """Clip the whole model's gradients (all stages) to ``max_norm``; returns the global norm before clipping.

    Every stage all-reduces the sum of its squared gradient norm over ``pp_group``, so all stages compute the
    same norm and scale factor as ``torch.nn.utils.clip_grad_norm_`` over the unsplit model would. Call it on
    every stage (it is a collective), after any data-parallel gradient sum. DTensor (tensor-parallel)
    gradients count with their full norm: a stage's norm is first completed over its TP group (a sharded
    gradient's pieces summed once, a replicated one counted once), so every TP rank of a stage holds the same
    stage norm and the sum over ``pp_group`` (one TP rank per stage) counts each stage once. With pp×tp the
    call is also collective over each stage's TP group.
    """
    uncounted = (stage.tied_weight,) if stage.copies_tied_weight else ()
    return clip_grads(stage.parameters(), max_norm, pp_group, stage.device, eps, uncounted)


@torch.no_grad()
def clip_grads(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    eps: float = 1e-6,
    uncounted: Iterable[torch.Tensor | None] = (),
) -> float:
    """Clip the gradients of ``params`` (their fp32 ``main_grad`` where kept) to a global norm of
    ``max_norm``, the norm completed over each DTensor's mesh and summed in squares over ``group`` (the
    pipeline stages; None: this model is whole here); returns the norm before clipping. ``uncounted``: params
    whose gradients are scaled but not counted in the norm (the second copy of a tied embedding)."""
    skip = {id(p) for p in uncounted if p is not None}
    held = [(p, g) for p in params if (g := grad_of(p)) is not None]
    grads = [g for _, g in held]
    counted = [g for p, g in held if id(p) not in skip]
    local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros(())
    if isinstance(local, DTensor):
        local = local.full_tensor()
    squared = local.to(device=device, dtype=torch.float64) ** 2
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    total = math.sqrt(float(squared))
    coef = max_norm / (total + eps)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
