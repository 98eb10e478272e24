"""Inter-stage fusion on this machine: generation + inference stage time, unfused vs fused, on a heavy-tailed
workload, with the simulator's predictions and a sweep of the migration threshold.

    .venv/bin/python benchmarks/fusion.py [--model llama-10m] [--prompts 64] [--iterations 8] [--devices 2]
                                          [--repeats 3] [--no-sweep]

The workload: the demo task's prompts, each sample with its own token budget drawn from a lognormal (median
16, sigma 1), clipped to [4, MAX], and a few samples set at MAX (eos ignored, so a sample's length is its
budget): a long tail. The stage: the actor's generation, then the reference's log-probs, a critic's values and
the task's rule reward (PPO's rollout and inference calls; no training), colocated on every device with pure
data parallelism, run by the Ray runtime. Unfused, inference waits for the longest sample; fused, finished
samples stream into inference and, at the threshold, the tail migrates onto one replica so the others run
inference meanwhile (``stream_fusion=migrate_at:R,migrate_to:1``). The unfused stage runs twice: as the ``colocate``
strategy (each scoring call one micro-batch, padded to the shard's longest sample) and with 4 micro-batches per
scoring call (sorted by length, each computed to its own longest). The fused variants run that second plan, with
fusion added, and fusion's speedup is against the better unfused stage, so it counts the overlap, not padding
the unfused stage need not pay. Each variant's seconds per
iteration is the median over the iterations after the first, every variant measured in this one process. The
headline, fused with ``migrate_at: auto`` (what a user runs) against the better unfused stage, is the median over
``--repeats`` interleaved rounds of those three variants; the swept thresholds run once each and are printed
beside it (the best of them is picked after measuring, so it is no baseline).

Predictions: the machine's profile is measured (``calibrate_local``) and the cost model's corrections are fitted
on calibration runs of *other* workloads (uniform budgets, unfused), never on the runs predicted here. The
``auto`` variant lets the runtime choose the threshold each iteration by simulating the lengths it observed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from loomrl.algorithms.ops import generate_chunks, generate_op, logprob_op, reward_op, values_op  # noqa: E402
from loomrl.config.schema import RuntimeConfig, TaskConfig  # noqa: E402
from loomrl.data.sources import build_task, examples_window, prompt_source  # noqa: E402
from loomrl.errors import LoomError  # noqa: E402
from loomrl.models.presets import model_config  # noqa: E402
from loomrl.models.tokenizer import build_char_tokenizer, encode_prompt  # noqa: E402
from loomrl.plan import ClusterSpec, make_plan  # noqa: E402
from loomrl.plan.cluster import profile_for  # noqa: E402
from loomrl.plan.hardware import load_profile  # noqa: E402
from loomrl.plan.model_shape import ModelShape  # noqa: E402
from loomrl.planner.calibration.local import calibrate_local, usable_cores  # noqa: E402
from loomrl.planner.calibration.traces import trace_predictor  # noqa: E402
from loomrl.planner.cost.corrections import Corrections, fit_corrections  # noqa: E402
from loomrl.planner.cost.model import CostModel  # noqa: E402
from loomrl.planner.cost.system import RUNTIME  # noqa: E402
from loomrl.planner.cost.workload import Workload  # noqa: E402
from loomrl.planner.inputs import PlannerInputs  # noqa: E402
from loomrl.planner.simulation.simulator import simulate  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.role.spec import RoleSpec  # noqa: E402
from loomrl.rollout import SamplingParams  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402
from loomrl.runtime.ray_executor import RayExecutor  # noqa: E402
from loomrl.runtime.spec import WorkerSpec  # noqa: E402
from loomrl.workflow import MFC, MFCKind, Workflow  # noqa: E402
from loomrl.workflow.batch import Batch  # noqa: E402

SWEEP = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
"""Migration thresholds measured (the fraction of the batch unfinished when the tail migrates)."""
SHAPED = ("actor", "ref", "critic")
"""The roles with a model (the reward is the task's rule)."""


def stage_workflow(max_new_tokens: int) -> Workflow:
    """Generation (per-sample budgets, eos ignored) and PPO's inference calls, without training."""
    params = SamplingParams(max_new_tokens, 1.0, ignore_eos=True)
    gen, inf = MFCKind.GENERATE, MFCKind.INFERENCE
    seq = ("prompt_ids", "response_ids")
    return Workflow(
        [
            MFC(
                "actor_gen",
                "actor",
                gen,
                ("prompt_ids", "max_new_tokens"),
                ("response_ids", "logp", "mask"),
                partial(generate_op, params=params),
                stream=partial(generate_chunks, params=params),
            ),
            MFC("ref_inf", "ref", inf, seq, ("ref_logp",), partial(logprob_op, out_key="ref_logp", temperature=1.0)),
            MFC("critic_inf", "critic", inf, seq, ("values",), values_op),
            MFC("reward_inf", "reward", inf, (*seq, "prompt_text", "answer"), ("score",), reward_op),
        ],
        ("prompt_ids", "max_new_tokens", "prompt_text", "answer"),
    )


def budgets(prompts: int, longest: int, tail: int, seed: int = 0) -> list[int]:
    """Per-sample budgets: lognormal(median 16, sigma 1) in [4, longest], ``tail`` of them at ``longest``."""
    rng = random.Random(seed)
    out = [min(longest, max(4, round(rng.lognormvariate(2.77, 1.0)))) for _ in range(prompts)]
    for k in rng.sample(range(prompts), tail):
        out[k] = longest
    return out


def make_batch(prompts: int, lengths: list[int]) -> Batch:
    task = build_task(TaskConfig())
    tok = build_char_tokenizer()
    examples = examples_window(prompt_source(TaskConfig(), task, 0, "train"), 0, prompts)
    return Batch(
        list(range(prompts)),
        {
            "prompt_ids": [encode_prompt(tok, ex.prompt) for ex in examples],
            "prompt_text": [ex.prompt for ex in examples],
            "answer": [ex.answer for ex in examples],
            "max_new_tokens": list(lengths),
        },
    )


def worker_spec(model: str) -> WorkerSpec:
    roles = {
        "actor": RoleSpec("actor", model, "model"),
        "ref": RoleSpec("ref", model, "model"),
        "critic": RoleSpec("critic", model, "model", value_head=True, seed=1),
        "reward": RoleSpec("reward", None, "reward.model", rule=True),
    }
    return WorkerSpec(roles, TaskConfig(), None, 0, device="cpu", threads=1, timeout_s=1800)


def run(
    plan_text: str, workflow: Workflow, batch: Batch, spec: WorkerSpec, runtime: RuntimeConfig, iterations: int
) -> tuple[float, list[dict]]:
    """Median seconds per iteration after the first, and every step's traces."""
    cluster = ClusterSpec(nodes=1, devices_per_node=runtime.devices, device_kind="cpu")
    # what the controller prices `migrate_at: auto` with: the profile and corrections the runtime names
    profile = load_profile(runtime.cost_profile) if runtime.cost_profile else profile_for(cluster)
    corrections = Corrections.load(runtime.cost_corrections) if runtime.cost_corrections else None
    configs = {role: None if s.model is None else model_config(s.model) for role, s in spec.roles.items()}
    inputs = PlannerInputs(workflow, cluster, profile, configs, Workload(len(batch), 0.0, (1,)), RUNTIME, corrections)
    executor = RayExecutor(runtime, spec, workflow, make_plan(plan_text, workflow, cluster), inputs)
    times, traces, chosen = [], [], []
    try:
        for it in range(iterations):
            began = time.perf_counter()
            result = executor.run_iteration(it, batch)
            times.append(time.perf_counter() - began)
            traces += [t.to_dict() for t in result.traces]
            chosen.append(result.stats.get("fusion/migrate_at"))
    finally:
        executor.close()
    return statistics.median(times[1:]), traces, chosen


def observations(traces: list[dict], workload: Workload, allocation: str) -> list[dict]:
    """The calibration run's call times as cost-model observations (its first iteration left out)."""
    lengths = sorted(workload.response_lengths)
    out = []
    for t in traces:
        if t["iteration"] == 0 or t["kind"] != "call" or t["role"] not in SHAPED:
            continue
        out.append(
            {
                "mfc": t["step"],
                "kind": t["mfc_kind"],
                "role": t["role"],
                "allocation": allocation,
                "batch": workload.batch,
                "prompt_len": workload.prompt_len,
                "response_mean": statistics.fmean(lengths),
                "response_p90": lengths[int(0.9 * (len(lengths) - 1))],
                "response_max": lengths[-1],
                "epochs": 1,
                "minibatches": 1,
                "seconds": max(t["end"]) - min(t["start"]),
            }
        )
    return out


HEADLINE = ("unfused", "unfused, scoring mb4", "fused, migrate_at auto")
"""The variants every round runs; the swept thresholds run in the first round only."""


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-10m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--longest", type=int, default=160, help="the budget of the tail samples (MAX)")
    ap.add_argument("--tail", type=int, default=3, help="samples at MAX")
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs of the unfused stages and of fused auto, in interleaved rounds"
    )
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the swept thresholds")
    args = ap.parse_args()
    if args.iterations < 2:
        ap.error(f"--iterations: {args.iterations} leaves none measured (the first is left out; valid: 2 or more)")
    if not 0 <= args.tail <= args.prompts:
        ap.error(f"--tail: {args.tail} samples at MAX (valid: 0 to --prompts, {args.prompts})")
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats} (valid: 1 or more)")
    return args


def _calibrate(args, tmp: Path, workflow, spec, cluster, profile, shapes, prompt: float, heavy: list[int]):
    """The cost model of the heavy-tailed workload, its corrections fitted on other workloads (uniform budgets,
    short and long, unfused), written to ``tmp`` for ``migrate_at:auto``; and the runtime that reads them."""
    runtime = RuntimeConfig(devices=args.devices, timeout_s=1800)
    found = []
    for length in (12, 48):
        uniform = make_batch(args.prompts, [length] * args.prompts)
        _, traces, _ = run("colocate", workflow, uniform, spec, runtime, 3)
        found += observations(traces, Workload(args.prompts, prompt, (length,)), f"0-{args.devices - 1}")
    corrections = fit_corrections(found, trace_predictor(cluster, profile, shapes, settings=RUNTIME))
    (tmp / "profile.json").write_text(json.dumps(dataclasses.asdict(profile)))
    (tmp / "corrections.json").write_text(corrections.dumps())
    cost = CostModel(
        cluster, profile, shapes, Workload(args.prompts, prompt, tuple(heavy)), corrections, settings=RUNTIME
    )
    auto = RuntimeConfig(
        devices=args.devices,
        timeout_s=1800,
        cost_profile=str(tmp / "profile.json"),
        cost_corrections=str(tmp / "corrections.json"),
    )
    return cost, auto


def _variant_plans(args, auto: RuntimeConfig) -> dict[str, tuple[str, RuntimeConfig]]:
    """Variant name → (plan string, runtime settings)."""
    runtime = RuntimeConfig(devices=args.devices, timeout_s=1800)
    dp = f"0-{args.devices - 1}:dp{args.devices}"
    scored = f"actor_gen={dp}; ref_inf={dp}mb4; critic_inf={dp}mb4; reward_inf={dp}"
    variants = {"unfused": ("colocate", runtime), "unfused, scoring mb4": (scored, runtime)}
    if args.sweep:
        variants |= {
            f"fused, migrate_at {r}": (f"{scored}; stream_fusion=migrate_at:{r},migrate_to:1", runtime) for r in SWEEP
        }
    variants["fused, migrate_at auto"] = (f"{scored}; stream_fusion=migrate_at:auto,migrate_to:1", auto)
    return variants


def _measure(args, variants: dict, workflow, batch, spec) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Every variant's median seconds per run and the thresholds ``auto`` chose, in interleaved rounds (so that a
    slow spell of the machine hits every variant)."""
    measured: dict[str, list[float]] = {name: [] for name in variants}
    picks: dict[str, list] = {name: [] for name in variants}
    for round_ in range(args.repeats):
        for name, (text, rt) in variants.items():
            if round_ and name not in HEADLINE:
                continue
            seconds, _, chosen = run(text, workflow, batch, spec, rt, args.iterations)
            measured[name].append(seconds)
            picks[name] += [c for c in chosen if c is not None]
    return measured, picks


def _better_unfused(measured: dict[str, list[float]]) -> float:
    """The better unfused stage's median seconds (in hindsight): every row's baseline."""
    return min(statistics.median(measured["unfused"]), statistics.median(measured["unfused, scoring mb4"]))


def _rows(variants: dict, measured: dict, picks: dict, workflow, cluster, cost, memory: float) -> list[dict]:
    rows = []
    for name, (text, _) in variants.items():
        seconds = statistics.median(measured[name])
        predicted = simulate(make_plan(text, workflow, cluster), workflow, cost, memory).iteration_time
        rows.append(
            {
                "variant": name,
                "runs": len(measured[name]),
                "measured s (median)": seconds,
                "spread": f"{min(measured[name]):.3f}-{max(measured[name]):.3f}",
                "predicted s": predicted,
                "error": abs(predicted - seconds) / seconds,
                "chosen migrate_at": ",".join(sorted({f"{c:g}" for c in picks[name]})) or "-",
            }
        )
    base = _better_unfused(measured)
    for row in rows:
        row["speedup vs better unfused"] = base / row["measured s (median)"]
    return rows


def _report(args, rows: list[dict], measured: dict[str, list[float]], started: float) -> None:
    # each round's better unfused stage against that round's fused auto: the headline, a median over rounds
    rounds = [min(u, m) / a for u, m, a in zip(*(measured[name] for name in HEADLINE))]
    base = _better_unfused(measured)
    console = Console()
    console.print(
        summary_table(
            rows,
            f"Fused generation + inference, {args.model}, {args.prompts} samples, "
            f"{args.devices} devices, budgets median 16, {args.tail} at {args.longest}",
        )
    )
    console.print(
        f"headline: fused with migrate_at auto against the better unfused stage, median of {len(rounds)} rounds: "
        f"{statistics.median(rounds):.2f}x (rounds {', '.join(f'{r:.2f}' for r in rounds)})"
    )
    if args.sweep:
        swept = {r: statistics.median(measured[f"fused, migrate_at {r}"]) for r in SWEEP}
        best = min(swept, key=swept.get)
        auto_vs_best = statistics.median(measured["fused, migrate_at auto"]) / swept[best] - 1
        console.print(
            f"best swept threshold (one run each, picked after measuring: not a baseline a user has): migrate_at "
            f"{best}, {base / swept[best]:.2f}x; auto {auto_vs_best:+.1%} against it"
        )
    console.print(f"wall time {time.perf_counter() - started:.0f} s")


def main() -> None:
    args = _arguments()
    quiet_libraries()
    started = time.perf_counter()
    workflow, spec = stage_workflow(args.longest), worker_spec(args.model)
    cluster = ClusterSpec(nodes=1, devices_per_node=args.devices, device_kind="cpu")
    heavy = budgets(args.prompts, args.longest, args.tail)
    batch = make_batch(args.prompts, heavy)
    prompt = statistics.fmean(len(p) for p in batch["prompt_ids"])
    shapes = {r: ModelShape.from_config(model_config(args.model)) for r in SHAPED}
    profile = calibrate_local(1)
    if args.devices > usable_cores():
        profile = dataclasses.replace(profile, devices_share_cores=-(-args.devices // usable_cores()))
    with tempfile.TemporaryDirectory() as d:
        cost, auto = _calibrate(args, Path(d), workflow, spec, cluster, profile, shapes, prompt, heavy)
        variants = _variant_plans(args, auto)
        measured, picks = _measure(args, variants, workflow, batch, spec)
        rows = _rows(variants, measured, picks, workflow, cluster, cost, profile.memory_bytes)
    _report(args, rows, measured, started)


if __name__ == "__main__":
    try:
        main()
    except LoomError as err:  # a bad setting or plan: one line, as the loomrl command prints it
        raise SystemExit(f"{Path(__file__).name}: error: {err}") from None
