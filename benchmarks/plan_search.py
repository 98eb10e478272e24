"""Searched plans vs the best heuristic placement on ReaLHF's weak-scaling setups (simulated).

    .venv/bin/python benchmarks/plan_search.py [--time-budget 60] [--seed 0] [--only 7b] [--long-tail]

LLaMA-2-architecture actor, critic, reference and reward models of 7B on 8 H100s, 13B on 16, 34B on 32 and 70B on
64 (8 per node); 512 prompts of 128 tokens; response lengths 128, 384 and 896. For each setup, every heuristic
strategy (colocate, interleave, separate) gets its best layouts by enumeration, then a seeded search runs
within the time budget starting from the best heuristic; the table gives each one's simulated iteration
time and the searched plan's speedup over the best feasible heuristic (target: at least 1.26x on average).
A heuristic's layouts are symmetric (one per role and mesh, as ReaLHF's Megatron-based heuristic); the
"per-call" columns compare with the stronger heuristic whose calls each take their own layout, for
transparency. "bound" is the lower bound of :mod:`loomrl.planner.search.bounds` on any plan of the search's space, so
"heuristic / bound" is the most any searched plan could gain over the best heuristic in that setup.

``--long-tail`` replaces the three uniform lengths by one long-tailed distribution: a log-normal of log-scale
:data:`~loomrl.planner.cost.workload.DEFAULT_SPREAD` cut at 2048 tokens with mean 384
(:func:`~loomrl.planner.cost.workload.lengths_from_mean_max`). The search may fuse generation with the inference that
reads it (RLHFuse's inter-stage fusion, ``migrate_at: auto``) while the heuristics stay unfused, so the speedup is
the searched plan's against the best unfused heuristic (target: at least 1.3x on average); the bound covers fused
plans too (:mod:`loomrl.planner.search.bounds`).
"""

from __future__ import annotations

import argparse
import math
import time

from rich.console import Console

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.models.presets import model_config
from loomrl.plan import ClusterSpec
from loomrl.plan.cluster import profile_for
from loomrl.plan.model_shape import ModelShape
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.workload import DEFAULT_SPREAD, Workload, lengths_from_mean_max
from loomrl.planner.inputs import PlannerInputs
from loomrl.planner.planning import compare_plans
from loomrl.planner.search.heuristics import best_heuristic_plans
from loomrl.report import summary_table

SETUPS = (("llama2-7b", "h100:1x8"), ("llama2-13b", "h100:2x8"), ("llama2-34b", "h100:4x8"), ("llama2-70b", "h100:8x8"))
RESPONSE_LENGTHS = (128, 384, 896)
LONG_TAIL = (384, 2048)
"""Mean and limit of the long-tailed response lengths of ``--long-tail``."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="run only setups whose model name contains this")
    ap.add_argument("--long-tail", action="store_true", help="log-normal response lengths, mean 384, max 2048")
    args = ap.parse_args()
    workflow = build_workflow(AlgoConfig(name="ppo", ppo_epochs=1, minibatches=4), RolloutConfig())
    rows, speedups, per_call_speedups, caps = [], [], [], []
    for model, cluster_text in SETUPS:
        if args.only not in model:
            continue
        cluster = ClusterSpec.parse(cluster_text)
        configs = {role: model_config(model) for role in workflow.roles()}
        lengths = (
            [lengths_from_mean_max(*LONG_TAIL, DEFAULT_SPREAD)] if args.long_tail else [(n,) for n in RESPONSE_LENGTHS]
        )
        for response_lengths in lengths:
            response = f"{LONG_TAIL[0]}~{LONG_TAIL[1]}" if args.long_tail else response_lengths[0]
            workload = Workload(
                batch=512, prompt_len=128, response_lengths=response_lengths, ppo_epochs=1, minibatches=4
            )
            start = time.perf_counter()
            report = compare_plans(
                PlannerInputs(workflow, cluster, profile_for(cluster), configs, workload),
                seed=args.seed,
                time_budget_s=args.time_budget,
            )
            seconds = time.perf_counter() - start
            times = {r["plan"]: r["s/iteration"] for r in report.rows}
            speedups.append(report.search_speedup)
            searched = times.get("searched", math.nan)
            per_call = _best_per_call(workflow, cluster, configs, workload)
            per_call_speedups.append(per_call / searched)
            best_heuristic = searched * report.search_speedup
            caps.append(best_heuristic / report.bound.seconds)
            fused = next((r["fused"] for r in report.rows if r["plan"] == "searched"), "no")
            rows.append(
                {
                    "setup": f"{model} / {cluster_text} / {response}",
                    **{k: times.get(k, math.nan) for k in ("colocate", "interleave", "separate", "searched")},
                    "searched fused": fused,
                    "search vs best heuristic": report.search_speedup,
                    "plan+search s": seconds,
                    "per-call heuristic": per_call,
                    "search vs per-call": per_call / searched,
                    "bound": report.bound.seconds,
                    "heuristic / bound": caps[-1],
                }
            )
    Console(width=200).print(summary_table(rows, "simulated s/iteration (nan: does not fit in memory)"))
    finite = [s for s in speedups if math.isfinite(s)]
    mean = sum(finite) / len(finite) if finite else math.nan
    geo = math.exp(sum(math.log(s) for s in finite) / len(finite)) if finite else math.nan
    Console().print(
        f"search vs best heuristic: mean {mean:.3f}x, geometric mean {geo:.3f}x over {len(finite)} setups "
        f"(target {1.3 if args.long_tail else 1.26}x); search budget {args.time_budget:g} s each, seed {args.seed}"
    )
    finite = [c for c in caps if math.isfinite(c)]
    if finite:
        Console().print(
            f"best heuristic vs the lower bound (the most a search could gain): mean "
            f"{sum(finite) / len(finite):.3f}x over {len(finite)} setups"
        )
    finite = [s for s in per_call_speedups if math.isfinite(s)]
    if finite:
        Console().print(
            f"search vs the per-call-layout heuristics (a stronger baseline): mean "
            f"{sum(finite) / len(finite):.3f}x over {len(finite)} setups"
        )


def _best_per_call(workflow, cluster, configs, workload) -> float:
    """Seconds per iteration of the best heuristic when each call may take its own layout (nan: none fits)."""
    profile = profile_for(cluster)
    cost = CostModel(cluster, profile, {r: ModelShape.from_config(c) for r, c in configs.items()}, workload)
    found = best_heuristic_plans(workflow, cluster, cost, profile.memory_bytes, configs, per_call=True)
    feasible = [r.iteration_time for _, r in found.values() if r.feasible]
    return min(feasible) if feasible else math.nan


if __name__ == "__main__":
    main()
