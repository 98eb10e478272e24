"""The measured part of ``benchmarks/fused_pipeline.py``: fused vs separate actor + critic training on gloo.

Each configuration spawns its processes once and runs, in that one world, training steps of an actor (a causal
LM) and a critic (a value model of the same size) pipelined over the same processes, the critic's layout
reversed: one step is, for each model, a forward and backward of every micro-batch, the gradient sum over the
model's replicas, clipping and an AdamW step. ``separate`` runs the actor's 1F1B pass and then the critic's
(what loomrl runs without ``pipeline_fusion``); ``fused`` runs one fused pipeline step with the schedule the runtime
would run (:func:`loomrl.planner.cost.pipeline_fusion.pipeline_fusion_orders`, each task priced by the cost model). The
two
alternate step by step, so load on the machine falls on both alike; each figure is the median over the steps
after the first two.

Predictions: the cost model with this machine's measured profile (``calibrate_local``) prices both as the
simulator does a PPO iteration's train calls: the two calls' times added (separate) and the ``fused_train``
stage (fused), for one optimizer step over the same rows. One correction is fitted, on another measurement of
the same run: the actor's step alone (its 1F1B pass and optimizer step, ``actor alone``), whose measured over
predicted seconds scale both predictions, as the planner's fitted corrections scale its estimates.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

MODEL = {
    "hidden_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "intermediate_size": 1024,
    "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}
"""~15M parameters per model (8 layers: 2 or 4 stages); big enough that compute, not messaging, dominates."""
ROWS, SEQ, MICRO_BATCHES = 16, 96, 4


@dataclass(frozen=True)
class Setup:
    name: str
    processes: int
    actor: str
    """Layout text of the actor's train allocation on all processes."""
    critic: str


SETUPS = (
    Setup("2 procs: pp2 + pp2rev", 2, "pp2", "pp2rev"),
    Setup("4 procs: pp4 + pp4rev", 4, "pp4", "pp4rev"),
    Setup("4 procs: pp4 + dp2pp2rev", 4, "pp4", "dp2pp2rev"),
)


def _config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, pad_token_id=0, **MODEL)


def _allocations(setup: Setup):
    from loomrl.plan.allocation import Allocation

    mesh = f"0-{setup.processes - 1}"
    return (
        Allocation.parse(f"{mesh}:{setup.actor}mb{MICRO_BATCHES}"),
        Allocation.parse(f"{mesh}:{setup.critic}mb{MICRO_BATCHES}"),
    )


def _pricing(setup: Setup, profile):
    """(cost model, fused_train step) of the setup: a PPO workflow whose train calls use its allocations."""
    import dataclasses

    from loomrl.algorithms.workflows import build_workflow
    from loomrl.config.schema import AlgoConfig, RolloutConfig
    from loomrl.plan.allocation import Allocation
    from loomrl.plan.cluster import ClusterSpec
    from loomrl.plan.model_shape import ModelShape
    from loomrl.plan.plan import ExecutionPlan
    from loomrl.plan.schedule import StepKind, build_schedule
    from loomrl.planner.cost.model import CostModel
    from loomrl.planner.cost.workload import Workload

    workflow = build_workflow(AlgoConfig(name="ppo", ppo_epochs=1, minibatches=1), RolloutConfig())
    cluster = ClusterSpec(nodes=1, devices_per_node=setup.processes)
    actor, critic = _allocations(setup)
    everywhere = Allocation.parse(f"0-{setup.processes - 1}")
    allocations = {m.name: everywhere for m in workflow}
    allocations.update(actor_train=actor, critic_train=critic, advantages=Allocation.parse("0:dp1"))
    plan = ExecutionPlan(cluster, allocations, pipeline_fusion=True)
    shape = ModelShape.from_config(_config(48))
    cost = CostModel(
        cluster,
        dataclasses.replace(profile, memory_bytes=cluster.memory_gb * 2**30),
        {r: shape for r in workflow.roles()},
        Workload(ROWS, SEQ // 2, (SEQ // 2,)),
    )
    step = next(s for s in build_schedule(workflow, plan) if s.kind is StepKind.PIPELINE_FUSION)
    return cost, step


def _models(rank: int, setup: Setup) -> list[dict]:
    """This rank's stage of the actor and of the critic, with its rows of the batch, pipeline runner and
    optimizer."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from loomrl.parallel.allocations import AllocationGroups
    from loomrl.parallel.pipeline import split_stages
    from loomrl.parallel.pipeline_runner import PipelineRunner
    from loomrl.workflow.batch import micro_batch_slices

    torch.manual_seed(0)
    config = _config(48)
    allocs = _allocations(setup)
    groups = AllocationGroups(rank, allocs, "cpu")
    builders = (lambda: LlamaForCausalLM(config), lambda: LlamaForSequenceClassification(config))
    ids_BL = torch.randint(3, 48, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    mask_BL = torch.ones_like(ids_BL)
    models = []
    for alloc, build in zip(allocs, builders):
        g = groups[alloc]
        model = build()
        model.config.pad_token_id = 0
        stage = split_stages(model, g.pp_rank, alloc.layout.pp)
        stage.model.train()
        rows = micro_batch_slices(ROWS, alloc.layout.dp)[g.dp_rank]
        models.append(
            {
                "g": g,
                "alloc": alloc,
                "stage": stage,
                "ids": ids_BL[rows],
                "mask": mask_BL[rows],
                "runner": PipelineRunner(stage, g.pp_group, g.pp_rank, alloc.layout.pp, g.stage_ranks),
                "opt": torch.optim.AdamW(stage.parameters(), lr=1e-5),
            }
        )
    return models


def _body(rank: int, setup: Setup, orders: dict, steps: int) -> dict:
    from loomrl.parallel.data_parallel import sync_gradients
    from loomrl.parallel.pipeline_fusion import PipelineFusionSide, pipeline_fusion_backward
    from loomrl.parallel.pipeline_runner import clip_grad_norm_pp
    from loomrl.workflow.batch import micro_batch_slices

    models = _models(rank, setup)

    def loss(out: torch.Tensor, k: int) -> torch.Tensor:
        return out.float().square().mean() * 1e-3

    def finish(m) -> None:
        if m["alloc"].layout.dp > 1:
            sync_gradients(m["stage"].model, m["g"].dp_group)
        clip_grad_norm_pp(m["stage"], 1.0, m["g"].pp_group)
        m["opt"].step()
        m["opt"].zero_grad(set_to_none=True)

    def separate() -> None:
        for m in models:
            m["runner"].train_step_backward(m["ids"], m["mask"], loss, MICRO_BATCHES)
            finish(m)

    def fused() -> None:
        sides = {
            i: PipelineFusionSide(
                m["runner"],
                m["g"].pp_back_group,
                m["ids"],
                m["mask"],
                micro_batch_slices(len(m["ids"]), MICRO_BATCHES),
                loss,
                stage_ranks=m["g"].stage_ranks,
            )
            for i, m in enumerate(models)
        }
        pipeline_fusion_backward(orders[rank], sides)
        for m in models:
            finish(m)

    def actor_alone() -> None:
        m = models[0]
        m["runner"].train_step_backward(m["ids"], m["mask"], loss, MICRO_BATCHES)
        finish(m)

    times: dict[str, list[float]] = {"separate": [], "fused": [], "actor alone": []}
    for _ in range(steps):
        for name, fn in (("separate", separate), ("fused", fused), ("actor alone", actor_alone)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def measured_rows(steps: int = 8) -> list[dict]:
    """One row per setup: measured and predicted seconds of a separate and a fused step."""
    from loomrl.parallel.spawn import run_world
    from loomrl.planner.calibration.local import calibrate_local
    from loomrl.planner.cost.pipeline_fusion import pipeline_fusion_orders

    rows, profiles = [], {}
    for setup in SETUPS:
        if setup.processes not in profiles:
            profiles[setup.processes] = calibrate_local(setup.processes)
        cost, step = _pricing(setup, profiles[setup.processes])
        orders = pipeline_fusion_orders(cost, step)
        results = run_world(
            partial(_body, setup=setup, orders=orders, steps=steps),
            setup.processes,
            timeout_s=1800.0,
            group_timeout_s=600.0,
        )
        measured = {name: statistics.median(results[0][name][2:]) for name in ("separate", "fused", "actor alone")}
        actor = step.members[0]
        scale = measured["actor alone"] / cost.mfc_time(actor.mfc, actor.alloc)
        predicted = {
            "separate": scale * sum(cost.mfc_time(m.mfc, m.alloc) for m in step.members),
            "fused": scale * cost.pipeline_fusion_time(step),
        }
        rows.append({"setup": setup.name, "measured": measured, "predicted": predicted, "scale": scale})
    return rows
