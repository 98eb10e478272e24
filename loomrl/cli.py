"""The `loomrl` command: train | sft | rm | eval | demo | plan | timeline | report | calibrate | config.

Every subcommand takes an optional YAML config followed by ``key.sub=value`` overrides. Any user error (bad
config, missing file, unusable checkpoint) prints one line, ``loomrl: error: ...``, and exits with status 2;
an interrupted run exits with 130 after its ``finally`` blocks have run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from loomrl.errors import ConfigError, DataError, LoomError

CHROME_TRACE_FILE = "timeline.trace.json"


def _config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """An optional YAML file first, then overrides; a later word without '=' is reported as a bad override."""
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def _cmd_train(args: argparse.Namespace) -> int:
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
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
    from loomrl.config.schema import SFTConfig
    from loomrl.config.tools import load_config
    from loomrl.train.sft import run_sft

    path, overrides = _config_and_overrides(args.config)
    cfg = load_config(SFTConfig, path, overrides)
    print(_summary_line(run_sft(cfg, progress=not args.quiet), ("loss", "eval/exact_match", "eval/score")))
    print(f"checkpoint: {cfg.out_dir}")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from loomrl.config.schema import RMConfig
    from loomrl.config.tools import load_config
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


def _cmd_export(args: argparse.Namespace) -> int:
    from loomrl.checkpoint.store import CHECKPOINTS_DIR, export_checkpoint, latest_checkpoint

    path = Path(args.checkpoint)
    if (path / CHECKPOINTS_DIR).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise DataError(f"run '{path}': has no complete checkpoint to export")
        path = latest
    out = export_checkpoint(path, args.role, args.out)
    print(f"wrote {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from loomrl.commands.demo import run_demo

    run_demo(args.config_dir, args.out, args.overrides)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import math

    from rich.console import Console

    from loomrl.plan import make_plan
    from loomrl.planner.cost.corrections import Corrections
    from loomrl.planner.describe import planner_inputs
    from loomrl.plan.hardware import load_profile

    if not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise ConfigError(f"--time-budget: {args.time_budget:g} is not a number of seconds > 0")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: '{out}' is a file; give a directory for the plan and its timeline")
    run, bytes_per_param = _run_description(args)
    workflow, cluster, configs, workload, settings = planner_inputs(run)
    profile = load_profile(args.profile) if args.profile else None
    corrections = Corrections.load(args.corrections) if args.corrections else None
    console = Console(width=max(120, Console().width))
    title = (f"{run.algo} on {cluster}: {run.prompts} prompts × {run.responses_per_prompt}, {run.prompt_len:g} + "
             f"{workload.mean_response:.0f} (max {workload.max_response}) tokens, {run.models.actor}")
    if run.plan:
        from loomrl.planner.describe import simulate_fixed

        plan = make_plan(run.plan, workflow, cluster)
        report = simulate_fixed(plan, workflow, configs, workload, profile=profile, corrections=corrections,
                                bytes_per_param=bytes_per_param, settings=settings)
        _print_fixed(console, title, report)
        name, plan, result = "given plan", plan, report.result
    else:
        name, plan, result = _compare(console, title, run, (workflow, cluster, configs, workload, settings),
                                      profile, corrections, bytes_per_param, args)
    from loomrl.report.timeline import render_timeline

    try:  # made only now: a rejected plan leaves no directory behind
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out: cannot create '{out}' ({err.strerror})") from None
    plan.save(out / "best_plan.json")
    render_timeline(result, out / "timeline.png", out / "timeline.html", title=f"{name}: "
                    f"{result.iteration_time:.2f} s/iteration")
    if not result.feasible:
        console.print(f"the plan does not fit in memory: {result.reason}")
    console.print(f"{name}: {result.iteration_time:.3g} s/iteration; wrote {out / 'best_plan.json'} (loomrl train "
                  f"--plan accepts it) and {out / 'timeline.png'}, {out / 'timeline.html'}")
    return 0


def _run_description(args: argparse.Namespace):
    """The run ``loomrl plan`` prices: a train config's algorithm (the positional config), then a workload file
    (``--workload``), then the flags given; and the weights' element size of the config's precision."""
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import deep_merge, from_dict, load_config, read_yaml
    from loomrl.planner.cost.model import PRECISION_BYTES
    from loomrl.planner.describe import RunDescription
    from loomrl.planner.cost.lengths import length_fields

    path, overrides = _config_and_overrides(args.config)
    cfg = load_config(TrainConfig, path, overrides)
    algo, rollout = cfg.algo, cfg.rollout
    data: dict = {"algo": algo.name, "ppo_epochs": algo.ppo_epochs, "optimizer_steps": algo.minibatches,
                  "responses_per_prompt": algo.samples_per_prompt, "response_max": rollout.max_new_tokens,
                  "recompute_logprobs": algo.recompute_logprobs or rollout.top_k > 0 or rollout.top_p < 1.0}
    if args.workload:
        data = deep_merge(data, read_yaml(args.workload))
    flags = {key: getattr(args, key) for key in _RUN_FLAGS if getattr(args, key, None) is not None}
    if args.response_len is not None:
        lengths = length_fields(flags.pop("response_len"))
        if "response_len" in lengths and "response_spread" not in lengths and args.response_max is None \
                and not args.workload:
            lengths["response_max"] = None  # a mean alone: every response that long, as before
        if "observed_lengths" not in lengths:
            lengths["observed_lengths"] = None  # a distribution given here replaces observed lengths of the file
        flags.update({key: value for key, value in lengths.items() if key not in flags})
    engine = {key: getattr(args, key) for key in _ENGINE_FLAGS if getattr(args, key, None) is not None}
    models = {role: getattr(args, f"{role}_model") for role in ("actor", "critic", "ref", "reward")
              if getattr(args, f"{role}_model", None)}
    if args.model:
        models.setdefault("actor", args.model)
    if getattr(args, "judge_model", None):
        models["judges"] = list(args.judge_model)
    data = deep_merge(data, {**flags, **({"engine": engine} if engine else {}), **({"models": models} if models else {})})
    if "models" not in data:
        data["models"] = {"actor": "llama2-7b"}
    run = from_dict(RunDescription, data, "run")
    return run, PRECISION_BYTES.get(cfg.runtime.precision)


_RUN_FLAGS = ("cluster", "prompts", "responses_per_prompt", "prompt_len", "response_len", "response_max",
              "response_spread", "optimizer_steps", "ppo_epochs", "recompute_logprobs", "plan", "decode_slots",
              "generated_per_kept", "judge_tokens")
"""Flags of ``loomrl plan`` that set a field of :class:`~loomrl.planner.describe.RunDescription` (same names)."""
_ENGINE_FLAGS = ("gen_memory_fraction", "gen_max_seqs", "gen_request_batch", "gen_precision", "train_precision",
                 "optimizer_offload", "packing", "logits", "sync_tensor_s", "expert_parallel")
"""Flags that set a field of :class:`~loomrl.planner.cost.system.SystemSettings` (same names)."""


def _print_fixed(console, title: str, report) -> None:
    from loomrl.report import summary_table

    total = report.result.iteration_time
    rows = [{"stage": stage, "seconds": seconds, "share of the iteration": seconds / total if total else 0.0}
            for stage, seconds in report.stages.items()]
    rows.append({"stage": "iteration", "seconds": total, "share of the iteration": 1.0})
    console.print(summary_table(rows, f"{title}: the given plan, stage by stage (one steady iteration)"))
    calls = [{"step": step, "seconds": seconds} for step, seconds in report.calls.items() if seconds > 0]
    console.print(summary_table(calls, "each step of that iteration (on its busiest device)"))


def _compare(console, title: str, run, inputs, profile, corrections, bytes_per_param, args):
    """Heuristics, search and bound side by side (no fixed plan): the best plan found."""
    import math

    from loomrl.planner.search.bounds import segment_seconds
    from loomrl.planner.planning import compare_plans
    from loomrl.report import summary_table

    workflow, cluster, configs, workload, settings = inputs
    report = compare_plans(workflow, cluster, configs, workload, seed=args.seed, time_budget_s=args.time_budget,
                           profile=profile, corrections=corrections, bytes_per_param=bytes_per_param,
                           settings=settings)
    console.print(summary_table(report.rows, title))
    name, plan, result = report.best
    bound = report.bound.seconds
    if math.isfinite(bound):
        console.print(f"lower bound: no plan of the search's space runs faster than {bound:.3g} s/iteration "
                      f"(best found: {result.iteration_time / bound:.3f}x of it; see loomrl.planner.search.bounds)")
        if report.bound.training:
            console.print("the bound holds for every training placement; it is least for "
                          + ", ".join(report.bound.training))
        parts = report.bound.segments
        spent = segment_seconds(result, [part.calls for part in parts])
        rows = [{"segment (runs alone, in turn)": ", ".join(part.calls), "bound s": part.seconds, "best plan s": t,
                 "plan / bound": t / part.seconds if part.seconds > 0 else math.nan} for part, t in zip(parts, spent)]
        console.print(summary_table(rows, "where the best plan stands, segment by segment (uncorrected)"))
    console.print(f"search vs best heuristic: {report.search_speedup:.3f}x")
    return f"best: {name}", plan, result


def _cmd_timeline(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loomrl.planner.calibration.local import usable_cores
    from loomrl.planner.cost.corrections import Corrections
    from loomrl.plan.hardware import PROFILES, load_profile
    from loomrl.report.run_timeline import placement_marks, predicted_run, read_traces, result_from_traces
    from loomrl.report.timeline import render_timelines

    traces = read_traces(args.run_dir)
    measured = result_from_traces(traces, last_iterations=args.iterations or None)
    panels = [(f"measured ({len(measured.iteration_ends)} iterations)", measured)]
    marks = {panels[0][0]: placement_marks(args.run_dir, traces, args.iterations or None)}  # dynamic placement's
    if not args.measured_only:
        profile = load_profile(args.profile) if args.profile else PROFILES["local"]
        corrections = Corrections.load(args.corrections) if args.corrections else None
        predicted = predicted_run(args.run_dir, profile, corrections, cores=usable_cores() if args.profile else None,
                                  iterations=max(2, len(measured.iteration_ends)))
        source = f"profile {profile.name}" + (", fitted corrections" if corrections else ", uncorrected")
        panels.insert(0, (f"predicted ({source})", predicted))
    out = Path(args.run_dir)
    render_timelines(panels, out / "timeline.png", out / "timeline.html", title=f"{out.name}: each schedule step "
                     "per device" + (", the simulator's prediction above the measured run" if len(panels) > 1 else ""),
                     marks=marks)
    for name, result in panels:
        print(f"{name}: {result.iteration_time:.3g} s/iteration")
    print(f"wrote {out / 'timeline.png'} and {out / 'timeline.html'}")
    if args.chrome:
        from loomrl.report.chrome_trace import write_chrome_trace

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

    from loomrl.planner.calibration.local import calibrate_local
    from loomrl.plan.hardware import PROFILES

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.runs:
        profile = calibrate_local(args.devices)
        (out / "local_profile.json").write_text(json.dumps(dc.asdict(profile), indent=2))
        print(json.dumps(dc.asdict(profile), indent=2))
        print(f"wrote {out / 'local_profile.json'}")
        return 0
    from loomrl.planner.calibration.local import usable_cores
    from loomrl.planner.calibration.runs import fit_from_runs
    from loomrl.plan.hardware import load_profile

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
    from loomrl.config import schema as C
    from loomrl.config.tools import describe

    cls = {"train": C.TrainConfig, "sft": C.SFTConfig, "rm": C.RMConfig, "eval": C.EvalConfig}[args.command]
    for path, type_name, default, doc in describe(cls):
        print(f"{path:32} {type_name:18} {default:14} {doc}")
    return 0


def _summary_line(metrics: dict, keys: Sequence[str]) -> str:
    return "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


class _Parser(argparse.ArgumentParser):
    """argparse with the command's own errors: one line, ``loomrl: error: ...``, and status 2 (no usage block);
    the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"loomrl: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loomrl", description="RLHF as a dataflow of model function calls.")
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
    p = sub.add_parser("export", help="write a role of a checkpoint (sharded or not) as a Hugging Face directory "
                                      "that from_pretrained loads")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN", help="a run's checkpoints/iter_N, or a run directory "
                   "(its latest checkpoint)")
    p.add_argument("--role", default="actor", help="the trained role to export (default: actor)")
    p.add_argument("--out", help="the directory to write (default: CHECKPOINT/hf/ROLE)")
    p.set_defaults(fn=_cmd_export)
    p = sub.add_parser("demo", help="SFT warm start -> reward model -> PPO, with a summary")
    p.add_argument("--config-dir", help="directory with sft.yaml, rm.yaml, ppo.yaml (default: the demo's own, "
                                        "shipped in the package as loomrl/examples/demo)")
    p.add_argument("--out", default="runs/demo", help="where every stage writes its outputs")
    p.add_argument("overrides", nargs="*", help="stage.key=value, e.g. ppo.loop.iterations=10 sft.steps=50")
    p.set_defaults(fn=_cmd_demo)
    p = sub.add_parser("plan", help="compare colocate/interleave/separate with a searched plan on a cluster, or "
                                    "simulate a given plan (--plan) stage by stage")
    _add_plan_arguments(p, cfg_help)
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



def _add_plan_arguments(p: argparse.ArgumentParser, cfg_help: str) -> None:
    """The flags of ``loomrl plan``: the run's description (:class:`~loomrl.planner.describe.RunDescription`), its
    engine settings, and the planning budget and outputs."""
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--workload", help="YAML run description (the fields of loomrl.planner.describe.RunDescription: "
                                      "models, cluster, lengths, engine, plan); the flags below override it")
    p.add_argument("--cluster", help="device kind:nodes x devices, e.g. h100:8x8, a800:4x8, gb200:1x16 "
                                     "(default h100:1x8)")
    p.add_argument("--plan", help="simulate this plan as given (strategy, plan string or plan file) and print its "
                                  "stage breakdown instead of searching")
    p.add_argument("--model", help="architecture of every role: a preset (llama2-7b, llama3.1-8b, qwen3-32b, "
                                   "qwen3-30b-a3b, opt-13b, ...), an HF config.json, a zoo model or a checkpoint dir")
    for role in ("actor", "critic", "ref", "reward"):
        extra = "; 'rule' for a rule-based reward with no model" if role == "reward" else ""
        p.add_argument(f"--{role}-model", help=f"architecture of the {role} (default: --model){extra}")
    p.add_argument("--judge-model", action="append", help="a generative reward model (a judge): its architecture, as "
                                                           "--model; repeat for several judges")
    p.add_argument("--judge-tokens", type=int, help="tokens of each judge's verdict (default 8)")
    p.add_argument("--prompts", type=int, help="prompts per iteration (default 512)")
    p.add_argument("--responses-per-prompt", type=int, help="samples per prompt (default: the algorithm's group)")
    p.add_argument("--prompt-len", type=float, help="mean prompt tokens (default 128)")
    p.add_argument("--response-len", help="response lengths: a mean in tokens (alone: every response that long), "
                                          "lognormal:mean=M,sigma=S,max=N, or a JSONL of observed lengths (or a "
                                          "run directory: its metrics)")
    p.add_argument("--response-max", type=int, help="longest response (the limit; default rollout.max_new_tokens)")
    p.add_argument("--response-spread", type=float, help="σ of the log-normal response lengths between mean and "
                                                         "limit (default 0.75, a stated assumption)")
    p.add_argument("--optimizer-steps", type=int, help="optimizer steps per epoch (default: algo.minibatches)")
    p.add_argument("--ppo-epochs", type=int, help="passes over the samples per iteration")
    p.add_argument("--recompute-logprobs", action="store_const", const=True, help="an actor_inf call recomputes "
                                                                                  "the behaviour log-probs")
    p.add_argument("--decode-slots", type=int, help="samples one generation replica decodes at once")
    p.add_argument("--generated-per-kept", type=float, help="prompts generated per prompt trained (dynamic "
                                                            "sampling's waves; a run's sampling/prompts over "
                                                            "rollout.prompts_per_iter; default 1)")
    p.add_argument("--gen-memory-fraction", type=float, help="serving engine's share of device memory "
                                                             "(vLLM gpu_memory_utilization)")
    p.add_argument("--gen-max-seqs", type=int, help="serving engine's max concurrent sequences (vLLM max_num_seqs)")
    p.add_argument("--gen-request-batch", type=int, help="samples per synchronous request to a generation replica")
    p.add_argument("--gen-precision", choices=("auto", "bf16", "fp8"), help="generation weights")
    p.add_argument("--train-precision", choices=("auto", "bf16", "fp8"), help="training and scoring matmuls")
    p.add_argument("--optimizer-offload", action="store_const", const=True, help="Adam state in host memory")
    p.add_argument("--no-packing", dest="packing", action="store_const", const=False,
                   help="pad each training/scoring micro-batch to its longest sample (default: packed)")
    p.add_argument("--logits", choices=("fp32", "chunked"), help="logits held for every token or chunked")
    p.add_argument("--sync-tensor-s", type=float, help="seconds per parameter tensor of a weight sync")
    p.add_argument("--expert-parallel", type=int, help="ranks the experts of a MoE model are divided over in training")
    p.add_argument("--time-budget", type=float, default=30.0, help="seconds for planning: the bound, the heuristics' "
                                                                   "layout enumeration and the search together")
    p.add_argument("--seed", type=int, default=0, help="search seed")
    p.add_argument("--profile", help="hardware profile JSON replacing the cluster's (loomrl calibrate writes "
                                     "local_profile.json)")
    p.add_argument("--corrections", help="fitted corrections JSON (loomrl calibrate --from writes corrections.json)")
    p.add_argument("--out", default="runs/plan", help="where the plan and its timeline are written")

def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from loomrl.runtime.launch import quiet_libraries

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
