"""Intra-stage fusion on gloo: a fused actor + critic pipeline step computes what the two separate pipelines do,
and what one process computes on the unsplit models, on 2 and 4 processes, for equal and different depths.

Each rank holds one stage of the actor (llama-1m, left to right) and one of a value model (llama-1m with a
random score head, right to left: a reversed layout); with a shallower critic (pp 2 on 4 devices) it runs two
replicas, each on half of the rows, whose gradients are summed. The order each device runs comes from the fused
schedule generator (:mod:`loomrl.planner.pipeline_fusion`), whose placement is the allocations' own. All fp32.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from loomrl.models.heads import token_values
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.parallel.allocations import AllocationGroups
from loomrl.parallel.data_parallel import sync_gradients
from loomrl.parallel.pipeline import split_stages
from loomrl.parallel.pipeline_fusion import PipelineFusionSide, pipeline_fusion_backward
from loomrl.parallel.pipeline_runner import PipelineRunner, clip_grad_norm_pp
from loomrl.parallel.spawn import run_world
from loomrl.plan.allocation import Allocation, DeviceSet
from loomrl.plan.layout import Layout
from loomrl.workflow.batch import micro_batch_slices
from pipeline_helpers import MAX_NORM, logp_from_logits, ragged_batch, value_model

TIMEOUT_S = 240.0
GRAD_TOLERANCE = 1e-5
"""Relative, on the clipped gradients against the unsplit models' (fp32; sums run in another order)."""
WEIGHT_TOLERANCE = 1e-6
"""Relative, on the weights after one SGD step."""
SGD_LR = 0.1


def _allocations(world: int, critic_pp: int) -> tuple[Allocation, Allocation]:
    mesh = DeviceSet(tuple(range(world)))
    actor = Allocation(mesh, Layout(pp=world), micro_batches=4)
    critic = Allocation(mesh, Layout(dp=world // critic_pp, pp=critic_pp, reverse=True), micro_batches=2)
    return actor, critic


def _orders(world: int, critic_pp: int, fused: bool) -> dict[int, tuple]:
    """Each device's order: the fused schedule's, or the two pipelines' 1F1B one after the other."""
    from loomrl.plan.pipeline_fusion import PipelineSpec
    from loomrl.planner.cost.pipeline_fusion import local_orders, pipeline_fusion_problem
    from loomrl.planner.pipeline_fusion.search import fused_order, separate_order
    from loomrl.planner.pipeline_fusion.simulate import check

    actor, critic = _allocations(world, critic_pp)
    specs = (PipelineSpec(world, 4), PipelineSpec(critic_pp, 2 * (world // critic_pp)))
    problem = pipeline_fusion_problem(actor, critic, specs)
    schedule = fused_order(problem, seed=0, iterations=300).schedule if fused else separate_order(problem)
    check(schedule)
    return local_orders(problem, schedule.devices, actor.devices)


class _Model:
    """One model's stage on this rank, its rows and its loss, plus the unsplit reference."""

    def __init__(self, rank: int, alloc: Allocation, groups: AllocationGroups, build, loss_of) -> None:
        g = groups[alloc]
        self.groups, self.alloc = g, alloc
        self.ref = build()
        self.stage = split_stages(build(), g.pp_rank, alloc.layout.pp)
        self.runner = PipelineRunner(self.stage, g.pp_group, g.pp_rank, alloc.layout.pp, g.stage_ranks)
        ids_BL, mask_BL = ragged_batch()
        rows = micro_batch_slices(len(ids_BL), alloc.layout.dp)[g.dp_rank]  # this replica's share
        self.ids_BL, self.mask_BL = ids_BL[rows], mask_BL[rows]
        self.parts = micro_batch_slices(len(self.ids_BL), alloc.micro_batches)
        self.loss_of, self.offset = loss_of, rows.start

    def loss_fn(self, out: torch.Tensor, k: int) -> torch.Tensor:
        rows = self.parts[k]
        return self.loss_of(out, slice(self.offset + rows.start, self.offset + rows.stop))

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.stage.named_parameters() if p.grad is not None}

    def zero(self) -> None:
        for p in self.stage.parameters():
            p.grad = None

    def step_and_compare(self) -> tuple[float, float]:
        """Sum over replicas, clip and take an SGD step on this stage and on the reference; the largest relative
        difference of this stage's gradients (to the reference tensor's largest gradient) and of its weights
        from the reference's. (SGD rather than Adam: Adam's first step divides each gradient by its own size,
        so rounding noise in a near-zero gradient would move a weight by a whole step.)"""
        if self.alloc.layout.dp > 1:
            sync_gradients(self.stage.model, self.groups.dp_group)
        clip_grad_norm_pp(self.stage, MAX_NORM, self.groups.pp_group)
        ids_BL, mask_BL = ragged_batch()
        self.loss_of(self.ref_outputs(ids_BL, mask_BL), slice(0, len(ids_BL))).backward()
        torch.nn.utils.clip_grad_norm_(self.ref.parameters(), MAX_NORM)
        ref = dict(self.ref.named_parameters())
        grads = max(
            ((p.grad - ref[n].grad).abs().max() / ref[n].grad.abs().max().clamp_min(1e-12)).item()
            for n, p in self.stage.named_parameters()
        )
        for params in (self.stage.parameters(), self.ref.parameters()):
            torch.optim.SGD(params, lr=SGD_LR).step()
        weights = max(((p - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in self.stage.named_parameters())
        return grads, weights

    def ref_outputs(self, ids_BL, mask_BL) -> torch.Tensor:
        raise NotImplementedError


def _actor_loss(out: torch.Tensor, rows: slice) -> torch.Tensor:
    ids_BL, mask_BL = ragged_batch()
    total = int(mask_BL[:, 1:].sum())
    return -(logp_from_logits(out, ids_BL[rows]) * mask_BL[rows, 1:]).sum() / total


def _critic_loss(out: torch.Tensor, rows: slice) -> torch.Tensor:
    ids_BL, mask_BL = ragged_batch()
    target = torch.linspace(-1.0, 1.0, ids_BL.numel()).reshape(ids_BL.shape)
    return (((out - target[rows]) ** 2) * mask_BL[rows]).sum() / int(mask_BL.sum())


class _Actor(_Model):
    def ref_outputs(self, ids_BL, mask_BL):
        return self.ref(input_ids=ids_BL, attention_mask=mask_BL).logits


class _Critic(_Model):
    def ref_outputs(self, ids_BL, mask_BL):
        return token_values(self.ref, ids_BL, mask_BL)


def _fused_step(rank: int, world: int, critic_pp: int, orders: dict[str, dict[int, tuple]]) -> dict[str, Any]:
    torch.manual_seed(0)
    actor_alloc, critic_alloc = _allocations(world, critic_pp)
    groups = AllocationGroups(rank, [actor_alloc, critic_alloc], "cpu")
    tok = build_char_tokenizer()
    models = (
        _Actor(rank, actor_alloc, groups, lambda: build_causal_lm("llama-1m", tok, seed=0), _actor_loss),
        _Critic(rank, critic_alloc, groups, value_model, _critic_loss),
    )
    for m in models:
        m.stage.model.train()
    # the two pipelines one after the other
    for m in models:
        m.runner.train_step_backward(m.ids_BL, m.mask_BL, m.loss_fn, len(m.parts))
    separate = [m.grads() for m in models]
    out: dict[str, Any] = {}
    for name, _fused in (("separate_order", False), ("fused", True)):
        for m in models:
            m.zero()
        sides = {
            i: PipelineFusionSide(
                m.runner,
                m.groups.pp_back_group,
                m.ids_BL,
                m.mask_BL,
                m.parts,
                m.loss_fn,
                stage_ranks=m.groups.stage_ranks,
            )
            for i, m in enumerate(models)
        }
        pipeline_fusion_backward(orders[name][rank], sides)
        out[name] = max(
            (g - separate[i][n]).abs().max().item() for i, m in enumerate(models) for n, g in m.grads().items()
        )
        out[f"{name}_peak"] = [side.peak_in_flight for side in sides.values()]
    out["vs_reference"] = [m.step_and_compare() for m in models]
    return out


@pytest.mark.parametrize(
    "world,critic_pp", [(2, 2), (4, 4), (4, 2)], ids=["2procs-equal", "4procs-equal", "4procs-critic-pp2x2"]
)
def test_fused_step_equals_separate_pipelines_and_reference(world, critic_pp):
    orders = {name: _orders(world, critic_pp, fused) for name, fused in (("separate_order", False), ("fused", True))}
    results = run_world(
        partial(_fused_step, world=world, critic_pp=critic_pp, orders=orders), world, timeout_s=TIMEOUT_S
    )
    for rank, result in enumerate(results):
        assert result["separate_order"] == 0.0, (rank, result)  # the same tasks in the same order: bit-equal
        assert result["fused"] == 0.0, (rank, result)  # each stage's sums in the same order: bit-equal too
        for grads, weights in result["vs_reference"]:
            assert grads < GRAD_TOLERANCE and weights < WEIGHT_TOLERANCE, (rank, result)
