"""Two models' pipelines trained as one (RLHFuse's intra-stage fusion): each device runs a stage of either model.

When two models train with pipeline parallelism on the same devices (PPO's actor and critic), each pipeline alone
leaves its devices idle while micro-batches fill and drain it. Fused, every device holds one stage of each
model (of one replica of each) and runs both models' forward and backward tasks in a single order, found ahead
of time by :func:`loomrl.planner.pipeline_fusion.fused_order`, so that one model's work fills the other's bubbles;
opposite pipeline directions (one layout reversed) pair one model's busy end with the other's idle one.

:func:`pipeline_fusion_backward` runs one device's order. A task is ``(model, k, backward)`` for micro-batch
``k`` of that model's rows here. A forward receives its input from the previous stage (stage 0 embeds the token
ids), keeps its input and output for the backward and sends the output to the next stage; a backward
back-propagates the loss (last stage) or the gradient received from the next stage, and sends its input's
gradient to the previous stage. Sends are non-blocking (their completion is awaited at the end of the step) and
receives block, so the step cannot deadlock as long as the order respects the dependencies, which the schedule's
checker proves (:func:`loomrl.planner.pipeline_fusion.check`). Each model's stream runs over two communicators,
one per direction (activations toward the last stage on the pipeline's own group, gradients toward stage 0 on
``back_group``): on NCCL, point-to-point operations of one communicator run in order on one stream, so a send
waiting for its receiver would otherwise hold up a receive from the other direction.

A stage runs its forwards in micro-batch order, and its backwards too (the checker enforces it), so each
channel carries its messages in the order the receiver expects them and gradients accumulate in the same order
as in the model's own 1F1B step: the fused step computes exactly what the two separate steps do.

Legend: B rows, L tokens per row, H hidden size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loomrl.parallel.pipeline_runner import HEADER_LEN, LossFn, PipelineRunner, decode_header, tensor_header

__all__ = ["PipelineFusionSide", "FusedTask", "pipeline_fusion_backward"]

FusedTask = tuple[int, int, bool]
"""``(model, micro-batch k of that model's rows here, backward?)``."""


@dataclass
class PipelineFusionSide:
    """One model's share of a fused step on this device: its stage's runner, the gradients' communicator and
    the rows, cut into micro-batches, with the loss of each (as
    :meth:`~loomrl.parallel.pipeline_runner.PipelineRunner.train_step_backward` takes them)."""

    runner: PipelineRunner
    back_group: dist.ProcessGroup | None
    """A second communicator over the runner's pipeline ranks, for gradients (module docstring)."""
    input_ids_BL: torch.Tensor | None
    attention_mask_BL: torch.Tensor
    parts: Sequence[slice]
    loss_fn: LossFn
    position_ids_BL: torch.Tensor | None = None
    stage_ranks: Sequence[int] | None = None
    """The global rank of each stage (as the runner was given them); None: group rank order."""
    peak_in_flight: int = field(default=0, init=False)
    """Most micro-batches whose activations the last step kept at once on this stage."""


class _Channels:
    """Non-blocking sends (kept until complete) and blocking receives, each tensor after a header that names its
    dtype and shape."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, group: dist.ProcessGroup, peer: int) -> None:
        header = tensor_header(tensor, tensor.device)
        tensor = tensor.contiguous()
        for t in (header, tensor):
            self.pending.append((dist.isend(t, group=group, group_dst=peer), t))

    def recv(
        self, group: dist.ProcessGroup, peer: int, expected: tuple[int, ...], device: torch.device, where: str
    ) -> torch.Tensor:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        dist.irecv(header, group=group, group_src=peer).wait()
        dtype, shape = decode_header(header)
        if shape != expected:
            raise RuntimeError(
                f"fused pipeline, {where}: got a tensor of shape {shape}, expected {expected} (do all "
                "stages of a replica have the same rows?)"
            )
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(tensor, group=group, group_src=peer).wait()
        return tensor

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def pipeline_fusion_backward(order: Sequence[FusedTask], sides: Mapping[int, PipelineFusionSide]) -> dict[int, float]:
    """Run this device's tasks of a fused training step (module docstring); gradients accumulate into each side's
    stage. Returns each model's summed loss on its last stage (0.0 elsewhere). The caller zeroes gradients
    before, and sums, clips and steps each model after, as for a plain pipeline step."""
    for model, side in sides.items():
        forwards = sum(1 for m, _, back in order if m == model and not back)
        if forwards != len(side.parts) or sum(1 for m, _, back in order if m == model and back) != forwards:
            raise ValueError(
                f"fused pipeline: the order has {forwards} forwards of model {model} but its rows are "
                f"cut into {len(side.parts)} micro-batches"
            )
    channels = _Channels()
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    state = {model: _SideState(side) for model, side in sides.items()}
    for model, k, backward in order:
        s = state[model]
        if backward:
            s.backward(k, saved.pop((model, k)), channels)
        else:
            saved[(model, k)] = s.forward(k, channels)
            s.side.peak_in_flight = max(s.side.peak_in_flight, sum(1 for m, _ in saved if m == model))
    channels.drain()
    return {model: float(s.total) for model, s in state.items()}


class _SideState:
    """One model's stage during a fused step: its batch on the device, its peers in either communicator."""

    def __init__(self, side: PipelineFusionSide) -> None:
        runner = side.runner
        self.side, self.runner, self.stage = side, runner, runner.stage
        device = self.stage.device
        self.batch = tuple(
            None if t is None else t.to(device)
            for t in (side.input_ids_BL, side.attention_mask_BL, side.position_ids_BL)
        )
        if self.stage.is_first and self.batch[0] is None:
            raise ValueError("the first pipeline stage needs input_ids")
        ranks = side.stage_ranks
        self.back_peers = (
            tuple(range(runner.pp_size))
            if ranks is None or runner.pp_size == 1
            else tuple(dist.get_group_rank(side.back_group, r) for r in ranks)
        )
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        side.peak_in_flight = 0

    def _shape(self, k: int) -> tuple[int, int, int]:
        rows = self.side.parts[k]
        return rows.stop - rows.start, self.batch[1].shape[1], self.stage.hidden_size

    def forward(self, k: int, channels: _Channels) -> tuple[torch.Tensor, torch.Tensor]:
        rows, r = self.side.parts[k], self.runner.pp_rank
        if self.stage.is_first:
            x = self.batch[0][rows]
        else:
            x = channels.recv(
                self.runner.group, self.runner.peers[r - 1], self._shape(k), self.stage.device, f"stage {r} forward {k}"
            ).requires_grad_(True)
        y = self.stage.forward(x, self.batch[1][rows], None if self.batch[2] is None else self.batch[2][rows])
        if not self.stage.is_last:
            channels.send(y.detach(), self.runner.group, self.runner.peers[r + 1])
        return x, y

    def backward(self, k: int, saved: tuple[torch.Tensor, torch.Tensor], channels: _Channels) -> None:
        x, y = saved
        r = self.runner.pp_rank
        if self.stage.is_last:
            loss = self.side.loss_fn(y, k)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            loss.backward()
            self.total = self.total + loss.detach().double()
        else:
            grad = channels.recv(
                self.side.back_group,
                self.back_peers[r + 1],
                self._shape(k),
                self.stage.device,
                f"stage {r} backward {k}",
            )
            torch.autograd.backward(y, grad)
        if not self.stage.is_first:
            dx = x.grad if x.grad is not None else torch.zeros_like(x)
            channels.send(dx, self.side.back_group, self.back_peers[r - 1])
