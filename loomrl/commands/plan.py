"""`loomrl plan`: the placement strategies' best plans, a searched plan and the lower bound for a run on a cluster,
side by side; or a given plan simulated stage by stage (``--plan``). Writes the best plan and its timeline."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from loomrl.commands.common import config_and_overrides
from loomrl.errors import ConfigError
from loomrl.plan.plan_string import format_plan_string

__all__ = ["RUN_FLAGS", "SYSTEM_FLAGS", "run", "run_description"]

RUN_FLAGS = (
    "cluster",
    "prompts",
    "responses_per_prompt",
    "prompt_len",
    "response_len",
    "response_max",
    "response_spread",
    "optimizer_steps",
    "ppo_epochs",
    "recompute_logprobs",
    "plan",
    "decode_slots",
    "generated_per_kept",
    "judge_tokens",
)
"""Flags of ``loomrl plan`` that set a field of :class:`~loomrl.planner.describe.RunDescription` (same names)."""
SYSTEM_FLAGS = (
    "gen_memory_fraction",
    "gen_max_seqs",
    "gen_request_batch",
    "gen_precision",
    "train_precision",
    "optimizer_offload",
    "packing",
    "logits",
    "sync_tensor_s",
    "expert_parallel",
)
"""Flags that set a field of :class:`~loomrl.planner.cost.system.SystemSettings` (same names)."""


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loomrl.plan import make_plan
    from loomrl.plan.hardware import load_profile
    from loomrl.planner.cost.corrections import Corrections
    from loomrl.planner.describe import inputs_from_description, simulate_fixed
    from loomrl.report.timeline import render_timeline

    if not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise ConfigError(f"--time-budget: {args.time_budget:g} is not a number of seconds > 0")
    if args.max_staleness < 0:
        raise ConfigError(f"--max-staleness: {args.max_staleness} is not a number of policy versions >= 0")
    if args.search_steps is not None and args.search_steps < 0:
        raise ConfigError(f"--search-steps: {args.search_steps} is not a number of proposals >= 0")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: '{out}' is a file; give a directory for the plan and its timeline")
    description, bytes_per_param = run_description(args)
    inputs = inputs_from_description(
        description,
        profile=load_profile(args.profile) if args.profile else None,
        corrections=Corrections.load(args.corrections) if args.corrections else None,
        bytes_per_param=bytes_per_param,
    )
    if args.no_factor:
        inputs = dataclasses.replace(inputs, profile=dataclasses.replace(inputs.profile, system_factor=1.0))
    workload = inputs.workload
    console = Console(width=max(120, Console().width))
    _print_applied(console, inputs.profile, args.profile, args.no_factor)
    title = (
        f"{description.algo} on {inputs.cluster}: {description.prompts} prompts × "
        f"{description.responses_per_prompt}, {description.prompt_len:g} + {workload.mean_response:.0f} "
        f"(max {workload.max_response}) tokens, {description.models.actor}"
    )
    if description.plan:
        plan = make_plan(description.plan, inputs.workflow, inputs.cluster)
        report = simulate_fixed(plan, inputs)
        _print_fixed(console, title, report)
        name, result = "given plan", report.result
    else:
        name, plan, result = _compare(console, title, inputs, args)
    try:  # made only now: a rejected plan leaves no directory behind
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out: cannot create '{out}' ({err.strerror})") from None
    plan.save(out / "best_plan.json")
    render_timeline(
        result, out / "timeline.png", out / "timeline.html", title=f"{name}: {result.iteration_time:.2f} s/iteration"
    )
    if not result.feasible:
        console.print(f"the plan does not fit in memory: {result.reason}")
    console.print(
        f"{name}: {result.iteration_time:.3g} s/iteration; wrote {out / 'best_plan.json'} (loomrl train "
        f"--plan accepts it) and {out / 'timeline.png'}, {out / 'timeline.html'}"
    )
    return 0


def run_description(args: argparse.Namespace):
    """The run ``loomrl plan`` prices: a train config's algorithm (the positional config), then a workload file
    (``--workload``), then the flags given; and the weights' element size of the config's precision."""
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import deep_merge, from_dict, load_config, read_yaml
    from loomrl.planner.cost.lengths import length_fields
    from loomrl.planner.cost.model import PRECISION_BYTES
    from loomrl.planner.describe import RunDescription

    path, overrides = config_and_overrides(args.config)
    cfg = load_config(TrainConfig, path, overrides)
    algo, rollout = cfg.algo, cfg.rollout
    data: dict = {
        "algo": algo.name,
        "ppo_epochs": algo.ppo_epochs,
        "optimizer_steps": algo.minibatches,
        "responses_per_prompt": algo.samples_per_prompt,
        "response_max": rollout.max_new_tokens,
        "recompute_logprobs": algo.recompute_logprobs or rollout.top_k > 0 or rollout.top_p < 1.0,
    }
    if args.workload:
        data = deep_merge(data, read_yaml(args.workload))
    flags = {key: getattr(args, key) for key in RUN_FLAGS if getattr(args, key) is not None}
    if args.response_len is not None:
        lengths = length_fields(flags.pop("response_len"))
        if (
            "response_len" in lengths
            and "response_spread" not in lengths
            and args.response_max is None
            and not args.workload
        ):
            lengths["response_max"] = None  # a mean alone: every response that long
        if "observed_lengths" not in lengths:
            lengths["observed_lengths"] = None  # a distribution given here replaces observed lengths of the file
        flags.update({key: value for key, value in lengths.items() if key not in flags})
    system = {key: getattr(args, key) for key in SYSTEM_FLAGS if getattr(args, key) is not None}
    models = {
        role: getattr(args, f"{role}_model")
        for role in ("actor", "critic", "ref", "reward")
        if getattr(args, f"{role}_model")
    }
    if args.model:
        models.setdefault("actor", args.model)
    if args.judge_model:
        models["judges"] = list(args.judge_model)
    data = deep_merge(
        data, {**flags, **({"system": system} if system else {}), **({"models": models} if models else {})}
    )
    if "models" not in data:
        data["models"] = {"actor": "llama2-7b"}
    return from_dict(RunDescription, data, "run"), PRECISION_BYTES.get(cfg.runtime.precision)


def _print_applied(console, profile, origin: str | None, no_factor: bool) -> None:
    """The plan's header: every figure the prices use that is not a datasheet number, with its source."""
    from loomrl.plan.hardware import stated_figures
    from loomrl.report import summary_table

    rows = [
        {"figure": name, "value": value, "source": source} for name, value, source in stated_figures(profile, origin)
    ]
    if rows:
        console.print(
            summary_table(rows, f"priced with profile {profile.name}: its figures that are not datasheet numbers")
        )
    if profile.system_factor != 1.0:
        console.print(
            f"every time below is multiplied by system_factor {profile.system_factor:g} (fitted, not measured "
            "here); --no-factor prices without it"
        )
    elif no_factor:
        console.print("priced without the profile's system_factor (--no-factor)")


def _print_fixed(console, title: str, report) -> None:
    from loomrl.report import summary_table

    total = report.result.iteration_time
    rows = [
        {"stage": stage, "seconds": seconds, "share of the iteration": seconds / total if total else 0.0}
        for stage, seconds in report.stages.items()
    ]
    rows.append({"stage": "iteration", "seconds": total, "share of the iteration": 1.0})
    console.print(summary_table(rows, f"{title}: the given plan, stage by stage (one steady iteration)"))
    calls = [{"step": step, "seconds": seconds} for step, seconds in report.calls.items() if seconds > 0]
    console.print(summary_table(calls, "each step of that iteration (on its busiest device)"))


def _compare(console, title: str, inputs, args: argparse.Namespace):
    """Heuristics, search and bound side by side (no fixed plan): the best plan found."""
    from loomrl.planner.planning import compare_plans
    from loomrl.planner.search.bounds import segment_seconds
    from loomrl.report import summary_table

    report = compare_plans(
        inputs,
        seed=args.seed,
        time_budget_s=args.time_budget,
        search_steps=args.search_steps,
        max_staleness=args.max_staleness,
    )
    console.print(summary_table(report.rows, title))
    if report.modes.get("asynchronous") is not None or args.max_staleness:
        modes = [
            {
                "iteration runs": mode,
                "s/iteration": found[1].iteration_time if found else math.nan,
                "staleness": found[0].staleness if found else math.nan,
                "plan": format_plan_string(found[0], inputs.workflow) if found else "none feasible",
            }
            for mode, found in report.modes.items()
        ]
        console.print(
            summary_table(
                modes,
                f"synchronous, stream-fused and asynchronous (staleness <= {args.max_staleness}): the fastest of each",
            )
        )
    name, plan, result = report.best
    bound = report.bound.seconds
    if math.isfinite(bound):
        console.print(
            f"lower bound: no plan of the search's space runs faster than {bound:.3g} s/iteration "
            f"(best found: {result.iteration_time / bound:.3f}x of it; see loomrl.planner.search.bounds)"
        )
        if report.bound.training:
            console.print(
                "the bound holds for every training placement; it is least for " + ", ".join(report.bound.training)
            )
        parts = report.bound.segments
        spent = segment_seconds(result, [part.calls for part in parts])
        rows = [
            {
                "segment (runs alone, in turn)": ", ".join(part.calls),
                "bound s": part.seconds,
                "best plan s": t,
                "plan / bound": t / part.seconds if part.seconds > 0 else math.nan,
            }
            for part, t in zip(parts, spent)
        ]
        console.print(summary_table(rows, "where the best plan stands, segment by segment (uncorrected)"))
    console.print(f"search vs best heuristic: {report.search_speedup:.3f}x")
    return f"best: {name}", plan, result
