"""The `loomrl` command: train | sft | rm | eval | demo | plan | timeline | report | calibrate | config | import-gguf.

Every subcommand takes an optional YAML config followed by ``key.sub=value`` overrides. Any user error (bad
config, missing file, unusable checkpoint) prints one line, ``loomrl: error: ...``, and exits with status 2;
an interrupted run exits with 130 after its ``finally`` blocks have run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from loomrl.errors import LoomError

# Each command's body lives in loomrl.commands, imported only when that command runs (`loomrl --help` stays fast).


def _train(args: argparse.Namespace) -> int:
    from loomrl.commands.train import run

    return run(args)


def _sft(args: argparse.Namespace) -> int:
    from loomrl.commands.sft import run_sft_command

    return run_sft_command(args)


def _rm(args: argparse.Namespace) -> int:
    from loomrl.commands.sft import run_rm_command

    return run_rm_command(args)


def _eval(args: argparse.Namespace) -> int:
    from loomrl.commands.evaluate import run_eval_command

    return run_eval_command(args)


def _export(args: argparse.Namespace) -> int:
    from loomrl.commands.evaluate import run_export_command

    return run_export_command(args)


def _demo(args: argparse.Namespace) -> int:
    if args.model is not None:
        from loomrl.commands.demo_pretrained import run_pretrained_demo

        run_pretrained_demo(args.model, args.out or "runs/demo_pretrained", args.overrides)
        return 0
    from loomrl.commands.demo import run_demo

    run_demo(args.config_dir, args.out or "runs/demo", args.overrides)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from loomrl.commands.plan import run

    return run(args)


def _timeline(args: argparse.Namespace) -> int:
    from loomrl.commands.timeline import run_timeline_command

    return run_timeline_command(args)


def _report(args: argparse.Namespace) -> int:
    from loomrl.commands.timeline import run_report_command

    return run_report_command(args)


def _calibrate(args: argparse.Namespace) -> int:
    from loomrl.commands.calibrate import run

    return run(args)


def _config(args: argparse.Namespace) -> int:
    from loomrl.commands.config import run

    return run(args)


def _import_gguf(args: argparse.Namespace) -> int:
    from loomrl.commands.import_gguf import run

    return run(args)


def _is_override(arg: str) -> bool:
    """``key.sub=value``: a config override, not an option."""
    key, sep, _ = arg.partition("=")
    return bool(sep) and not key.startswith("-") and bool(key)


class _Parser(argparse.ArgumentParser):
    """argparse with the command's own errors: one line, ``loomrl: error: ...``, and status 2 (no usage block);
    the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"loomrl: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loomrl", description="RLHF as a dataflow of model function calls.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cfg_help = "optional YAML config, then key.sub=value overrides (see `loomrl config train`)"
    _add_training_parsers(sub, cfg_help)
    _add_checkpoint_parsers(sub)
    _add_demo_parser(sub)
    p = sub.add_parser(
        "plan",
        help="compare colocate/interleave/separate with a searched plan on a cluster, or "
        "simulate a given plan (--plan) stage by stage",
    )
    _add_plan_arguments(p, cfg_help)
    p.set_defaults(fn=_plan)
    _add_run_tool_parsers(sub)
    _add_serve_parser(sub)
    _add_import_gguf_parser(sub)
    return parser


def _add_training_parsers(sub, cfg_help: str) -> None:
    """``loomrl train``, ``sft`` and ``rm``: a config and its overrides."""
    p = sub.add_parser("train", help="RL training (ppo, grpo, rloo, remax, reinforce_pp)")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in run_dir")
    p.add_argument("--ray-address", help="join this Ray cluster (same as runtime.ray_address=...)")
    p.add_argument(
        "--plan",
        help="execution plan: colocate | interleave | separate[:N] | plan string | plan file (same as runtime.plan)",
    )
    p.set_defaults(fn=_train)
    for name, fn, what in (
        ("sft", _sft, "supervised warm start on task demonstrations"),
        ("rm", _rm, "Bradley-Terry reward model on preference pairs"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("config", nargs="*", help=cfg_help)
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(fn=fn)


def _add_checkpoint_parsers(sub) -> None:
    """``loomrl eval`` and ``export``: what a checkpoint does, and a checkpoint as a plain HF directory."""
    p = sub.add_parser("eval", help="greedy accuracy and pass@k of a checkpoint (or a run's latest) on a prompt set")
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_OR_RUN",
        help="a model checkpoint directory, a run's "
        "checkpoints/iter_N, or a run directory (its latest checkpoint, its task settings)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value, e.g. samples=16 pass_k=[1,16] task.eval_file=x.jsonl (see `loomrl config eval`)",
    )
    p.set_defaults(fn=_eval)
    p = sub.add_parser(
        "export",
        help="write a role of a checkpoint (sharded or not) as a Hugging Face directory that from_pretrained loads",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_OR_RUN",
        help="a run's checkpoints/iter_N, or a run directory (its latest checkpoint)",
    )
    p.add_argument("--role", default="actor", help="the trained role to export (default: actor)")
    p.add_argument("--out", help="the directory to write (default: CHECKPOINT/hf/ROLE)")
    form = p.add_mutually_exclusive_group()
    form.add_argument(
        "--merged",
        dest="form",
        action="store_const",
        const="merged",
        help="a LoRA role's adapters merged into its base: a plain model (the default)",
    )
    form.add_argument(
        "--adapter",
        dest="form",
        action="store_const",
        const="adapter",
        help="a LoRA role as a PEFT adapter directory (default --out: CHECKPOINT/hf/ROLE-adapter)",
    )
    p.set_defaults(fn=_export)


def _add_run_tool_parsers(sub) -> None:
    """``loomrl timeline``, ``report``, ``calibrate`` and ``config``: looking at runs, the machine and the fields."""
    p = sub.add_parser(
        "timeline",
        help="draw a run's measured timeline, step by step (RUN_DIR/traces.jsonl), "
        "below the simulator's prediction of the same run",
    )
    p.add_argument("run_dir")
    p.add_argument("--iterations", type=int, default=3, help="draw the last N iterations (0: all)")
    p.add_argument(
        "--profile",
        help="hardware profile JSON to predict with (loomrl calibrate writes "
        "local_profile.json; default: the nominal local profile)",
    )
    p.add_argument("--corrections", help="fitted corrections JSON to predict with (loomrl calibrate --from)")
    p.add_argument("--measured-only", action="store_true", help="draw the measured run alone")
    p.add_argument(
        "--chrome",
        action="store_true",
        help="also write RUN_DIR/timeline.trace.json, every step of "
        "the run (and the prediction) in the Chrome trace format that Perfetto and chrome://tracing open",
    )
    p.set_defaults(fn=_timeline)
    p = sub.add_parser(
        "report",
        help="write RUN_DIR/report.html: curves, timelines, plan and config in one page "
        "(runs write it themselves as they go)",
    )
    p.add_argument("run_dir")
    p.set_defaults(fn=_report)
    p = sub.add_parser("calibrate", help="measure this machine, or fit cost-model corrections from runs")
    p.add_argument("--from", dest="runs", nargs="*", default=[], help="run directories to fit corrections from")
    p.add_argument("--devices", type=int, help="devices to measure as (default: one per core)")
    p.add_argument("--out", default="runs/calibration", help="where local_profile.json / corrections.json go")
    p.set_defaults(fn=_calibrate)
    p = sub.add_parser("config", help="list every config field with its type, default and meaning")
    p.add_argument("command", choices=("train", "sft", "rm", "eval"))
    p.set_defaults(fn=_config)


def _add_demo_parser(sub) -> None:
    """``loomrl demo``: the three-stage demo, or GRPO on a pretrained model (``--model``)."""
    p = sub.add_parser("demo", help="SFT warm start -> reward model -> PPO, with a summary")
    p.add_argument(
        "--config-dir",
        help="directory with sft.yaml, rm.yaml, ppo.yaml (default: the demo's own, "
        "shipped in the package as loomrl/examples/demo)",
    )
    p.add_argument(
        "--model",
        help="instead: GRPO on this pretrained chat model (smollm2-135m-instruct) on the arithmetic task, its "
        "held-out accuracy before and after (about 8 minutes on 2 cores); overrides then start with grpo.",
    )
    p.add_argument("--out", help="where every stage writes its outputs (default runs/demo, runs/demo_pretrained)")
    p.add_argument("overrides", nargs="*", help="stage.key=value, e.g. ppo.loop.iterations=10 sft.steps=50")
    p.set_defaults(fn=_demo)


def _add_import_gguf_parser(sub) -> None:
    """``loomrl import-gguf``: a GGUF file or a pretrained name converted once into a checkpoint directory."""
    p = sub.add_parser(
        "import-gguf",
        help="convert a GGUF model file (or a pretrained name: smollm2-135m-instruct) once into a safetensors "
        "Hugging Face directory that model fields accept",
    )
    p.add_argument("source", help="a .gguf file, or a pretrained name")
    p.add_argument("out", nargs="?", help="the directory to write (default for a pretrained name: its cache entry)")
    p.set_defaults(fn=_import_gguf)


def _add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve-rollouts",
        help="serve a model at an OpenAI-compatible endpoint whose conversations are episodes, keeping their exact "
        "tokens and log-probs for training",
    )
    p.add_argument("model", help="a zoo name, a pretrained name or a checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    p.add_argument("--max-tokens", type=int, default=1024, help="an episode's tokens after its prompt, at most")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=32, help="turns decoded together at most")
    p.add_argument(
        "--max-len",
        type=int,
        default=2048,
        help="an episode's prompt and response tokens, at most (and the model's positions); the KV cache holds "
        "--slots × --max-len tokens",
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="a request body's bytes, at most (else 413)")
    p.add_argument("--max-messages", type=int, default=256, help="messages in one request, at most")
    p.add_argument("--max-episodes", type=int, default=1024, help="episodes open at once, at most (else 429)")
    p.add_argument(
        "--idle-timeout", type=float, default=600.0, help="seconds an open episode may go without a request (0: any)"
    )
    p.add_argument(
        "--kept-tokens",
        type=int,
        default=0,
        help="cache tokens kept for episodes waiting on their agents, together (0: --slots × --max-len)",
    )
    p.add_argument("--turn-timeout", type=float, default=600.0, help="seconds a turn may take before a 504 (0: any)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="the engine's CPU threads (0: all cores but one, which the HTTP side needs; at least 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default="auto", help="'auto' (the tokenizer's) or a Jinja template file")
    p.add_argument(
        "--stop-token",
        action="append",
        default=[],
        help="a token besides eos that ends a turn (repeatable; one token of the vocabulary, e.g. the template's "
        "end-of-turn marker)",
    )
    p.add_argument("--trajectories", help="append each ended episode's trajectory here, one JSON line each")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.set_defaults(fn=_serve_rollouts)


def _serve_rollouts(args: argparse.Namespace) -> int:
    from loomrl.commands.serve_rollouts import run_serve_rollouts

    return run_serve_rollouts(args)


def _add_plan_arguments(p: argparse.ArgumentParser, cfg_help: str) -> None:
    """The flags of ``loomrl plan``: the run's description (:class:`~loomrl.planner.describe.RunDescription`), its
    system settings, and the planning budget and outputs."""
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument(
        "--workload",
        help="YAML run description (the fields of loomrl.planner.describe.RunDescription: "
        "models, cluster, lengths, system, plan); the flags below override it",
    )
    p.add_argument(
        "--cluster", help="device kind:nodes x devices, e.g. h100:8x8, a800:4x8, gb200:1x16 (default h100:1x8)"
    )
    p.add_argument(
        "--plan",
        help="simulate this plan as given (strategy, plan string or plan file) and print its "
        "stage breakdown instead of searching",
    )
    p.add_argument(
        "--model",
        help="architecture of every role: a preset (llama2-7b, llama3.1-8b, qwen3-32b, "
        "qwen3-30b-a3b, opt-13b, ...), an HF config.json, a zoo model or a checkpoint dir",
    )
    for role in ("actor", "critic", "ref", "reward"):
        extra = "; 'rule' for a rule-based reward with no model" if role == "reward" else ""
        p.add_argument(f"--{role}-model", help=f"architecture of the {role} (default: --model){extra}")
    p.add_argument(
        "--judge-model",
        action="append",
        help="a generative reward model (a judge): its architecture, as --model; repeat for several judges",
    )
    p.add_argument("--judge-tokens", type=int, help="tokens of each judge's verdict (default 8)")
    _add_plan_workload_arguments(p)
    _add_plan_system_arguments(p)
    _add_plan_budget_arguments(p)


def _add_plan_workload_arguments(p: argparse.ArgumentParser) -> None:
    """``loomrl plan``: what an iteration does (prompts, lengths, steps)."""
    p.add_argument("--prompts", type=int, help="prompts per iteration (default 512)")
    p.add_argument("--responses-per-prompt", type=int, help="samples per prompt (default: the algorithm's group)")
    p.add_argument("--prompt-len", type=float, help="mean prompt tokens (default 128)")
    p.add_argument(
        "--response-len",
        help="response lengths: a mean in tokens (alone: every response that long), "
        "lognormal:mean=M,sigma=S,max=N, or a JSONL of observed lengths (or a "
        "run directory: its metrics)",
    )
    p.add_argument("--response-max", type=int, help="longest response (the limit; default rollout.max_new_tokens)")
    p.add_argument(
        "--response-spread",
        type=float,
        help="σ of the log-normal response lengths between mean and limit (default 0.75, a stated assumption)",
    )
    p.add_argument("--optimizer-steps", type=int, help="optimizer steps per epoch (default: algo.minibatches)")
    p.add_argument("--ppo-epochs", type=int, help="passes over the samples per iteration")
    p.add_argument(
        "--recompute-logprobs",
        action="store_const",
        const=True,
        help="an actor_inf call recomputes the behaviour log-probs",
    )


def _add_plan_system_arguments(p: argparse.ArgumentParser) -> None:
    """``loomrl plan``: the system it runs on (generation engine, precision, packing, weight sync)."""
    p.add_argument("--decode-slots", type=int, help="samples one generation replica decodes at once")
    p.add_argument(
        "--generated-per-kept",
        type=float,
        help="prompts generated per prompt trained (dynamic "
        "sampling's waves; a run's sampling/prompts over "
        "rollout.prompts_per_iter; default 1)",
    )
    p.add_argument(
        "--gen-memory-fraction",
        type=float,
        help="serving engine's share of device memory (vLLM gpu_memory_utilization)",
    )
    p.add_argument("--gen-max-seqs", type=int, help="serving engine's max concurrent sequences (vLLM max_num_seqs)")
    p.add_argument("--gen-request-batch", type=int, help="samples per synchronous request to a generation replica")
    p.add_argument("--gen-precision", choices=("auto", "bf16", "fp8"), help="generation weights")
    p.add_argument("--train-precision", choices=("auto", "bf16", "fp8"), help="training and scoring matmuls")
    p.add_argument("--optimizer-offload", action="store_const", const=True, help="Adam state in host memory")
    p.add_argument(
        "--no-packing",
        dest="packing",
        action="store_const",
        const=False,
        help="pad each training/scoring micro-batch to its longest sample (default: packed)",
    )
    p.add_argument("--logits", choices=("fp32", "chunked"), help="logits held for every token or chunked")
    p.add_argument("--sync-tensor-s", type=float, help="seconds per parameter tensor of a weight sync")
    p.add_argument("--expert-parallel", type=int, help="ranks the experts of a MoE model are divided over in training")


def _add_plan_budget_arguments(p: argparse.ArgumentParser) -> None:
    """``loomrl plan``: the planning budget, its choices and where it writes."""
    p.add_argument(
        "--time-budget",
        type=float,
        default=30.0,
        help="seconds for planning: the bound, the heuristics' layout enumeration and the search together",
    )
    p.add_argument(
        "--search-steps",
        type=int,
        help="bound planning by work instead of seconds: the bound and heuristics complete, each search chain "
        "takes this many proposals (the same plan on any machine)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="let the search choose asynchronous training up to this staleness (policy versions a batch's sampler "
        "may lag the policy it trains; 0: synchronous and fused plans only)",
    )
    p.add_argument(
        "--no-factor",
        action="store_true",
        help="price without the profile's system_factor (a global factor fitted on published runs)",
    )
    p.add_argument("--seed", type=int, default=0, help="search seed")
    p.add_argument(
        "--profile", help="hardware profile JSON replacing the cluster's (loomrl calibrate writes local_profile.json)"
    )
    p.add_argument("--corrections", help="fitted corrections JSON (loomrl calibrate --from writes corrections.json)")
    p.add_argument("--out", default="runs/plan", help="where the plan and its timeline are written")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (argparse stops a positional list at the first option)
    if extra and isinstance(getattr(args, "config", None), list) and all(_is_override(e) for e in extra):
        args.config += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
