"""Intra-stage fusion (RLHFuse): fused actor+critic pipeline schedules against the separate 1F1B baseline and the
lower bound.

    .venv/bin/python benchmarks/fused_pipeline.py [--part schedules|ceiling|measured|all] [--time-limit 60]
        [--seed 0] [--quick] [--no-exact] [--steps 8] [--cases 16/8/16/1,...] [--proof-limit 300] [--workers N]

``schedules`` (pure Python, no devices): an actor of depth ``pp_actor`` in {8, 16} and a critic of depth
``pp_critic`` in {4, 8, 16} (at most the actor's) train on ``D = pp_actor`` devices, the critic replicated
``D / pp_critic`` times, each model with ``M`` micro-batches in {8, 16, 32, 64} (in total over its replicas); every
stage's forward takes 1 and backward 2 time units in both models, and activation memory is capped per device at
the two models' 1F1B peaks there (the default). On top of that grid, every depth pair at ``M = 16`` with the
critic's stage costs 0.5x and 2x the actor's. For each case: the makespan of the separate schedule (each device
runs the actor's 1F1B, then the critic's), of :func:`~loomrl.planner.pipeline_fusion.fused_order` (seeded search,
``--time-limit`` seconds at most per case, stopping at the bound), the lower bound
(:mod:`loomrl.planner.pipeline_fusion.bound`, raised by CP-SAT's proofs when OR-Tools is installed: the ``schedule``
extra; ``--no-exact`` leaves it out), the fused schedule's gap to it, the seconds spent and whether it is within 1%
(the target). ``--quick``: M in {8, 16}, no cost ratios, 5 seconds per case.

``ceiling`` (needs OR-Tools): for each of ``--cases`` (pp_actor/pp_critic/M/critic cost ratio), what the optimum
is: CP-SAT asked, from the bound up one grid step at a time, whether a schedule of that makespan exists
(:func:`~loomrl.planner.pipeline_fusion.exact.exact_ladder`, ``--proof-limit`` seconds per call, a call asking on while
its time lasts, and a new call after each proof); the proven bound and, when it found one, the optimum. Long:
minutes per question on two cores.

``measured``: fused and separate actor + critic training steps run on 2 and 4 gloo processes, side by side in one
run, with the cost model's predictions for both (``benchmarks/fused_pipeline_measured.py`` says how).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from loomrl.plan.pipeline_fusion import PipelineFusionProblem, PipelineSpec
from loomrl.planner.pipeline_fusion.bound import lower_bound
from loomrl.planner.pipeline_fusion.exact import available, exact_ladder
from loomrl.planner.pipeline_fusion.graph import build_graph
from loomrl.planner.pipeline_fusion.search import fused_order, separate_order
from loomrl.planner.pipeline_fusion.simulate import check
from loomrl.report import summary_table

DEPTHS = ((8, 4), (8, 8), (16, 4), (16, 8), (16, 16))
"""(pp_actor, pp_critic) pairs; the devices are pp_actor."""
MICRO_BATCHES = (8, 16, 32, 64)
RATIOS = (0.5, 2.0)
"""Critic stage cost over the actor's, run at RATIO_MICRO_BATCHES."""
RATIO_MICRO_BATCHES = 16
TARGET_GAP = 0.01


def cases(quick: bool) -> list[tuple[int, int, int, float]]:
    """(pp_actor, pp_critic, M, critic cost ratio) of every case."""
    out = [(a, c, m, 1.0) for a, c in DEPTHS for m in (MICRO_BATCHES[:2] if quick else MICRO_BATCHES)]
    if not quick:
        out += [(a, c, RATIO_MICRO_BATCHES, r) for a, c in DEPTHS for r in RATIOS]
    return out


def problem(pp_actor: int, pp_critic: int, micro_batches: int, ratio: float) -> PipelineFusionProblem:
    return PipelineFusionProblem(
        pp_actor,
        PipelineSpec(pp_actor, micro_batches, 1.0, 2.0),
        PipelineSpec(pp_critic, micro_batches, ratio, 2.0 * ratio),
    )


def schedules_part(args: argparse.Namespace) -> None:
    limit = 5.0 if args.quick and args.time_limit is None else (args.time_limit or 60.0)
    rows = []
    for pp_actor, pp_critic, micro_batches, ratio in cases(args.quick):
        fusion = problem(pp_actor, pp_critic, micro_batches, ratio)
        separate = check(separate_order(fusion)).makespan
        result = fused_order(fusion, seed=args.seed, time_limit_s=limit, exact=False if args.no_exact else None)
        check(result.schedule)
        rows.append(
            {
                "case": f"pp {pp_actor}/{pp_critic}, M {micro_batches}"
                + (f", critic x{ratio:g}" if ratio != 1.0 else ""),
                "separate 1F1B": separate,
                "fused": result.makespan,
                "bound": result.bound,
                "CP-SAT proofs": result.exact_proofs,
                "gap %": 100 * result.gap,
                "seconds": round(result.seconds, 1),
                "within 1%": "yes" if result.gap <= TARGET_GAP + 1e-12 else "no",
            }
        )
        Console().print(
            f"{rows[-1]['case']}: fused {result.makespan:g}, bound {result.bound:g}, {result.seconds:.1f} s",
            style="dim",
        )
    exact = "off" if args.no_exact else ("on" if available() else "not installed")
    Console(width=160).print(
        summary_table(
            rows,
            f"fused pipeline schedules (time units; search limit {limit:g} s "
            f"per case, seed {args.seed}; CP-SAT {exact})",
        )
    )
    within = sum(r["within 1%"] == "yes" for r in rows)
    worst = max(rows, key=lambda r: r["gap %"])
    longest = max(rows, key=lambda r: r["seconds"])
    Console().print(f"within 1% of the bound: {within} of {len(rows)} cases")
    Console().print(f"worst gap: {worst['gap %']:.2f}% ({worst['case']})")
    Console().print(f"longest search: {longest['seconds']:.1f} s ({longest['case']})")


def ceiling_part(args: argparse.Namespace) -> None:
    """The optimum of each of ``--cases`` as far as CP-SAT proves it (module docstring)."""
    if not available():
        raise SystemExit("--part ceiling needs OR-Tools: pip install 'loomrl[schedule]'")
    rows = []
    for spec in args.cases.split(","):
        pp_actor, pp_critic, micro_batches, ratio = spec.split("/")
        fusion = problem(int(pp_actor), int(pp_critic), int(micro_batches), float(ratio))
        graph, bound = build_graph(fusion), lower_bound(fusion)
        best = fused_order(fusion, seed=args.seed, time_limit_s=args.time_limit or 60.0, exact=False)
        hint = [[graph.index[t] for t in order] for order in best.schedule.devices]
        proven, optimum, began = bound, None, time.perf_counter()
        while optimum is None and proven < best.makespan - 1e-9:
            found = exact_ladder(
                graph,
                proven,
                best.makespan,
                deadline=time.perf_counter() + args.proof_limit,
                seed=args.seed,
                hint=hint,
                workers=args.workers or os.cpu_count() or 1,
            )
            if found.orders is not None:
                optimum = found.bound
            elif found.proofs == 0:
                break
            proven = found.bound
        if optimum is None and proven >= best.makespan - 1e-9:
            optimum = best.makespan
        rows.append(
            {
                "case": spec,
                "fused (search)": best.makespan,
                "bound": bound,
                "proven bound": proven,
                "optimum": optimum if optimum is not None else "?",
                "seconds": round(time.perf_counter() - began),
                "optimum > 1.01 bound": "?" if optimum is None else ("yes" if optimum > 1.01 * bound else "no"),
            }
        )
        Console().print(f"{spec}: proven >= {proven:g}, optimum {optimum}", style="dim")
    Console(width=160).print(
        summary_table(
            rows, f"how far each case's optimum lies above the bound (CP-SAT, {args.proof_limit:g} s per question)"
        )
    )


def measured_part(args: argparse.Namespace) -> None:
    """Fused and separate actor + critic training steps run on gloo processes, with the cost model's
    predictions for both (:mod:`fused_pipeline_measured`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fused_pipeline_measured import ROWS, SEQ, measured_rows

    rows = []
    for row in measured_rows(args.steps):
        measured, predicted = row["measured"], row["predicted"]
        rows.append(
            {
                "setup": row["setup"],
                "separate s": measured["separate"],
                "fused s": measured["fused"],
                "fused speedup": measured["separate"] / measured["fused"],
                "predicted separate s": predicted["separate"],
                "predicted fused s": predicted["fused"],
                "predicted speedup": predicted["separate"] / predicted["fused"],
                "error separate %": 100 * (predicted["separate"] / measured["separate"] - 1),
                "error fused %": 100 * (predicted["fused"] / measured["fused"] - 1),
            }
        )
    Console(width=200).print(
        summary_table(
            rows,
            f"fused vs separate training steps, measured on this machine "
            f"({ROWS} rows x {SEQ} tokens; median of {args.steps - 2} steps)",
        )
    )
    within = sum(abs(r["error separate %"]) <= 15 and abs(r["error fused %"]) <= 15 for r in rows)
    Console().print(f"predictions within 15% for both: {within} of {len(rows)} setups")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part",
        choices=("schedules", "ceiling", "measured", "all"),
        default="all",
        help="schedules: simulated makespans and bounds; ceiling: CP-SAT's optimum of --cases; "
        "measured: training steps run on this machine (all: schedules and measured)",
    )
    ap.add_argument("--steps", type=int, default=8, help="measured training steps of each kind per setup")
    ap.add_argument("--time-limit", type=float, default=None, help="search seconds per case (default 60; 5 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="M in {8, 16}, no cost ratios, 5 s per case")
    ap.add_argument("--no-exact", action="store_true", help="schedules without CP-SAT even when it is installed")
    ap.add_argument("--cases", default="16/8/16/1", help="ceiling: pp_actor/pp_critic/M/critic cost ratio, ...")
    ap.add_argument("--proof-limit", type=float, default=300.0, help="ceiling: CP-SAT seconds per call")
    ap.add_argument("--workers", type=int, help="ceiling: CP-SAT's search workers (default: every core)")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps: {args.steps} leaves no step measured (the first 2 warm up; valid: 3 or more)")
    began = time.perf_counter()
    if args.part in ("schedules", "all"):
        schedules_part(args)
    if args.part == "ceiling":
        ceiling_part(args)
    if args.part in ("measured", "all"):
        measured_part(args)
    Console().print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
