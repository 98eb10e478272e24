"""The simulator against published RL runs on GPU clusters: each run described as its publication states it.

    .venv/bin/python benchmarks/published_runs.py [--only nemo]

Every row is a :class:`~loomrl.planner.describe.RunDescription` (models, cluster, data shape, optimizer steps,
serving-engine settings and the plan the publication describes), simulated as a fixed plan with the datasheet
profiles and their published efficiencies (``loomrl/plan/hardware.py``). One number is fitted on these rows: each
GPU kind's global ``system_factor`` (H100, GB200), the geometric mean of published / predicted over that kind's
complete rows. So it is reported out of sample too: fitted leave one row out, and leave one system out (on the
rows of other systems only, which is the headline: 1 where no other system published that GPU), beside the
factor-free prediction.
The table gives each row's published step time, the prediction, the published stage shares beside the
predicted ones where the publication breaks the step down, and the ratio predicted / published last.

Rows are *complete* when the publication (with the configuration files it points to) gives every input the
simulator takes; otherwise the row says what was assumed, and it is reported apart. Sources, cited per row:

- NeMo RL's performance summary (github.com/NVIDIA-NeMo/RL, ``docs/about/performance-summary.md``, v0.4 and
  v0.5 tables) and the recipes it links (``examples/configs/recipes/llm/performance/*.yaml`` at the commit of
  each table, on top of ``examples/configs/grpo_math_1B.yaml``): GRPO, on-policy, colocated vLLM + Megatron.
  The table gives the mean length of a whole sample (prompt and response) and the limit of the total; the prompt
  part is not published and is taken as 130 tokens (a chat template and an OpenMathInstruct-2 problem), which
  moves the predictions by a few percent at most.
- OpenRLHF's technical report (arXiv:2405.11143, Tables 2, 3 and 5): PPO on LLaMA-2 7B-70B, A800s, Ray with vLLM,
  ZeRO-3 with Adam offload, 1024 prompts per step, the stage breakdown of each step. The limits (1024 prompt,
  1024 generated tokens) are the launch scripts' of that release; the mean lengths are not published: taken as
  half the limits, hence incomplete.
- verl's fully asynchronous trainer (github.com/volcengine/verl ``docs/advance/fully_async.md``, "Asynchronous
  Training on 7B Model", and the 64:64 script ``verl/experimental/fully_async_policy/shell/
  dapo_7b_math_fsdp2_64_64.sh``): Qwen2.5-Math-7B, DAPO (GRPO advantages, no KL, no dynamic sampling), 512 prompts
  × 16, 28K-token responses, 16 optimizer steps of 32 prompts, H20s, vLLM (TP 4, 0.8 of the memory) and FSDP2
  (Ulysses sequence parallel 4), colocated synchronous on 32, 64 and 128 GPUs against fully asynchronous on
  16+16, 32+32 and 64+64 (staleness threshold 0.5, partial rollout, the rollout's own log-probs). The mean
  response length is not published: it is fitted on one stage of one row (the colocated 64-GPU run's
  update_actor, 133.41 s) and every step time is then predicted, hence incomplete rows.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from rich.console import Console

from loomrl.config.tools import from_dict
from loomrl.plan import ClusterSpec, make_plan
from loomrl.plan.cluster import profile_for
from loomrl.planner.describe import STAGES, RunDescription, inputs_from_description, simulate_fixed
from loomrl.report import summary_table

NEMO_RL = "github.com/NVIDIA-NeMo/RL docs/about/performance-summary.md"
OPENRLHF = "arXiv:2405.11143 (OpenRLHF) Tables 3 and 5"
PROMPT = 130
"""Prompt tokens assumed for NeMo RL's OpenMathInstruct-2 rows (see the module docstring)."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what the simulator is given, and what was measured."""

    name: str
    system: str
    """The RL system that ran it (the unit a factor is left out by)."""
    source: str
    run: dict
    """The fields of a :class:`RunDescription`."""
    step_s: float
    """Published seconds per step (iteration)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Published seconds per stage, where given."""
    stage_steps: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each published stage's steps in the simulated schedule (step-id prefixes)."""
    assumed: str = ""
    """Inputs the publication does not give, and what was taken for them (empty: complete)."""

    @property
    def complete(self) -> bool:
        return not self.assumed


def _nemo_grpo(
    name: str,
    model: str,
    cluster: str,
    gpus: int,
    seq_mean: float,
    gen_tp: int,
    train: str,
    dp: int,
    step_s: float,
    version: str,
    flags: str = "zero",
    expert_parallel: int = 1,
) -> PublishedRun:
    """A NeMo RL GRPO row: 64 prompts × 32 responses, 512 samples per optimizer step (4 steps), everything
    colocated on every GPU (vLLM at 0.6 of the memory, asleep while Megatron trains; Megatron's state, its
    optimizer distributed over dp, asleep while vLLM generates; the reference's weights swapped in for its
    pass), a math verifier as reward, the behaviour log-probs recomputed; micro-batches packed to the 4096-token
    limit (``train_micro_batch_size`` 1, sequence packing), their count per replica following from the mean
    length. ``train``: the training layout (``dp``: its data-parallel degree), ``flags``: rc (activation
    checkpointing) and zero (the distributed optimizer)."""
    per_replica = 2048 * seq_mean / dp
    train_mb = max(1, math.ceil(per_replica / 4 / 4096))
    score_mb = max(1, math.ceil(per_replica / 4096))
    devices = f"0-{gpus - 1}"
    generation = f"dp{gpus // gen_tp}" + (f"tp{gen_tp}" if gen_tp > 1 else "")
    plan = (
        f"actor_gen={devices}:{generation}; actor_inf={devices}:{train}mb{score_mb}; "
        f"ref_inf={devices}:{train}mb{score_mb}; reward_inf=0; actor_train={devices}:{train}mb{train_mb}{flags}; "
        "offload=actor,ref"
    )
    return PublishedRun(
        name=name,
        system="NeMo RL",
        source=f"{NEMO_RL} ({version})",
        step_s=step_s,
        run={
            "algo": "grpo",
            "cluster": cluster,
            "models": {"actor": model, "reward": "rule"},
            "prompts": 64,
            "responses_per_prompt": 32,
            "prompt_len": PROMPT,
            "response_len": seq_mean - PROMPT,
            "response_max": 4096 - PROMPT,
            "optimizer_steps": 4,
            "recompute_logprobs": True,
            "plan": plan,
            "system": {"gen_memory_fraction": 0.6, "logits": "chunked", "expert_parallel": expert_parallel},
        },
    )


OPENRLHF_STAGES = {
    "generation": ("actor_gen",),
    "vLLM weight sync": ("sync actor",),
    "logits, reward": (
        "actor_inf",
        "ref_inf",
        "reward_inf",
        "critic_inf",
        "advantages",
        "copy actor",
        "free actor",
        "copy critic",
        "free critic",
    ),
    "training": ("actor_train", "critic_train"),
}
"""The steps in each of the stages whose shares OpenRLHF's report publishes."""


def _openrlhf_plan(
    actor: int, critic: int, ref: int, reward: int, engines: int, engine_tp: int, request_batch: int, scoring_tp: int
) -> str:
    """An OpenRLHF row's plan string: actor, critic, reference, reward and the vLLM engines on their own GPUs in
    that order (:func:`_openrlhf`)."""
    first = 0

    def span(count: int) -> str:
        nonlocal first
        text = f"{first}-{first + count - 1}" if count > 1 else str(first)
        first += count
        return text

    a, c, r, w = span(actor), span(critic), span(ref), span(reward)
    g = span(engines * engine_tp)
    tp = f"tp{engine_tp}" if engine_tp > 1 else ""
    micro = max(1, 128 // actor // 4)  # micro_train_batch_size 4 (assumed) of each rank's 128 / actors samples
    rollout_mbs = request_batch * engines // actor  # the micro rollout batch of Table 3
    score = f"tp{scoring_tp}" if scoring_tp > 1 else f"dp{actor}"

    def mb(replicas: int) -> str:  # scoring passes run one micro rollout batch at a time
        return f"mb{max(1, 1024 // replicas // rollout_mbs)}"

    def scored(count: int) -> str:  # a frozen model's scoring: whole copies, or tp shards for the large ones
        return f"tp{count}{mb(1)}" if scoring_tp > 1 else f"dp{count}{mb(count)}"

    score_mb = mb(1 if scoring_tp > 1 else actor)
    return (
        f"actor_gen={g}:dp{engines}{tp}; actor_inf={a}:{score}{score_mb}; "
        f"actor_train={a}:dp{actor}mb{micro}rcfsdp; critic_inf={c}:{score}{score_mb}; "
        f"critic_train={c}:dp{critic}mb{micro}rcfsdp; ref_inf={r}:{scored(ref)}; "
        f"reward_inf={w}:{scored(reward)}; advantages={a.split('-')[0]}"
    )


def _openrlhf(
    name: str,
    model: str,
    nodes: int,
    actor: int,
    critic: int,
    ref: int,
    reward: int,
    engines: int,
    engine_tp: int,
    request_batch: int,
    stages: dict[str, float],
    step_s: float,
    scoring_tp: int = 1,
) -> PublishedRun:
    """An OpenRLHF row (Table 3): actor, critic, reference, reward and the vLLM engines on their own GPUs in that
    order, ZeRO-3 with Adam offloaded for the trained models, 1024 prompts per step, 8 optimizer steps of 128
    (rollout batch 1024, train batch 128), behaviour log-probs recomputed by the actor, the engines fed
    ``request_batch`` prompts at a time (micro_rollout_batch_size × the actors per engine), every training and
    scoring micro-batch padded to its longest sample (OpenRLHF's PPO packed samples only from September 2024,
    github.com/OpenRLHF/OpenRLHF pull 449, after the report)."""
    plan = _openrlhf_plan(actor, critic, ref, reward, engines, engine_tp, request_batch, scoring_tp)
    return PublishedRun(
        name=name,
        system="OpenRLHF",
        source=OPENRLHF,
        step_s=step_s,
        stages=stages,
        stage_steps=OPENRLHF_STAGES,
        assumed="mean lengths not published: prompt 256 and response 512 tokens taken (half the limits); training "
        "micro-batches of 4 samples with activation checkpointing taken (Table 3 gives the rollout's)"
        + (
            "; the scoring passes, which ZeRO-3 runs on its shards, priced on tensor-parallel copies over the "
            "same GPUs (a plan cannot score on FSDP shards)"
            if scoring_tp > 1
            else ""
        ),
        run={
            "algo": "ppo",
            "cluster": f"a800:{nodes}x8",
            "models": {"actor": model},
            "prompts": 1024,
            "prompt_len": 256,
            "response_len": 512,
            "response_max": 1024,
            "optimizer_steps": 8,
            "recompute_logprobs": True,
            "plan": plan,
            "system": {
                "gen_memory_fraction": 0.9,
                "gen_request_batch": request_batch,
                "optimizer_offload": True,
                "logits": "chunked",
                "packing": False,
            },
        },
    )


VERL_ASYNC = "github.com/volcengine/verl docs/advance/fully_async.md (7B table)"
VERL_PROMPT = 150
"""Prompt tokens assumed for verl's DAPO-Math-17k rows (a chat template and a competition problem)."""
VERL_MAX_RESPONSE = 28 * 1024
VERL_TOKENS_PER_GPU = (2048 + VERL_MAX_RESPONSE) * 2
"""The 7B script's ``ppo_max_token_len_per_gpu`` (dynamic batch size: micro-batches packed to this many tokens;
scoring passes take 3 × as many)."""
VERL_FIT = ("verl colocated sync Qwen2.5-Math-7B 64 GPUs", {"training": 133.41, "generation": 150.72})
"""The row and the published stage seconds the verl rows' response lengths are fitted on: its update_actor gives
the mean length, its generation (the decode of the longest responses) the spread of the log-normal."""
VERL_RESPONSE_LEN = 1010
VERL_RESPONSE_SPREAD = 1.54
"""What :func:`fit_verl_lengths` finds (``--refit`` fits again; a test checks these reproduce :data:`VERL_FIT`)."""


def _verl(
    name: str,
    gpus: int,
    asynchronous: bool,
    step_s: float,
    stages: dict[str, float],
    lengths: tuple[float, float],
) -> PublishedRun:
    """A verl 7B row (module docstring): ``gpus`` in all, colocated (generation, the log-prob recomputation and
    training on every GPU; the trainer's state offloaded while vLLM generates, as the colocated script sets
    ``offload``) or split in halves, generation with its own copy of the weights on the first (``shadow``, synced
    after each update) and training on the second, one batch ahead with partial rollouts. Ulysses sequence
    parallelism over 4 GPUs is priced as tensor parallelism over 4 (both split each sequence's work 4 ways)."""
    response_len, spread = lengths
    train_gpus = gpus // 2 if asynchronous else gpus
    replicas = train_gpus // 4
    per_replica = 512 * 16 * (VERL_PROMPT + response_len) / replicas
    train_mb = max(1, math.ceil(per_replica / 16 / (4 * VERL_TOKENS_PER_GPU)))
    score_mb = max(1, math.ceil(per_replica / (12 * VERL_TOKENS_PER_GPU)))
    if asynchronous:
        gen, train = f"0-{gpus // 2 - 1}", f"{gpus // 2}-{gpus - 1}"
        plan = (
            f"actor_gen={gen}:dp{gpus // 8}tp4; reward_inf={gpus // 2}; advantages={gpus // 2}; "
            f"actor_train={train}:dp{replicas}tp4mb{train_mb}rcfsdp; shadow=actor; async=1"
        )
    else:
        every = f"0-{gpus - 1}"
        plan = (
            f"actor_gen={every}:dp{gpus // 4}tp4; actor_inf={every}:dp{replicas}tp4mb{score_mb}; reward_inf=0; "
            f"actor_train={every}:dp{replicas}tp4mb{train_mb}rcfsdp; offload=actor"
        )
    return PublishedRun(
        name=name,
        system="verl",
        source=VERL_ASYNC,
        step_s=step_s,
        stages=stages,
        stage_steps={**STAGES, "generation": ("actor_gen",)},
        assumed=f"response lengths not published: a log-normal of mean {response_len:.0f} tokens and spread "
        f"{spread:.2f} cut at {VERL_MAX_RESPONSE}, fitted on the colocated 64-GPU row's update_actor and "
        f"generation; prompts of {VERL_PROMPT} tokens; Ulysses sequence parallel 4 priced as tensor parallel 4; "
        "log-probs computed a chunk of tokens at a time",
        run={
            "algo": "grpo",
            "cluster": f"h20:{gpus // 8}x8",
            "models": {"actor": "qwen2.5-7b", "reward": "rule"},
            "prompts": 512,
            "responses_per_prompt": 16,
            "prompt_len": VERL_PROMPT,
            "response_len": response_len,
            "response_max": VERL_MAX_RESPONSE,
            "response_spread": spread,
            "optimizer_steps": 16,
            "recompute_logprobs": not asynchronous,
            "kl": False,
            "plan": plan,
            "system": {"gen_memory_fraction": 0.8, "logits": "chunked", "partial_rollout": asynchronous},
        },
    )


def _verl_rows(lengths: tuple[float, float] = (VERL_RESPONSE_LEN, VERL_RESPONSE_SPREAD)) -> tuple[PublishedRun, ...]:
    """verl's 7B table: colocated synchronous against fully asynchronous at the same GPU count; the stages
    published for the colocated rows (gen, old_log_prob, update_actor) and the asynchronous rows' update_actor
    (their gen is the trainer's wait, not generation). The 32-GPU rows' update_actor are left out: the two were
    swapped in a later edit of the table."""

    def sync(gen: float, old: float, train: float) -> dict[str, float]:
        return {"generation": gen, "scoring": old, "training": train}

    return (
        _verl("verl colocated sync Qwen2.5-Math-7B 32 GPUs", 32, False, 790.10, {}, lengths),
        _verl("verl fully async Qwen2.5-Math-7B 16+16 GPUs", 32, True, 294.77, {}, lengths),
        _verl("verl colocated sync Qwen2.5-Math-7B 64 GPUs", 64, False, 365.28, sync(150.72, 70.26, 133.41), lengths),
        _verl("verl fully async Qwen2.5-Math-7B 32+32 GPUs", 64, True, 189.26, {"training": 156.98}, lengths),
        _verl("verl colocated sync Qwen2.5-Math-7B 128 GPUs", 128, False, 356.30, sync(177.85, 53.92, 113.81), lengths),
        _verl("verl fully async Qwen2.5-Math-7B 64+64 GPUs", 128, True, 150.63, {"training": 113.16}, lengths),
    )


def _pair(first: float, second: float) -> tuple[float, float]:
    return first, second


def fit_verl_lengths(rounds: int = 3) -> tuple[float, float]:
    """The response lengths (mean, spread) at which the simulated stages of :data:`VERL_FIT`'s row take their
    published seconds: each by bisection in turn (training grows with the mean, generation with the spread)."""
    name, target = VERL_FIT

    def stage(lengths: tuple[float, float], which: str) -> float:
        row = next(r for r in _verl_rows(lengths) if r.name == name)
        return predict(row).stages.get(which, 0.0)

    def bisect(low: float, high: float, of: Callable[[float], tuple[float, float]], which: str) -> float:
        for _ in range(18):
            mid = (low + high) / 2
            low, high = (mid, high) if stage(of(mid), which) < target[which] else (low, mid)
        return (low + high) / 2

    mean, spread = float(VERL_RESPONSE_LEN), float(VERL_RESPONSE_SPREAD)
    for _ in range(rounds):
        mean = bisect(64.0, VERL_MAX_RESPONSE - 1.0, partial(_pair, second=spread), "training")
        spread = bisect(0.2, 3.0, partial(_pair, mean), "generation")
    return mean, spread


ROWS: tuple[PublishedRun, ...] = (
    # NeMo RL v0.5, DGX-H100 BF16 (table rows "On policy"): model, #GPUs, G-Average Seq len, Generation TP,
    # Training [TP, CP, EP, PP], Total Step time (s)
    _nemo_grpo(
        "NeMo RL v0.5 GRPO Llama-3.1-8B", "llama3.1-8b", "h100:2x8", 16, 1019, 1, "dp8pp2", 8, 92.8, "v0.5", "rczero"
    ),
    _nemo_grpo("NeMo RL v0.5 GRPO Qwen3-32B", "qwen3-32b", "h100:4x8", 32, 3251, 4, "dp2tp4pp4", 2, 376, "v0.5"),
    _nemo_grpo(
        "NeMo RL v0.5 GRPO Qwen3-30B-A3B",
        "qwen3-30b-a3b",
        "h100:4x8",
        32,
        3196,
        2,
        "dp32",
        32,
        198,
        "v0.5",
        expert_parallel=8,
    ),
    # the same table, DGX-GB200 (4 GPUs per tray, one NVLink domain per rack)
    _nemo_grpo(
        "NeMo RL v0.5 GRPO Llama-3.1-8B (GB200)",
        "llama3.1-8b",
        "gb200:1x8",
        8,
        1066,
        1,
        "dp8",
        8,
        91.0,
        "v0.5",
        "rczero",
    ),
    _nemo_grpo("NeMo RL v0.5 GRPO Qwen3-32B (GB200)", "qwen3-32b", "gb200:1x16", 16, 3253, 1, "dp8tp2", 8, 381, "v0.5"),
    _nemo_grpo(
        "NeMo RL v0.5 GRPO Qwen3-30B-A3B (GB200)",
        "qwen3-30b-a3b",
        "gb200:1x16",
        16,
        3198,
        1,
        "dp16",
        16,
        232,
        "v0.5",
        expert_parallel=16,
    ),
    # NeMo RL v0.4, DGX-H100 BF16: the same workloads on the previous release's layouts
    _nemo_grpo(
        "NeMo RL v0.4 GRPO Llama-3.1-8B", "llama3.1-8b", "h100:2x8", 16, 1060, 1, "dp8pp2", 8, 97.7, "v0.4", "rczero"
    ),
    _nemo_grpo("NeMo RL v0.4 GRPO Qwen3-32B", "qwen3-32b", "h100:4x8", 32, 3206, 4, "dp2tp4pp4", 2, 393, "v0.4"),
    _nemo_grpo(
        "NeMo RL v0.4 GRPO Qwen3-30B-A3B",
        "qwen3-30b-a3b",
        "h100:4x8",
        32,
        3154,
        4,
        "dp16tp2",
        16,
        225,
        "v0.4",
        expert_parallel=8,
    ),
    # OpenRLHF, Table 3 (GPUs per model; vLLM DP, TP, micro rollout batch) and Table 5 (seconds per stage)
    _openrlhf(
        "OpenRLHF PPO LLaMA-2 7B",
        "llama2-7b",
        2,
        4,
        4,
        2,
        2,
        4,
        1,
        16,
        {"generation": 262.96, "vLLM weight sync": 4.32, "logits, reward": 32.7, "training": 171.13},
        471.11,
    ),
    _openrlhf(
        "OpenRLHF PPO LLaMA-2 13B",
        "llama2-13b",
        4,
        8,
        8,
        4,
        4,
        8,
        1,
        8,
        {"generation": 372.14, "vLLM weight sync": 10.03, "logits, reward": 29.58, "training": 197.18},
        608.93,
    ),
    _openrlhf(
        "OpenRLHF PPO LLaMA-2 34B",
        "llama2-34b",
        4,
        8,
        8,
        4,
        4,
        4,
        2,
        16,
        {"generation": 720.50, "vLLM weight sync": 35.47, "logits, reward": 326.0, "training": 444.43},
        1526.4,
        scoring_tp=8,
    ),
    _openrlhf(
        "OpenRLHF PPO LLaMA-2 70B",
        "llama2-70b",
        4,
        4,
        4,
        4,
        4,
        4,
        4,
        4,
        {"generation": 2252.79, "vLLM weight sync": 111.65, "logits, reward": 323.38, "training": 1800.71},
        4488.53,
        scoring_tp=4,
    ),
)


def predict(row: PublishedRun):
    """The fixed-plan simulation of one row."""
    run = from_dict(RunDescription, row.run, "run")
    inputs = inputs_from_description(run)
    plan = make_plan(run.plan, inputs.workflow, inputs.cluster)
    return simulate_fixed(plan, inputs, stages=row.stage_steps or None)


ROWS += _verl_rows()


def _shares(stages: dict[str, float], total: float) -> str:
    return ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in stages.items() if name != "other")


def _summary(ratios: list[float]) -> str:
    within = sum(1 for r in ratios if math.isfinite(r) and abs(r - 1) <= 0.25)
    errors = sorted(abs(r - 1) for r in ratios if math.isfinite(r))
    median = errors[len(errors) // 2] if errors else math.nan
    return (
        f"{within}/{len(ratios)} within ±25% (median |error| {100 * median:.0f}%; ratios "
        f"{', '.join(f'{r:.2f}' for r in ratios)})"
    )


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 1.0


def out_of_sample_factors(rows: list[tuple[PublishedRun, str, float]]) -> dict[str, list[float]]:
    """For each ``(row, GPU kind, ratio without any factor)``, the GPU kind's global factor fitted (as
    ``loomrl/plan/hardware.py`` states it: the geometric mean of published / predicted over the complete rows of
    that kind) three ways: on every complete row ("fitted", in sample, as the profile's), on the others
    ("leave one row out") and on the complete rows of other systems only ("leave one system out"; 1 where
    no other system published that GPU). Assumed-input rows never enter a fit."""
    out: dict[str, list[float]] = {"fitted": [], "leave one row out": [], "leave one system out": []}
    for k, (row, kind, _) in enumerate(rows):
        same = [(j, r, ratio) for j, (r, g, ratio) in enumerate(rows) if g == kind and r.complete]
        out["fitted"].append(_geomean([1 / ratio for _, _, ratio in same]))
        out["leave one row out"].append(_geomean([1 / ratio for j, _, ratio in same if j != k]))
        out["leave one system out"].append(_geomean([1 / ratio for _, r, ratio in same if r.system != row.system]))
    return out


def _predictions() -> tuple[list[tuple], list[tuple[PublishedRun, str, float]]]:
    """Every row's (simulation report, predicted seconds, the GPU's stated factor), and (row, GPU kind, predicted
    / published without any factor): every row, so that the factors are fitted on the same rows whatever
    ``--only`` shows."""
    reports, bare = [], []
    for row in ROWS:
        report = predict(row)
        predicted = report.result.iteration_time if report.result.feasible else math.nan
        profile = profile_for(ClusterSpec.parse(row.run["cluster"]))
        reports.append((report, predicted, profile.system_factor))
        bare.append((row, profile.name, predicted / profile.system_factor / row.step_s))
    return reports, bare


def _table(only: str, reports: list[tuple], bare: list[tuple]) -> tuple[list[dict], dict, list[float]]:
    """The table's rows (those whose name contains ``only``), each column's ratios by whether the row's inputs
    are complete, and every published stage share's gap to the predicted one."""
    factors = out_of_sample_factors(bare)
    rows, stage_gaps = [], []
    ratios: dict[str, dict[bool, list[float]]] = {}
    for k, (row, (report, predicted, stated)) in enumerate(zip(ROWS, reports)):
        if only.lower() not in row.name.lower():
            continue
        columns = {
            "stated factor": predicted / row.step_s,
            **{name: bare[k][2] * f[k] for name, f in factors.items() if name != "fitted"},
            "factor-free": bare[k][2],
        }
        for name, ratio in columns.items():
            ratios.setdefault(name, {True: [], False: []})[row.complete].append(ratio)
        published, mine = "", _shares(report.stages, predicted)
        if row.stages:
            published = _shares(row.stages, row.step_s)
            mine = _shares({k: report.stages.get(k, 0.0) for k in row.stages}, predicted)
            stage_gaps += [abs(report.stages.get(k, 0.0) / predicted - s / row.step_s) for k, s in row.stages.items()]
        g = int(row.run["cluster"].split(":")[1].split("x")[0]) * int(row.run["cluster"].split("x")[1])
        rows.append(
            {
                "run": row.name + ("" if row.complete else " *"),
                "GPUs": f"{g} {row.run['cluster'].split(':')[0]}",
                "published s": row.step_s,
                "predicted s": predicted,
                "published stages": published or "-",
                "predicted stages": mine or "-",
                "factor (stated / fitted here / LOSO)": f"{stated:.2f} / {factors['fitted'][k]:.2f} / "
                f"{factors['leave one system out'][k]:.2f}",
                **{f"pred/pub {name}": ratio for name, ratio in columns.items()},
            }
        )
        if not report.result.feasible:
            rows[-1]["run"] += f" (no fit: {report.result.reason})"
    return rows, ratios, stage_gaps


def _print_summaries(console: Console, ratios: dict, stage_gaps: list[float], reports: list[tuple]) -> None:
    for complete in (True, False):
        what = "complete" if complete else "assumed-input"
        for name in ("leave one system out", "leave one row out", "factor-free", "stated factor"):
            found = ratios.get(name, {}).get(complete)
            if found:
                headline = (
                    " (the headline: no row is priced with a factor fitted on it)"
                    if name.startswith("leave one s")
                    else ""
                )
                console.print(f"{what} rows, {name}{headline}: {_summary(found)}")
    if stage_gaps:
        console.print(
            f"stage shares: {sum(1 for g in stage_gaps if g <= 0.10)}/{len(stage_gaps)} within 10 points "
            f"(largest gap {100 * max(stage_gaps):.0f} points)"
        )
    times = {row.name: (row.step_s, predicted) for row, (_, predicted, _) in zip(ROWS, reports)}
    fast = times["verl fully async Qwen2.5-Math-7B 64+64 GPUs"]
    for gpus in (64, 128):
        slow = times[f"verl colocated sync Qwen2.5-Math-7B {gpus} GPUs"]
        console.print(
            f"verl fully async 64+64 GPUs over colocated synchronous on {gpus}: published {slow[0] / fast[0]:.2f}x, "
            f"predicted {slow[1] / fast[1]:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this")
    ap.add_argument("--refit", action="store_true", help="fit the verl rows' response lengths again and print them")
    args = ap.parse_args()
    if args.refit:
        mean, spread = fit_verl_lengths()
        print(f"verl rows: VERL_RESPONSE_LEN = {mean:.0f}, VERL_RESPONSE_SPREAD = {spread:.2f}")
    reports, bare = _predictions()
    rows, ratios, stage_gaps = _table(args.only, reports, bare)
    console = Console(width=250)
    console.print(
        summary_table(
            rows,
            "published RL runs: step seconds, predicted by the simulator (* = inputs assumed, see the source); "
            "predicted / published with the GPU's stated factor (in sample), fitted out of sample, and without",
        )
    )
    _print_summaries(console, ratios, stage_gaps, reports)
    for row in ROWS:
        if row.assumed and args.only.lower() in row.name.lower():
            console.print(f"* {row.name}: {row.assumed}")


if __name__ == "__main__":
    main()
