"""LoRA against full fine-tuning on SmolLM2-135M-Instruct: memory, optimizer step and weight sync, in one run.

    .venv/bin/python benchmarks/lora.py [--rank 16] [--iterations 4]

GRPO on the arithmetic chat task (8 prompts × 4 samples, 16 new tokens, KL 0.01 to the reference, fp32), once
with every weight trained and once with LoRA adapters of rank ``--rank`` on every projection (alpha 32), each mode
in two runs of its own process:

- **one worker** (reference executor: every call in one process, as one device of a colocated plan holds them):
  the process's peak resident memory, every AdamW step's seconds (timed with torch's global optimizer hooks) and
  the iteration's generation and actor training seconds;
  full fine-tuning holds a frozen reference copy, LoRA runs the reference on its base;
- **separate** (Ray runtime, ``runtime.plan=separate:1`` on 2 devices: generation on its own device, its shadow
  synced after each train step): the sync's seconds per iteration from the run's traces (from the moment both
  devices are in it to its end), and its bytes from the transfer plan the runtime executes.

Prints one table: medians over the iterations after the first (the first pays warm-ups) with their range.
What limits it: one CPU machine, so the sync runs over gloo within a host and its time is mostly fixed cost.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"


def overrides(run_dir: str, rank: int, iterations: int, separate: bool) -> list[str]:
    runtime = (
        ["runtime.executor=ray", "runtime.devices=2", "runtime.plan=separate:1", "runtime.threads=1"]
        if separate
        else ["runtime.executor=reference", "runtime.threads=2"]
    )
    return [
        f"run_dir={run_dir}",
        "seed=0",
        "task.name=arith",
        "task.level=1",
        f"actor.model={MODEL}",
        "actor.optim.lr=1e-5",
        *([f"actor.lora.r={rank}"] if rank else []),
        "algo.name=grpo",
        "algo.group_size=4",
        "algo.kl_coef=0.01",
        "algo.ppo_epochs=1",
        "algo.minibatches=1",
        "rollout.prompts_per_iter=8",
        "rollout.max_new_tokens=16",
        "rollout.temperature=0.7",
        f"loop.iterations={iterations}",
        "loop.eval_every=0",
        "loop.save_every=0",
        "loop.progress=false",
        "report.html=false",
        "runtime.device=cpu",
        "runtime.precision=fp32",
        *runtime,
    ]


def one(spec: dict) -> None:
    """A run in this process; prints its figures as JSON."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.runtime.launch import quiet_libraries
    from loomrl.train.rl import RLTrainer

    quiet_libraries()
    torch.set_num_threads(2)
    steps: list[float] = []
    began: list[float] = []
    register_optimizer_step_pre_hook(lambda *_: began.append(time.perf_counter()))
    register_optimizer_step_post_hook(lambda *_: steps.append(time.perf_counter() - began[-1]))
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(TrainConfig, None, overrides(run_dir, spec["rank"], spec["iterations"], spec["separate"]))
        RLTrainer(cfg).run()
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        traces = [json.loads(line) for line in (Path(run_dir) / "traces.jsonl").read_text().splitlines()]
    syncs = [max(t["end"]) - max(t["start"]) for t in traces if t["kind"] == "sync" and t["phase"] == "iteration"]
    print(
        json.dumps(
            {
                "iteration_s": [r["time/iteration_s"] for r in records],
                "gen_s": [r["time/actor_gen_s"] for r in records],
                "train_s": [r["time/actor_train_s"] for r in records],
                "optimizer_s": steps,
                "sync_s": syncs,
                "peak_rss_gb": peak_rss_gb(),
            }
        )
    )


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM); the Ray runtime's workers are not counted in it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def measure(rank: int, iterations: int, separate: bool) -> dict:
    spec = json.dumps({"rank": rank, "iterations": iterations, "separate": separate})
    done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"run (rank {rank}) failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def sync_bytes(rank: int) -> tuple[int, int]:
    """Bytes of each shadow sync of the separate plan, summed over its transfer plans (as the runtime plans them),
    and the parameters the actor trains."""
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.models.tokenizer import task_tokenizer
    from loomrl.models.zoo import parameter_shapes
    from loomrl.plan import ClusterSpec, plan_reallocation, separate
    from loomrl.plan.schedule import StepKind, build_schedule

    cfg = load_config(TrainConfig, None, overrides("unused", rank, 1, True))
    workflow = build_workflow(cfg.algo, cfg.rollout, cfg.reward, cfg.reference_role)
    cluster = ClusterSpec.parse("cpu:2")
    schedule = build_schedule(workflow, separate(workflow, cluster, 1))
    lora = cfg.actor.lora if cfg.actor.lora.enabled else None
    shapes, layers, tied = parameter_shapes(MODEL, task_tokenizer(cfg.task, MODEL), value=False, lora=lora)
    total = 0
    for step in schedule:
        if step.kind is StepKind.SYNC:
            role, src, dst = step.transfer
            total += plan_reallocation(shapes, layers, src, dst, cluster.node_of, False, tied).bytes_moved(4)
    return total, sum(math.prod(shape) for shape in shapes.values())


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    kept = values[1:] if len(values) > 1 else values
    if not kept:
        return "-"
    mid = statistics.median(kept) * scale
    return f"{fmt.format(mid)} ({fmt.format(min(kept) * scale)}–{fmt.format(max(kept) * scale)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(json.loads(args.one))
    from rich.console import Console

    from loomrl.report import summary_table

    rows = []
    figures = {}
    for name, rank in (("full fine-tuning", 0), (f"LoRA r={args.rank}", args.rank)):
        worker = measure(rank, args.iterations, separate=False)
        split = measure(rank, args.iterations, separate=True)
        moved, trained = sync_bytes(rank)
        figures[name] = (worker, split, moved)
        rows.append(
            {
                "mode": name,
                "trained params M": f"{trained / 1e6:.2f}",
                "1 worker peak RSS GB": f"{worker['peak_rss_gb']:.2f}",
                "optimizer step ms": spread(worker["optimizer_s"], 1e3, "{:.1f}"),
                "1 worker iteration s": spread(worker["iteration_s"]),
                "generation s": spread(worker["gen_s"]),
                "actor train s": spread(worker["train_s"]),
                "sync MiB": f"{moved / 2**20:.1f}",
                "sync ms (separate)": spread(split["sync_s"], 1e3, "{:.1f}"),
                "separate iteration s": spread(split["iteration_s"]),
            }
        )
    full, lora = figures.values()
    console = Console(width=200)
    console.print(
        summary_table(
            rows,
            f"SmolLM2-135M GRPO, 8 prompts x 4 samples, 16 tokens, fp32, {args.iterations} iterations; "
            "medians after the first (range)",
        )
    )
    print(
        f"sync bytes {full[2] / lora[2]:.1f}x fewer with LoRA; optimizer step "
        f"{statistics.median(full[0]['optimizer_s'][1:]) / statistics.median(lora[0]['optimizer_s'][1:]):.1f}x "
        f"faster; one worker's peak memory {full[0]['peak_rss_gb'] - lora[0]['peak_rss_gb']:.2f} GB less"
    )


if __name__ == "__main__":
    main()
