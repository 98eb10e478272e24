"""Asynchronous training against the best synchronous and stream-fused plans, on a heavy-tailed GRPO workload.

    .venv/bin/python benchmarks/async_training.py [--model llama-10m] [--prompts 8] [--group 4] [--iterations 8]
                                                  [--devices 2] [--longest 320] [--tail 1] [--staleness 1,2,4]

The workload: GRPO (group of ``--group``, KL to a reference) on the demo task's prompts, each sample with its own
token budget drawn from a lognormal (median 16, sigma 1) clipped to [4, MAX] and ``--tail`` samples at MAX (eos
ignored: a sample's length is its budget), drawn anew each iteration. Every variant runs the same iterations from
the same seed through the Ray runtime, one after another in this process:

- synchronous: ``colocate`` (every call on every device, data parallel) and ``separate`` (generation on device 0
  with a shadow actor, the rest on the others), the workflow without any recomputation (plain GRPO);
- stream-fused: ``colocate`` with ``stream_fusion=migrate_at:auto`` (inference on finished samples, the tail
  migrating);
- asynchronous: ``separate`` with ``async=N`` for each N of ``--staleness``, with the decoupled objective (its
  extra ``actor_inf`` forward pass is part of what the asynchronous plans pay).

Every inference and train call runs in ``--micro-batches`` micro-batches (sorted by length, each computed to its
own longest row), in every plan alike: otherwise the tail's length pads every row of a scoring or training pass.

Samples/s is the batch over the median seconds per iteration after the first. The baseline is the best measured
synchronous-or-fused plan (in hindsight). The ceiling: asynchrony only recovers the time a device idles, so the
best synchronous-or-fused plan's device utilisation (its devices' working seconds, a fused stage's parts rather
than its span, over devices × its iteration time, from its traces) gives the speedup of recovering all of it,
1 / utilisation; likewise the separated placement's synchronous utilisation bounds what asynchrony gains on that
placement. An asynchronous plan on another placement does other work (one device generates the whole batch at
once, one trains it without data-parallel exchange), so it may beat the first figure; not the second.

Predictions: the simulator (the plans' own schedules) priced with each call's median measured time on its
allocation in the *synchronous* runs (and the shadow sync's); the asynchronous plans' predictions are therefore
out of sample: only their overlap is modelled. ``actor_inf`` (only in the decoupled workflow) is priced as
``ref_inf`` on the same devices (the same forward pass of the same model). The fused plan is priced by
``benchmarks/fusion.py``'s model and is not predicted here. A plan with partial rollouts (``--plan 'separate;
async=2,partial_rollout:on'``) decodes pieces of samples in its generate call, which no synchronous run measured:
that call is priced as the measured whole call times the cost model's ratio of the two (:class:`MeasuredCost`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from loomrl.algorithms.ops import generate_chunks, generate_op  # noqa: E402
from loomrl.algorithms.workflows import build_workflow  # noqa: E402
from loomrl.config.schema import TrainConfig  # noqa: E402
from loomrl.config.tools import load_config  # noqa: E402
from loomrl.data.sources import build_task, examples_window, prompt_source  # noqa: E402
from loomrl.errors import LoomError  # noqa: E402
from loomrl.models.tokenizer import encode_prompt, task_tokenizer  # noqa: E402
from loomrl.plan import Allocation, ClusterSpec, ExecutionPlan, make_plan  # noqa: E402
from loomrl.plan.plan import AsyncTraining  # noqa: E402
from loomrl.plan.plan_string import RESERVED_KEYS  # noqa: E402
from loomrl.planner.cost.estimator import CostEstimator  # noqa: E402
from loomrl.planner.cost.model import CostModel  # noqa: E402
from loomrl.planner.simulation.simulator import simulate  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.rollout import SamplingParams  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402
from loomrl.runtime.ray_executor import RayExecutor  # noqa: E402
from loomrl.train.rl import planner_inputs, worker_spec  # noqa: E402
from loomrl.workflow import MFC, MFCKind, Workflow  # noqa: E402
from loomrl.workflow.batch import Batch  # noqa: E402


def config(args: argparse.Namespace, off_policy: str, run_dir: Path) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            "seed=0",
            f"actor.model={args.model}",
            "algo.name=grpo",
            f"algo.group_size={args.group}",
            f"algo.off_policy={off_policy}",
            f"rollout.prompts_per_iter={args.prompts}",
            f"rollout.max_new_tokens={args.longest}",
            "runtime.executor=ray",
            f"runtime.devices={args.devices}",
            "runtime.threads=1",
            "runtime.timeout_s=1800",
        ],
    )


def budgeted(workflow: Workflow, longest: int) -> Workflow:
    """``workflow`` with generation reading each sample's budget (``max_new_tokens``) and ignoring eos."""
    params = SamplingParams(longest, 1.0, ignore_eos=True)
    mfcs = []
    for m in workflow.topological_order():
        if m.kind is MFCKind.GENERATE:
            m = dataclasses.replace(
                m,
                inputs=(*m.inputs, "max_new_tokens"),
                op=partial(generate_op, params=params),
                stream=partial(generate_chunks, params=params),
            )
        mfcs.append(m)
    return Workflow(mfcs, ("prompt_ids", "prompt_text", "answer", "row", "max_new_tokens"))


class Prompts:
    """Iteration ``i``'s batch: the task's prompts at its data position, each ``group`` times, with budgets."""

    def __init__(self, cfg: TrainConfig, longest: int, tail: int):
        self.cfg, self.longest, self.tail = cfg, longest, tail
        self.tokenizer = task_tokenizer(cfg.task, cfg.actor.model)
        self.source = prompt_source(cfg.task, build_task(cfg.task), cfg.seed, "train")

    def __call__(self, iteration: int) -> Batch:
        n, g = self.cfg.rollout.prompts_per_iter, self.cfg.algo.group_size
        rows = [ex for ex in examples_window(self.source, iteration * n, n) for _ in range(g)]
        rng = random.Random(iteration)
        budgets = [min(self.longest, max(4, round(rng.lognormvariate(2.77, 1.0)))) for _ in rows]
        for k in rng.sample(range(len(rows)), self.tail):
            budgets[k] = self.longest
        return Batch(
            [iteration * n * g + k for k in range(len(rows))],
            {
                "prompt_ids": [encode_prompt(self.tokenizer, ex.model_input) for ex in rows],
                "prompt_text": [ex.prompt for ex in rows],
                "answer": [ex.answer for ex in rows],
                "row": [ex.row for ex in rows],
                "max_new_tokens": budgets,
            },
        )


def scored_in_micro_batches(plan: ExecutionPlan, workflow: Workflow, micro_batches: int) -> ExecutionPlan:
    """``plan`` with every inference and train call in ``micro_batches`` micro-batches: sorted by length, each
    computed to its own longest row, so the tail's length pads a few rows, not the whole batch."""
    kinds = (MFCKind.INFERENCE, MFCKind.TRAIN)
    return dataclasses.replace(
        plan,
        allocations={
            name: dataclasses.replace(alloc, micro_batches=micro_batches)
            if name in workflow and workflow[name].kind in kinds
            else alloc
            for name, alloc in plan.allocations.items()
        },
    )


def run(cfg: TrainConfig, workflow: Workflow, plan: ExecutionPlan, prompts: Prompts, iterations: int) -> dict:
    """Median seconds per iteration after the first, the device utilisation over those iterations, and every
    call's and sync's median seconds by (step, allocation)."""
    inputs = planner_inputs(cfg, workflow, plan.cluster, prompts.tokenizer)
    executor = RayExecutor(cfg.runtime, worker_spec(cfg, workflow), workflow, plan, inputs, cfg.algo.group_size)
    eta, times, busy, steps, work = plan.staleness, [], [], {}, {}
    try:
        for b in range(eta):
            executor.generate_ahead(b, prompts(b), 0)
        for it in range(iterations):
            ahead = (it + eta, prompts(it + eta)) if eta else None
            result = executor.run_iteration(it, prompts(it), ahead=ahead)
            seconds = max(max(t.end) for t in result.traces) - min(min(t.start) for t in result.traces)
            if it == 0:
                continue
            times.append(seconds)
            busy.append(sum(_busy(t) for t in result.traces))
            for t in result.traces:
                key = (t.step, _layout(plan[t.step]) if t.kind == "call" else "")
                steps.setdefault(key, []).append(t.seconds)
                work.setdefault(t.step, []).append(_busy(t))
    finally:
        executor.close()
    return {
        "seconds": statistics.median(times),
        "spread": (min(times), max(times)),
        "utilisation": statistics.median(b / (plan.cluster.n_devices * s) for b, s in zip(busy, times)),
        "steps": {k: statistics.median(v) for k, v in steps.items()},
        "busy": statistics.median(busy),
        "work": {k: statistics.median(v) for k, v in work.items()},
    }


def _calls_of(text: str, workflow: Workflow) -> str:
    """Plan ``text`` without the items that place calls ``workflow`` lacks (``actor_inf`` is the decoupled
    objective's only), so one plan string serves every objective."""
    items = [item.strip() for item in text.split(";")]
    keep = [
        i for i in items if "=" not in i or (name := i.partition("=")[0].strip()) in RESERVED_KEYS or name in workflow
    ]
    return "; ".join(keep) or text  # nothing of it is a plan: the error names what was given


def _layout(alloc: Allocation) -> str:
    """An allocation's layout without its devices (``0-1:dp2mb4`` → ``dp2mb4``): a call costs the same on any
    devices of one kind."""
    return alloc.text.partition(":")[2] or alloc.text


def _busy(trace) -> float:
    """Device-seconds a step kept its devices working: a fused stage's parts (generation, migration, each member
    call on each device), not its span, which covers devices waiting for the tail; any other step's span."""
    if trace.parts:
        return sum(end - start for _, _, start, end in trace.parts)
    return sum(e - s for s, e in zip(trace.start, trace.end))


class MeasuredCost(CostEstimator):
    """Each call's measured median seconds on its layout, and each sync's (memory is not modelled). No synchronous
    run measures a partial rollout's generate call (pieces of samples of several batches): it is priced as the
    whole call's measured time scaled by ``analytical``'s ratio of the two."""

    def __init__(self, steps: dict[tuple[str, str], float], analytical: CostModel):
        self.steps, self.analytical = steps, analytical

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        name = "ref_inf" if mfc.name == "actor_inf" else mfc.name  # the same forward pass (module docstring)
        return self.steps[(name, _layout(alloc))]

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return 0.0

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return 0.0

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        return next((s for (step, _), s in self.steps.items() if step.startswith(f"sync {role}→")), 0.0)

    def partial_rollout_time(self, mfc: MFC, alloc: Allocation, setting: AsyncTraining) -> float:
        ratio = self.analytical.partial_rollout_time(mfc, alloc, setting) / self.analytical.mfc_time(mfc, alloc)
        return self.mfc_time(mfc, alloc) * ratio


def analytical_model(
    cfg: TrainConfig, workflow: Workflow, cluster: ClusterSpec, prompts: Prompts, iterations: int
) -> CostModel:
    """The cost model of the workload the runs measure (every measured iteration's budgets, their mean prompt)."""
    inputs = planner_inputs(cfg, workflow, cluster, prompts.tokenizer)
    batches = [prompts(i) for i in range(1, iterations)]
    lengths = [n for b in batches for n in b["max_new_tokens"]]
    prompt_len = statistics.fmean(len(p) for b in batches for p in b["prompt_ids"])
    return inputs.cost_model(inputs.workload_of(lengths, prompt_len))


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-10m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--longest", type=int, default=320, help="the budget of the tail samples (MAX)")
    ap.add_argument("--tail", type=int, default=1, help="samples at MAX per iteration")
    ap.add_argument("--staleness", default="1,2,4", help="the asynchronous plans' max_staleness values")
    ap.add_argument("--micro-batches", type=int, default=4, help="of every inference and train call")
    ap.add_argument(
        "--plan",
        action="append",
        default=[],
        help="another asynchronous plan (a plan string with async=N), e.g. generation on every device and training "
        "on one: 'actor_gen=0-1; ref_inf=0; reward_inf=0; actor_inf=0; actor_train=0; async=1' (repeatable)",
    )
    ap.add_argument(
        "--objectives",
        default="decoupled",
        help="the asynchronous plans' algo.off_policy values: decoupled (AReaL's objective, with its actor_inf "
        "pass), tis, none (PPO's clip around the sampler's log-probs)",
    )
    ap.add_argument("--steps", action="store_true", help="print each plan's median seconds per step")
    ap.add_argument("--only-async", action="store_true", help="run the asynchronous plans only (no baseline)")
    args = ap.parse_args()
    if args.iterations < 2:
        ap.error(f"--iterations: {args.iterations} leaves none measured (the first is left out; valid: 2 or more)")
    if not 0 <= args.tail <= args.prompts * args.group:
        ap.error(f"--tail: {args.tail} samples at MAX (valid: 0 to the batch's {args.prompts * args.group})")
    if any(not n.isdigit() or int(n) < 1 for n in args.staleness.split(",") if n):
        ap.error(f"--staleness: {args.staleness!r} (valid: positive integers separated by commas, e.g. 1,2,4)")
    return args


def _variants(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(how the iteration runs, plan string, objective) of every plan measured."""
    variants = [
        ("synchronous", "colocate", "none"),
        ("synchronous", "separate", "none"),
        ("stream-fused", "colocate; stream_fusion=migrate_at:auto", "none"),
        *(
            ("asynchronous", text, off)
            for text in [*(f"separate; async={n}" for n in args.staleness.split(",") if n), *args.plan]
            for off in args.objectives.split(",")
        ),
    ]
    return [v for v in variants if v[0] == "asynchronous"] if args.only_async else variants


def _run_variants(args: argparse.Namespace, console: Console) -> tuple[dict, dict[str, Workflow], CostModel]:
    """Every variant, one after another: label → (mode, plan, objective, :func:`run`'s figures); each
    objective's workflow; and the workload's cost model (:func:`analytical_model`)."""
    tmp = Path(tempfile.mkdtemp(prefix="loomrl-async-"))
    cfgs = {off: config(args, off, tmp / off) for off in {"none", *args.objectives.split(",")}}
    flows = {off: budgeted(build_workflow(c.algo, c.rollout), args.longest) for off, c in cfgs.items()}
    cluster = ClusterSpec(nodes=1, devices_per_node=args.devices, device_kind="cpu")
    prompts = Prompts(cfgs["none"], args.longest, args.tail)
    results = {}
    for mode, text, off in _variants(args):
        plan = scored_in_micro_batches(
            make_plan(_calls_of(text, flows[off]), flows[off], cluster), flows[off], args.micro_batches
        )
        console.print(f"running {text} ({mode}) ...")
        label = text if mode != "asynchronous" or off == "decoupled" else f"{text} [{off}]"
        r = run(cfgs[off], flows[off], plan, prompts, args.iterations)
        results[label] = (mode, plan, off, r)
        console.print(f"  {r['seconds']:.2f} s/iteration ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})")
        if args.steps:
            console.print(
                "  " + ", ".join(f"{step} ({where}) {s:.2f}" for (step, where), s in r["steps"].items()), markup=False
            )
    return results, flows, analytical_model(cfgs["none"], flows["none"], cluster, prompts, args.iterations)


def _rows(
    args: argparse.Namespace, results: dict, flows: dict[str, Workflow], base: dict, analytical: CostModel
) -> list[dict]:
    """The table's rows: each plan's figures against ``base`` (the best synchronous-or-fused plan's), and the
    simulator's prediction from the calls' times measured in the synchronous runs."""
    measured: dict[tuple[str, str], float] = {}
    for mode, _, _, r in results.values():
        if mode == "synchronous":
            measured.update(r["steps"])
    cost, rows = MeasuredCost(measured, analytical), []
    for text, (mode, plan, off, r) in results.items():
        predicted = math.nan
        if mode != "stream-fused":
            predicted = simulate(plan, flows[off], cost, math.inf, iterations=4).iteration_time
        rows.append(
            {
                "plan": text,
                "iteration runs": mode,
                "samples/s": args.prompts * args.group / r["seconds"],
                "s/iteration (min-max)": f"{r['seconds']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})",
                "vs best sync/fused": base["seconds"] / r["seconds"],
                "utilisation": r["utilisation"],
                "predicted s": predicted,
                "predicted / measured": predicted / r["seconds"],
            }
        )
    return rows


def _print_bounds(args: argparse.Namespace, results: dict, best: str, console: Console) -> None:
    """The ceiling (1 / the best synchronous-or-fused plan's utilisation), the decoupled objective's bound and
    what asynchrony gained on the separated placement against its own ceiling."""
    base = results[best][3]
    console.print(
        f"best synchronous-or-fused plan (in hindsight): {best}; its utilisation {base['utilisation']:.2f}: "
        f"recovering all its idle time would make it {1 / base['utilisation']:.2f}x faster (the ceiling)"
    )
    # the decoupled objective adds a forward pass of the policy over the batch: priced as the best plan's own
    # reference pass (the same forward of the same model), its work alone bounds any plan's time from below
    # (a fused plan's reference pass runs inside its stage: the colocated synchronous run's is taken then)
    extra = base["work"].get("ref_inf", results["colocate"][3]["work"].get("ref_inf", 0.0))
    bound = args.devices * base["seconds"] / (base["busy"] + extra)
    console.print(
        f"its devices work {base['busy']:.2f} device-s an iteration; with the decoupled objective's extra forward "
        f"pass ({extra:.2f} device-s, its ref_inf's) the work alone allows at most {bound:.2f}x on {args.devices} "
        "devices (the bound for the decoupled objective at any staleness)"
    )
    separate = results["separate"][3]
    fastest = min((r for mode, _, _, r in results.values() if mode == "asynchronous"), key=lambda r: r["seconds"])
    gain = separate["seconds"] / fastest["seconds"]
    console.print(
        f"the separated placement synchronous: utilisation {separate['utilisation']:.2f}, so asynchrony on it can "
        f"reach at most {1 / separate['utilisation']:.2f}x its speed; measured {gain:.2f}x"
    )


def main() -> None:
    args = _arguments()
    quiet_libraries()
    console = Console()
    results, flows, analytical = _run_variants(args, console)
    if args.only_async:
        return
    synchronous = {k: v for k, v in results.items() if v[0] != "asynchronous"}
    best = min(synchronous, key=lambda k: synchronous[k][3]["seconds"])
    console.print(
        f"model {args.model}, {args.prompts} prompts x {args.group}, budgets lognormal(median 16) in [4, "
        f"{args.longest}] with {args.tail} at {args.longest}, {args.devices} devices, median of "
        f"{args.iterations - 1} iterations after the first"
    )
    rows = _rows(args, results, flows, synchronous[best][3], analytical)
    console.print(summary_table(rows, "asynchronous training vs the best synchronous and stream-fused plans"))
    _print_bounds(args, results, best, console)


if __name__ == "__main__":
    try:
        main()
    except LoomError as err:  # a bad setting or plan: one line, as the loomrl command prints it
        raise SystemExit(f"{Path(__file__).name}: error: {err}") from None
