"""Dynamic placement against the best static plan in hindsight, on drifting, reversing, two-phase and stationary
workloads.

    .venv/bin/python benchmarks/dynamic_placement.py [--iterations 32] [--prompts 32] [--devices 4] [--repeats 3]

The workload: PPO on digit sorting from a prompt file read in order, so iteration i's prompts are rows
i·P .. (i+1)·P − 1. In the drifting file the number of digits of iteration i's inputs follows a log-normal
(clipped to [1, MAX_DIGITS]) whose median grows geometrically from ``--first-median`` to ``--final-median`` over
the run and whose σ grows linearly from 0 to ``--final-sigma`` over its first ``--sigma-by`` share, then stays:
the responses of a policy warm-started on sorting inputs of every length up to MAX_DIGITS start alike, then grow
longer and long-tailed (as responses do over RL training). The reversing file makes the same drift over the first
half of the run and takes it back over the second, so its two ends are alike and its middle is not: a static plan
must serve both phases. The phases file puts the costs in other calls in each half (:func:`write_phases`): long
prompts with one-digit answers, then sorting with long, long-tailed responses; its policy is warm-started on both
tasks. The stationary file keeps the first iteration's distribution for the whole run. The reward
is the rule's partial credit plus a small share of a reward model (llama-10m, trained on sorting preferences)
scoring prompt and response, whose cost grows with them.

Per workload, dynamic placement starts from the plan priced fastest for the first iterations (a calibration
run of ``--calibration`` iterations on the colocated plan that re-plans after every iteration and never
switches, with the same refit, search and pricing dynamic placement uses) and runs with its default rule. Its
baseline is chosen in hindsight: colocate, that calibrated plan, every plan dynamic placement switched to and
every candidate it priced, each held fixed for the whole workload; the fastest of them (median run time) is the
best static plan in hindsight, and colocate is what a user without loomrl would run. Every placement runs
``--repeats`` times from the same seed (medians and spread). Time is each run's iterations plus, for dynamic
placement, its plan changes and its decisions' own time; every run is checked to give the same samples and
losses as the hindsight best (float summation order aside).

The ceiling: no placement that moves between the plans run here can beat the oracle that knows every plan's time at
every iteration in advance and switches between them at the measured cost of a plan change (a shortest path over
iterations × plans, :func:`oracle_seconds`; per-iteration medians over the repeats). It is printed as its own row,
with the cost of a switch and at no cost at all; the latter bounds what any switching rule can gain over the best
static plan among these.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402

from loomrl.config.schema import RMConfig, SFTConfig, TrainConfig  # noqa: E402
from loomrl.config.tools import load_config  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402
from loomrl.train.rl import RLTrainer  # noqa: E402
from loomrl.train.rm import run_rm  # noqa: E402
from loomrl.train.sft import run_sft  # noqa: E402

MAX_DIGITS = 96
"""Longest input (and so answer) of the prompt files; the warm start sees every length up to it."""
CALIBRATION_SEARCH_S = 5.0
"""Seconds of each search that chooses the static plan (a dynamic run's searches get a share of an iteration)."""
LENGTH_KEYS = ("response/length", "response/length_p90", "response/length_max")
LOSS_KEYS = ("actor/pg_loss", "critic/value_loss", "kl/mean", "actor/grad_norm", "critic/grad_norm")
REWARD = """from loomrl.data.tasks import partial_credit


def score(prompt, response, answer):
    return partial_credit(response, answer)
"""


def _sort_row(rng: random.Random, digits: int) -> dict:
    text = "".join(rng.choice("0123456789") for _ in range(digits))
    return {"prompt": f"sort {text}=", "answer": "".join(sorted(text))}


def _min_row(rng: random.Random, digits: int) -> dict:
    """A long prompt with a one-digit answer: scoring the prompt costs, generating the answer does not."""
    text = "".join(rng.choice("0123456789") for _ in range(digits))
    return {"prompt": f"min {text}=", "answer": min(text)}


def write_phases(path: Path, iterations: int, prompts: int, median: float, sigma: float, seed: int) -> None:
    """Two phases whose costs sit in different calls: the first half of the run asks for the smallest digit of
    inputs of about MAX_DIGITS × 3/4 digits (long prompts, one-token answers: the scoring and training passes over
    the prompts dominate), the second to sort inputs log-normal around ``median`` digits of spread ``sigma`` (long,
    long-tailed responses: generation dominates)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for it in range(iterations):
            for _ in range(prompts):
                if it < iterations // 2:
                    digits = min(MAX_DIGITS, max(1, round(rng.lognormvariate(math.log(MAX_DIGITS * 0.75), 0.2))))
                    f.write(json.dumps(_min_row(rng, digits)) + "\n")
                else:
                    digits = min(MAX_DIGITS, max(1, round(rng.lognormvariate(math.log(median), sigma))))
                    f.write(json.dumps(_sort_row(rng, digits)) + "\n")


def write_prompts(
    path: Path,
    iterations: int,
    prompts: int,
    first: float,
    last: float,
    sigma: float,
    sigma_by: float,
    seed: int,
    reverse: bool = False,
) -> None:
    """Rows in training order: iteration i's inputs log-normal around a median growing geometrically from
    ``first`` to ``last`` digits, of log-scale spread growing linearly from 0 to ``sigma`` over the first
    ``sigma_by`` of the run; with ``reverse`` the drift runs over the first half and back over the second."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for it in range(iterations):
            share = it / max(1, iterations - 1)
            if reverse:
                share = 1.0 - abs(2.0 * share - 1.0)
            median, spread = first * (last / first) ** share, sigma * min(1.0, share / sigma_by)
            for _ in range(prompts):
                digits = min(MAX_DIGITS, max(1, round(rng.lognormvariate(math.log(median), spread))))
                f.write(json.dumps(_sort_row(rng, digits)) + "\n")


def prepare(tmp: Path, sft_steps: int) -> None:
    """The reward function, the warm-start policy (tmp/sft: sorting inputs of 1..MAX_DIGITS digits) and the reward
    model (tmp/rm)."""
    (tmp / "sort_reward.py").write_text(REWARD)
    _sft(tmp, "sft", sft_steps, (_sort_row,))
    run_rm(
        load_config(
            RMConfig,
            None,
            [
                f"out_dir={tmp / 'rm'}",
                "model=llama-10m",
                "task.name=sort",
                "task.min_len=3",
                "task.max_len=32",
                "train_pairs=512",
                "epochs=1",
            ],
        ),
        progress=False,
    )


def _policy(tmp: Path, prompt_file: Path) -> Path:
    """The warm-start policy of a workload: the phases workload's is trained on both of its tasks (tmp/sft_mixed),
    every other one's on sorting alone."""
    return tmp / ("sft_mixed" if prompt_file.stem == "phases" else "sft")


def _sft(tmp: Path, name: str, sft_steps: int, rows: tuple) -> None:
    """SFT of the default policy into tmp/``name`` on inputs of 1..MAX_DIGITS digits of the tasks ``rows`` make, in
    turn."""
    rng = random.Random(1)
    with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for k in range(sft_steps * 64):
            f.write(json.dumps(rows[k % len(rows)](rng, rng.randint(1, MAX_DIGITS))) + "\n")
    task = [
        "task.name=file",
        f"task.prompt_file={tmp / f'{name}.jsonl'}",
        f"task.reward_fn={tmp / 'sort_reward.py'}:score",
    ]
    run_sft(
        load_config(
            SFTConfig,
            None,
            [
                f"out_dir={tmp / name}",
                f"steps={sft_steps}",
                "batch_size=64",
                "optim.lr=0.003",
                "eval_prompts=64",
                f"max_new_tokens={MAX_DIGITS + 1}",
                *task,
            ],
        ),
        progress=False,
    )


def _config(
    tmp: Path, name: str, prompt_file: Path, iterations: int, prompts: int, devices: int, plan: str, *extra: str
) -> TrainConfig:
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp / name}",
            "seed=0",
            "task.name=file",
            f"task.prompt_file={prompt_file}",
            f"task.reward_fn={tmp / 'sort_reward.py'}:score",
            f"actor.model={_policy(tmp, prompt_file)}",
            "actor.optim.lr=0.0003",
            "critic.optim.lr=0.001",
            "reward.source=both",
            f"reward.model={tmp / 'rm'}",
            "reward.model_weight=0.1",
            "algo.ppo_epochs=2",
            "algo.minibatches=2",
            f"rollout.prompts_per_iter={prompts}",
            f"rollout.max_new_tokens={MAX_DIGITS + 1}",
            f"loop.iterations={iterations}",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=32",
            "loop.progress=false",
            "report.html=false",
            "runtime.executor=ray",
            f"runtime.devices={devices}",
            "runtime.timeout_s=600",
            *extra,
        ],
    )
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))


def _run(cfg: TrainConfig) -> tuple[list[dict], list[dict], float]:
    """The run's metrics, its placement decisions (if any) and its wall-clock seconds."""
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # an earlier benchmark's run of the same name
    t0 = time.perf_counter()
    RLTrainer(cfg).run()
    wall = time.perf_counter() - t0
    run = Path(cfg.run_dir)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    path = run / "placement.jsonl"
    decisions = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return metrics, decisions, wall


def static_plan(tmp: Path, name: str, prompt_file: Path, calibration: int, prompts: int, devices: int) -> str:
    """The plan priced fastest for the first ``calibration`` iterations, measured on the colocated plan: the
    calibration run searches at every check for CALIBRATION_SEARCH_S seconds (its time is not counted) and never
    switches."""
    cfg = _config(
        tmp,
        name,
        prompt_file,
        calibration,
        prompts,
        devices,
        "colocate",
        "runtime.placement=dynamic",
        "runtime.dynamic.min_gain=0.99",
        "runtime.dynamic.drift=0.000001",
        f"runtime.dynamic.search_s={CALIBRATION_SEARCH_S}",
        "runtime.dynamic.search_share=1000",
    )
    _, decisions, _ = _run(cfg)
    last = decisions[-1]
    return last["candidate"] if last["candidate"] and last["candidate_s"] < last["current_s"] else last["plan"]


def _seconds(metrics: list[dict]) -> float:
    """A run's time: its iterations, plan changes and placement decisions."""
    return sum(
        m["time/iteration_s"] + m.get("time/plan_change_s", 0.0) + m.get("time/placement_s", 0.0) for m in metrics
    )


def _samples_equal(a: list[dict], b: list[dict]) -> bool:
    """Whether two runs drew the same responses (every iteration's length statistics equal) and scored them alike
    (mean reward within 1e-6: the reward model scores them in other micro-batches under another plan)."""
    return len(a) == len(b) and all(
        all(x[k] == y[k] for k in LENGTH_KEYS)
        and abs(x["reward/mean"] - y["reward/mean"]) <= 1e-6 * abs(y["reward/mean"])
        for x, y in zip(a, b)
    )


def _loss_diff(a: list[dict], b: list[dict]) -> float:
    """The largest relative difference of a loss or gradient norm between two runs, over every iteration."""
    return max(abs(x[k] - y[k]) / max(abs(y[k]), 1e-12) for x, y in zip(a, b) for k in LOSS_KEYS)


def oracle_seconds(times: dict[str, list[float]], switch_s: float) -> tuple[float, int]:
    """The least total time (and its number of switches) of a run that may take any of the plans ``times``
    (plan → seconds of each iteration) at each iteration, paying ``switch_s`` at each change of plan: a shortest
    path over iterations × plans, which no switching rule among these plans can beat."""
    plans = list(times)
    best = {p: (times[p][0], 0) for p in plans}
    for i in range(1, len(times[plans[0]])):
        best = {
            p: min(
                ((cost + (switch_s if q != p else 0.0) + times[p][i], n + (q != p)) for q, (cost, n) in best.items()),
            )
            for p in plans
        }
    return min(best.values())


MAX_STATIC = 6
"""Most static plans run in hindsight (colocate, the calibrated plan, then the plans dynamic placement switched
to and the candidates it priced, in that order)."""


def _oracle_row(times: dict[str, list[float]], cost: float, medians: dict[str, float], hindsight: str) -> dict:
    """The oracle's figures (:func:`oracle_seconds`) against the best static plan in hindsight and colocate."""
    seconds, switches = oracle_seconds(times, cost)
    return {
        "plan": f"any of the {len(times)} static plans at each iteration, {cost:.2f} s a switch",
        "run s (median)": seconds,
        "spread": "-",
        "vs hindsight best static": medians[hindsight] / seconds,
        "vs colocate": medians["colocate"] / seconds,
        "switches": str(switches),
        "decisions s": 0.0,
        "mean response first/last": "-",
        "same samples": "-",
        "max loss diff": "-",
    }


def compare(tmp: Path, workload: str, prompt_file: Path, args) -> tuple[list[dict], dict]:
    """Dynamic placement against every static plan it considered, each run for the whole workload ``--repeats``
    times (medians): the best of them in hindsight is the baseline, colocate (a user's plan without loomrl) is
    shown beside it. Also returns what the oracle rows are computed from (each static plan's per-iteration
    seconds and the cost of a switch)."""
    calibrated = static_plan(tmp, f"{workload}-calibration", prompt_file, args.calibration, args.prompts, args.devices)
    Console().print(f"[bold]{workload}[/]: calibrated static plan {calibrated}")

    def config(name: str, plan: str, *extra: str) -> TrainConfig:
        return _config(tmp, name, prompt_file, args.iterations, args.prompts, args.devices, plan, *extra)

    dynamic = [
        _run(config(f"{workload}-dynamic-{k}", calibrated, "runtime.placement=dynamic")) for k in range(args.repeats)
    ]
    plans = ["colocate", calibrated]
    for _, decisions, _ in dynamic:
        plans += [d["plan"] for d in decisions if d["switch"]]
    for _, decisions, _ in dynamic:
        plans += [d["candidate"] for d in decisions if d.get("candidate")]
    plans = list(dict.fromkeys(plans))[:MAX_STATIC]
    static = {plan: [_run(config(f"{workload}-static-{k}", plan)) for k in range(args.repeats)] for plan in plans}
    medians = {plan: statistics.median(_seconds(m) for m, _, _ in runs) for plan, runs in static.items()}
    hindsight = min(medians, key=medians.get)
    reference = static[hindsight][0][0]
    rows = []

    def row(name: str, plan: str, runs: list) -> dict:
        seconds = [_seconds(m) for m, _, _ in runs]
        metrics = runs[0][0]
        switches = [len([d for d in decisions if d["switch"]]) for _, decisions, _ in runs]
        return {
            "workload": workload,
            "placement": name,
            "plan": plan,
            "run s (median)": statistics.median(seconds),
            "spread": f"{min(seconds):.2f}-{max(seconds):.2f}",
            "vs hindsight best static": medians[hindsight] / statistics.median(seconds),
            "vs colocate": medians["colocate"] / statistics.median(seconds),
            "switches": ",".join(map(str, switches)),
            "decisions s": statistics.median(sum(m.get("time/placement_s", 0.0) for m in r) for r, _, _ in runs),
            "mean response first/last": f"{metrics[0]['response/length']:.1f} / {metrics[-1]['response/length']:.1f}",
            "same samples": "yes" if all(_samples_equal(m, reference) for m, _, _ in runs) else "NO",
            "max loss diff": f"{max(_loss_diff(m, reference) for m, _, _ in runs):.1e}",
        }

    def per_iteration(runs: list) -> list[float]:
        return [statistics.median(its) for its in zip(*([m["time/iteration_s"] for m in r] for r, _, _ in runs))]

    times = {plan: per_iteration(runs) for plan, runs in static.items()}
    changes = [m["time/plan_change_s"] for r, _, _ in dynamic for m in r if m.get("time/plan_change_s", 0.0) > 0]
    switch_s = statistics.median(changes) if changes else 0.0

    for plan, runs in static.items():
        label = (
            "static"
            + (" (hindsight best)" if plan == hindsight else "")
            + (" (calibrated)" if plan == calibrated else "")
        )
        rows.append(row(label, plan, runs))
    rows.append(row("dynamic", f"from {calibrated}", dynamic))
    for name, cost in (("oracle (ceiling, measured switch cost)", switch_s), ("oracle (ceiling, free switches)", 0.0)):
        rows.append({"workload": workload, "placement": name, **_oracle_row(times, cost, medians, hindsight)})
    for _, decisions, _ in dynamic[:1]:
        for d in (d for d in decisions if d["switch"]):
            Console().print(f"  switch after iteration {d['iteration']}: {d['reason']}; to {d['plan']}")
    return rows, {"iteration_s": times, "switch_s": switch_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--calibration", type=int, default=4, help="iterations the static plan is chosen from")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each placement (medians)")
    ap.add_argument("--first-median", type=float, default=4.0, help="median digits of the first iteration")
    ap.add_argument("--final-median", type=float, default=24.0, help="median digits of the last iteration (drift)")
    ap.add_argument("--final-sigma", type=float, default=1.0, help="log-scale spread of the last iteration (drift)")
    ap.add_argument("--sigma-by", type=float, default=0.5, help="share of the run over which the spread grows")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--workloads", default="drifting,stationary", help="of drifting, reversing, stationary, phases")
    ap.add_argument(
        "--prepared",
        help="a directory holding sft/, rm/ and sort_reward.py from an earlier run (made there when missing)",
    )
    ap.add_argument("--out", help="a JSON file for the rows and the oracle's inputs (each plan's iteration times)")
    args = ap.parse_args()
    if args.calibration < 3:  # the first iteration's time holds one-off costs; the last is followed by no check
        ap.error(f"--calibration: {args.calibration} iterations price no plan (valid: 3 or more)")
    drift = (args.first_median, args.final_median, args.final_sigma, args.sigma_by)
    files = {
        "drifting": lambda path: write_prompts(path, args.iterations, args.prompts, *drift, seed=7),
        "stationary": lambda path: write_prompts(
            path, args.iterations, args.prompts, args.first_median, args.first_median, 0.0, 1.0, seed=7
        ),
        "reversing": lambda path: write_prompts(path, args.iterations, args.prompts, *drift, seed=7, reverse=True),
        "phases": lambda path: write_phases(
            path, args.iterations, args.prompts, args.final_median, args.final_sigma, seed=7
        ),
    }
    workloads = args.workloads.split(",")
    for workload in workloads:
        if workload not in files:
            ap.error(f"--workloads: unknown workload {workload!r} (choose from {', '.join(files)})")
    quiet_libraries()
    rows, record = [], {}
    title = (
        f"dynamic placement vs every static plan it considered, run for the whole workload (median of "
        f"{args.repeats}): {args.devices} devices, {args.iterations} iterations of {args.prompts} prompts"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.prepared or d)
        tmp.mkdir(parents=True, exist_ok=True)
        if not (tmp / "rm").is_dir():
            prepare(tmp, args.sft_steps)
        if "phases" in workloads and not (tmp / "sft_mixed").is_dir():
            _sft(tmp, "sft_mixed", args.sft_steps, (_sort_row, _min_row))
        for workload in workloads:
            path = tmp / f"{workload}.jsonl"
            files[workload](path)
            these, oracle_inputs = compare(tmp, workload, path, args)
            Console().print(summary_table(these, f"{workload}: {title}"))  # each workload's table as it ends
            rows += these
            record[workload] = {"rows": these, **oracle_inputs}
            if args.out:
                Path(args.out).write_text(json.dumps(record, indent=1))
    Console().print(summary_table(rows, title))


if __name__ == "__main__":
    main()
