"""`loomrl demo` (what `make demo` runs): SFT warm start → reward model → PPO, then a summary.

The SFT stage is deliberately short so that RL has room to improve the policy; the summary compares the
held-out greedy exact match of the SFT policy with that of the PPO policy, reports the reward model's
held-out pair accuracy, the time of each stage and where every output is.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from rich.console import Console

from loomrl.config.schema import RMConfig, SFTConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.report import summary_table
from loomrl.report.run_timeline import read_traces, result_from_traces
from loomrl.report.timeline import render_timeline
from loomrl.run_dir import RunDir
from loomrl.train.rl import RLTrainer
from loomrl.train.rm import run_rm
from loomrl.train.sft import run_sft

STAGES = ("sft", "rm", "ppo")


def _stage_overrides(overrides: Sequence[str]) -> dict[str, list[str]]:
    """Split 'sft.steps=50 ppo.loop.iterations=10' by stage."""
    out: dict[str, list[str]] = {s: [] for s in STAGES}
    for item in overrides:
        stage, _, rest = item.partition(".")
        if stage not in out or not rest:
            raise ConfigError(f"demo override '{item}': must start with one of {', '.join(s + '.' for s in STAGES)}")
        out[stage].append(rest)
    return out


def _fresh_dir(out: Path) -> None:
    """Keep the previous demo's outputs as OUT.previous instead of deleting or mixing them."""
    if out.exists():
        previous = out.with_name(out.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        out.rename(previous)
    out.mkdir(parents=True)


def load_stage_configs(config_dir: str, out: Path, overrides: Sequence[str]):
    """The three stage configs, wired together: RM and PPO start from the SFT checkpoint, PPO uses the RM."""
    by_stage = _stage_overrides(overrides)
    d = Path(config_dir)
    sft = load_config(SFTConfig, d / "sft.yaml", [f"out_dir={out / 'sft'}", *by_stage["sft"]])
    rm = load_config(RMConfig, d / "rm.yaml", [f"out_dir={out / 'rm'}", f"model={sft.out_dir}", *by_stage["rm"]])
    ppo = load_config(
        TrainConfig,
        d / "ppo.yaml",
        [f"run_dir={out / 'ppo'}", f"actor.model={sft.out_dir}", f"reward.model={rm.out_dir}", *by_stage["ppo"]],
    )
    return sft, rm, ppo


def demo_configs() -> Path:
    """The demo's stage configs, shipped inside the package (so `loomrl demo` runs from an installed wheel)."""
    return Path(str(resources.files("loomrl"))) / "examples" / "demo"


def run_demo(config_dir: str | None, out_dir: str, overrides: Sequence[str] = ()) -> dict:
    console = Console()
    out = Path(out_dir)
    config_dir = config_dir or str(demo_configs())
    sft_cfg, rm_cfg, ppo_cfg = load_stage_configs(config_dir, out, overrides)  # all validated before any work
    _fresh_dir(out)
    console.rule("[bold]1/3 SFT warm start")
    sft = run_sft(sft_cfg)
    console.rule("[bold]2/3 reward model")
    rm = run_rm(rm_cfg)
    console.rule("[bold]3/3 PPO")
    t0 = time.perf_counter()
    ppo = RLTrainer(ppo_cfg).run()
    ppo["seconds"] = time.perf_counter() - t0
    timeline = RunDir(ppo_cfg.run_dir).timeline
    render_timeline(
        result_from_traces(read_traces(ppo_cfg.run_dir)),
        timeline,
        timeline.with_suffix(".html"),
        title="PPO on the Ray runtime: measured per-call timeline",
    )
    summary = {
        "sft": sft,
        "rm": rm,
        "ppo": ppo,
        "exact_match_gain": ppo["eval/exact_match"] - sft["eval/exact_match"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    rows = [
        {
            "stage": "SFT",
            "seconds": sft["seconds"],
            "held-out exact match": sft["eval/exact_match"],
            "held-out score": sft["eval/score"],
        },
        {"stage": "reward model", "seconds": rm["seconds"], "pair accuracy": rm["eval/pair_accuracy"]},
        {
            "stage": "PPO",
            "seconds": ppo["seconds"],
            "held-out exact match": ppo["eval/exact_match"],
            "held-out score": ppo["eval/score"],
        },
    ]
    console.print(summary_table(rows, "loomrl demo"))
    console.print(
        f"held-out exact match (greedy): SFT {sft['eval/exact_match']:.3f} -> PPO "
        f"{ppo['eval/exact_match']:.3f} (gain {summary['exact_match_gain']:+.3f})"
    )
    run = Path(ppo_cfg.run_dir)
    console.print(
        f"outputs: SFT policy {sft_cfg.out_dir}; reward model {rm_cfg.out_dir}; PPO run {run} "
        f"(metrics.jsonl, checkpoints/, traces.jsonl); run report {RunDir(run).report} (open it in a "
        f"browser); reward curve {RunDir(run).reward_curve}; timeline {timeline} (.html); "
        f"summary {out / 'summary.json'}"
    )
    return summary
