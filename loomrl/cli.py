"""The `loomrl` command: train | sft | rm | eval | demo | plan | timeline | report | calibrate | config.

Every subcommand takes an optional YAML config followed by ``key.sub=value`` overrides. Any user error (bad
config, missing file, unusable checkpoint) prints one line, ``loomrl: error: ...``, and exits with status 2;
an interrupted run exits with 130 after its ``finally`` blocks have run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from loomrl.errors import LoomError

CHROME_TRACE_FILE = "timeline.trace.json"


def _config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """An optional YAML file first, then overrides; a later word without '=' is reported as a bad override."""
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def _cmd_train(args: argparse.Namespace) -> int:
    from loomrl.config import TrainConfig
    from loomrl.configtools import load_config
    from loomrl.train.rl import RLTrainer

    path, overrides = _config_and_overrides(args.config)
    if args.ray_address:
        overrides.append(f"runtime.ray_address={args.ray_address}")
    cfg = load_config(TrainConfig, path, overrides)
    if args.plan:  # set after parsing: plan strings hold '=' and ':' that YAML would misread
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=args.plan))
    metrics = RLTrainer(cfg).run(resume=args.resume)
    print(_summary_line(metrics, ("reward/mean", "eval/exact_match", "kl/mean", "response/length")))
    print(f"outputs: {cfg.run_dir}")
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from loomrl.config import SFTConfig
    from loomrl.configtools import load_config
    from loomrl.train.sft import run_sft

    path, overrides = _config_and_overrides(args.config)
    cfg = load_config(SFTConfig, path, overrides)
    print(_summary_line(run_sft(cfg, progress=not args.quiet), ("loss", "eval/exact_match", "eval/score")))
    print(f"checkpoint: {cfg.out_dir}")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from loomrl.config import RMConfig
    from loomrl.configtools import load_config
    from loomrl.train.rm import run_rm

    path, overrides = _config_and_overrides(args.config)
    cfg = load_config(RMConfig, path, overrides)
    print(_summary_line(run_rm(cfg, progress=not args.quiet), ("loss", "eval/pair_accuracy")))
    print(f"checkpoint: {cfg.out_dir}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loomrl.report import summary_table
    from loomrl.train.evaluation import eval_config, resolve_target, run_eval

    target = resolve_target(args.checkpoint)
    cfg = eval_config(target, args.overrides)
    results = run_eval(cfg, target.out_dir)
    rows = [{"metric": key, "value": value} for key, value in results.items()
            if key.startswith(("greedy/", "pass@", "sampled_"))]
    print(f"evaluated {cfg.model}")
    Console().print(summary_table(rows, f"{results['prompts']} prompts, {cfg.samples} samples each"))
    print(f"wrote {results['written_to']}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from loomrl.demo import run_demo

    run_demo(args.config_dir, args.out, args.overrides)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import math
    from pathlib import Path

    from rich.console import Console

    from loomrl.algorithms.workflows import build_workflow
    from loomrl.config import TrainConfig
    from loomrl.configtools import load_config
    from loomrl.plan import ClusterSpec
    from loomrl.planner.bounds import segment_seconds
    from loomrl.planner.corrections import Corrections
    from loomrl.planner.cost import PRECISION_BYTES
    from loomrl.planner.planning import compare_plans, model_config
    from loomrl.planner.profiles import load_profile
    from loomrl.planner.timeline import render_timeline
    from loomrl.planner.workload import Workload
    from loomrl.report import summary_table

    path, overrides = _config_and_overrides(args.config)
    cfg = load_config(TrainConfig, path, overrides)
    workflow = build_workflow(cfg.algo, cfg.rollout)
    cluster = ClusterSpec.parse(args.cluster)
    # Every role is priced as a model of its architecture (a rule-only reward is then a conservative estimate).
    configs = {role: model_config(getattr(args, f"{role}_model") or args.model) for role in workflow.roles()}
    group = cfg.algo.group_size if cfg.algo.name in ("grpo", "rloo") else 1
    workload = Workload(batch=args.prompts * group, prompt_len=args.prompt_len,
                        response_lengths=(args.response_len or cfg.rollout.max_new_tokens,),
                        ppo_epochs=cfg.algo.ppo_epochs, minibatches=cfg.algo.minibatches)
    profile = load_profile(args.profile) if args.profile else None
    corrections = Corrections.load(args.corrections) if args.corrections else None
    report = compare_plans(workflow, cluster, configs, workload, seed=args.seed, time_budget_s=args.time_budget,
                           profile=profile, corrections=corrections,
                           bytes_per_param=PRECISION_BYTES.get(cfg.runtime.precision))
    console = Console()
    console.print(summary_table(report.rows, f"{cfg.algo.name} on {cluster}: {args.prompts} prompts × "
                                             f"{args.prompt_len} + {workload.max_response} tokens, {args.model}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name, plan, result = report.best
    plan.save(out / "best_plan.json")
    render_timeline(result, out / "timeline.png", out / "timeline.html", title=f"{name}: "
                    f"{result.iteration_time:.2f} s/iteration")
    if not result.feasible:
        console.print(f"no plan fits in memory: {result.reason}")
    bound = report.bound.seconds
    if math.isfinite(bound):
        console.print(f"lower bound: no plan of the search's space runs faster than {bound:.3g} s/iteration "
                      f"(best found: {result.iteration_time / bound:.3f}x of it; see loomrl.planner.bounds)")
        if report.bound.training:
            console.print("the bound holds for every training placement; it is least for "
                          + ", ".join(report.bound.training))
        parts = report.bound.segments
        spent = segment_seconds(result, [part.calls for part in parts])
        rows = [{"segment (runs alone, in turn)": ", ".join(part.calls), "bound s": part.seconds, "best plan s": t,
                 "plan / bound": t / part.seconds if part.seconds > 0 else math.nan} for part, t in zip(parts, spent)]
        console.print(summary_table(rows, "where the best plan stands, segment by segment (uncorrected)"))
    console.print(f"best: {name}, {result.iteration_time:.3g} s/iteration; search vs best heuristic: "
                  f"{report.search_speedup:.3f}x; wrote {out / 'best_plan.json'} (loomrl train --plan accepts it) "
                  f"and {out / 'timeline.png'}, {out / 'timeline.html'}")
    return 0


def _cmd_timeline(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loomrl.planner.calibrate import usable_cores
    from loomrl.planner.corrections import Corrections
    from loomrl.planner.profiles import PROFILES, load_profile
    from loomrl.planner.run_timeline import predicted_run, read_traces, result_from_traces
    from loomrl.planner.timeline import render_timelines

    traces = read_traces(args.run_dir)
    measured = result_from_traces(traces, last_iterations=args.iterations or None)
    panels = [(f"measured ({len(measured.iteration_ends)} iterations)", measured)]
    if not args.measured_only:
        profile = load_profile(args.profile) if args.profile else PROFILES["local"]
        corrections = Corrections.load(args.corrections) if args.corrections else None
        predicted = predicted_run(args.run_dir, profile, corrections, cores=usable_cores() if args.profile else None,
                                  iterations=max(2, len(measured.iteration_ends)))
        source = f"profile {profile.name}" + (", fitted corrections" if corrections else ", uncorrected")
        panels.insert(0, (f"predicted ({source})", predicted))
    out = Path(args.run_dir)
    render_timelines(panels, out / "timeline.png", out / "timeline.html", title=f"{out.name}: each schedule step "
                     "per device" + (", the simulator's prediction above the measured run" if len(panels) > 1 else ""))
    for name, result in panels:
        print(f"{name}: {result.iteration_time:.3g} s/iteration")
    print(f"wrote {out / 'timeline.png'} and {out / 'timeline.html'}")
    if args.chrome:
        from loomrl.planner.chrome_trace import write_chrome_trace

        predicted = panels[0][1] if len(panels) > 1 else None
        path = write_chrome_trace(out / CHROME_TRACE_FILE, traces, predicted, title=out.name)
        print(f"wrote {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from loomrl.report.html import write_run_report

    print(f"wrote {write_run_report(args.run_dir)}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import dataclasses as dc
    import json
    from pathlib import Path

    from loomrl.planner.calibrate import calibrate_local
    from loomrl.planner.profiles import PROFILES

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.runs:
        profile = calibrate_local(args.devices)
        (out / "local_profile.json").write_text(json.dumps(dc.asdict(profile), indent=2))
        print(json.dumps(dc.asdict(profile), indent=2))
        print(f"wrote {out / 'local_profile.json'}")
        return 0
    from loomrl.planner.calibrate import usable_cores
    from loomrl.planner.calibration_runs import fit_from_runs
    from loomrl.planner.profiles import load_profile

    saved = out / "local_profile.json"
    measured = saved.is_file()
    profile = load_profile(saved) if measured else PROFILES["local"]
    # the runs were made on this machine: their devices shared its cores (known only for a measured profile)
    corrections = fit_from_runs(args.runs, profile, cores=usable_cores() if measured else None)
    (out / "corrections.json").write_text(corrections.dumps())
    print(corrections.dumps())
    print(f"wrote {out / 'corrections.json'} (profile: {profile.name})")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from loomrl import config as C
    from loomrl.configtools import describe

    cls = {"train": C.TrainConfig, "sft": C.SFTConfig, "rm": C.RMConfig, "eval": C.EvalConfig}[args.command]
    for path, type_name, default, doc in describe(cls):
        print(f"{path:32} {type_name:18} {default:14} {doc}")
    return 0


def _summary_line(metrics: dict, keys: Sequence[str]) -> str:
    return "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loomrl", description="RLHF as a dataflow of model function calls.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cfg_help = "optional YAML config, then key.sub=value overrides (see `loomrl config train`)"
    p = sub.add_parser("train", help="RL training (ppo, grpo, rloo, remax, reinforce_pp)")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in run_dir")
    p.add_argument("--ray-address", help="join this Ray cluster (same as runtime.ray_address=...)")
    p.add_argument("--plan", help="execution plan: colocate | interleave | separate[:N] | plan string | "
                                  "plan file (same as runtime.plan)")
    p.set_defaults(fn=_cmd_train)
    for name, fn, what in (("sft", _cmd_sft, "supervised warm start on task demonstrations"),
                           ("rm", _cmd_rm, "Bradley-Terry reward model on preference pairs")):
        p = sub.add_parser(name, help=what)
        p.add_argument("config", nargs="*", help=cfg_help)
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(fn=fn)
    p = sub.add_parser("eval", help="greedy accuracy and pass@k of a checkpoint (or a run's latest) on a prompt set")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN", help="a model checkpoint directory, a run's "
                   "checkpoints/iter_N, or a run directory (its latest checkpoint, its task settings)")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. samples=16 pass_k=[1,16] task.eval_file=x.jsonl "
                                                "(see `loomrl config eval`)")
    p.set_defaults(fn=_cmd_eval)
    p = sub.add_parser("demo", help="SFT warm start -> reward model -> PPO, with a summary")
    p.add_argument("--config-dir", help="directory with sft.yaml, rm.yaml, ppo.yaml (default: the demo's own, "
                                        "shipped in the package as loomrl/examples/demo)")
    p.add_argument("--out", default="runs/demo", help="where every stage writes its outputs")
    p.add_argument("overrides", nargs="*", help="stage.key=value, e.g. ppo.loop.iterations=10 sft.steps=50")
    p.set_defaults(fn=_cmd_demo)
    p = sub.add_parser("plan", help="compare colocate/interleave/separate with a searched plan on a cluster")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--cluster", default="h100:1x8", help="device kind:nodes x devices, e.g. h100:8x8, a100:2x8")
    p.add_argument("--model", default="llama2-7b", help="architecture of every role: llama2-7b|13b|34b|70b, a zoo "
                                                       "model (llama-1m...) or a checkpoint directory")
    for role in ("actor", "critic", "ref", "reward"):
        p.add_argument(f"--{role}-model", help=f"architecture of the {role} (default: --model)")
    p.add_argument("--prompts", type=int, default=512, help="prompts per iteration")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--response-len", type=int, help="response tokens (default: rollout.max_new_tokens)")
    p.add_argument("--time-budget", type=float, default=30.0, help="seconds for planning: the heuristics' layout enumeration, then the search in what is left")
    p.add_argument("--seed", type=int, default=0, help="search seed")
    p.add_argument("--profile", help="hardware profile JSON replacing the cluster's (loomrl calibrate writes "
                                     "local_profile.json)")
    p.add_argument("--corrections", help="fitted corrections JSON (loomrl calibrate --from writes corrections.json)")
    p.add_argument("--out", default="runs/plan", help="where the best plan and its timeline are written")
    p.set_defaults(fn=_cmd_plan)
    p = sub.add_parser("timeline", help="draw a run's measured timeline, step by step (RUN_DIR/traces.jsonl), "
                                        "below the simulator's prediction of the same run")
    p.add_argument("run_dir")
    p.add_argument("--iterations", type=int, default=3, help="draw the last N iterations (0: all)")
    p.add_argument("--profile", help="hardware profile JSON to predict with (loomrl calibrate writes "
                                     "local_profile.json; default: the nominal local profile)")
    p.add_argument("--corrections", help="fitted corrections JSON to predict with (loomrl calibrate --from)")
    p.add_argument("--measured-only", action="store_true", help="draw the measured run alone")
    p.add_argument("--chrome", action="store_true", help=f"also write RUN_DIR/{CHROME_TRACE_FILE}, every step of "
                   "the run (and the prediction) in the Chrome trace format that Perfetto and chrome://tracing open")
    p.set_defaults(fn=_cmd_timeline)
    p = sub.add_parser("report", help="write RUN_DIR/report.html: curves, timelines, plan and config in one page "
                                      "(runs write it themselves as they go)")
    p.add_argument("run_dir")
    p.set_defaults(fn=_cmd_report)
    p = sub.add_parser("calibrate", help="measure this machine, or fit cost-model corrections from runs")
    p.add_argument("--from", dest="runs", nargs="*", default=[], help="run directories to fit corrections from")
    p.add_argument("--devices", type=int, help="devices to measure as (default: one per core)")
    p.add_argument("--out", default="runs/calibration", help="where local_profile.json / corrections.json go")
    p.set_defaults(fn=_cmd_calibrate)
    p = sub.add_parser("config", help="list every config field with its type, default and meaning")
    p.add_argument("command", choices=("train", "sft", "rm", "eval"))
    p.set_defaults(fn=_cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from loomrl.launch import quiet_libraries

    quiet_libraries()
    try:
        return args.fn(args)
    except LoomError as err:
        print(f"loomrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loomrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
