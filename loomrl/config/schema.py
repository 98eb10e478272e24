"""Typed configuration of every loomrl command: trees of frozen dataclasses, one docstring per field.

Defaults live here and only here. YAML files in ``examples/`` fill them in, ``key.sub=value`` overrides on the
command line come last, and :mod:`loomrl.config.tools` validates the result at construction: any invalid input
becomes one line naming the field path, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field

from loomrl.config.environment import EnvConfig
from loomrl.config.task import TaskConfig
from loomrl.config.tools import ValidatedConfig, fail, spec
from loomrl.errors import ConfigError

ALGORITHMS = ("ppo", "grpo", "rloo", "remax", "reinforce_pp")
GROUP_ALGORITHMS = ("grpo", "rloo")
"""The algorithms that draw a group of samples per prompt (``algo.group_size``)."""
POLICY_LOSSES = ("ppo", "gspo")  # loomrl.algorithms.losses.POLICY_LOSSES
OFF_POLICY = ("none", "decoupled", "tis", "mis", "geo_reject")  # loomrl.algorithms.losses.OFF_POLICY
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # loomrl.algorithms.losses.LOSS_AGGS
ROLES = ("actor", "critic", "ref", "reward")
"""The roles besides the judges (``judge0``, ``judge1``, ...: :func:`judge_role`)."""


def judge_role(index: int) -> str:
    """The role of generative reward model ``index`` (``reward.judges[index]``): ``judge<index>``."""
    return f"judge{index}"


def judge_index(name: str) -> int | None:
    """The judge a role (``judge3``), or a name built from one (its call ``judge3_gen``, its metric column
    ``judge3_unreadable``), belongs to; None for any other name."""
    match = re.fullmatch(r"judge(\d+)(?:_\w+)?", name)
    return int(match[1]) if match else None


BACKENDS = ("tensorboard", "wandb", "mlflow")
ROLLOUT_BACKENDS = ("loomrl", "vllm")
"""Engines a rollout generate call may run on (``rollout.backend``)."""
NONFINITE_ACTIONS = ("skip", "stop")


@dataclass(frozen=True)
class OptimConfig(ValidatedConfig):
    lr: float = spec(1e-4, gt=0, le=1)
    """AdamW learning rate."""
    weight_decay: float = spec(0.0, ge=0, le=1)
    """AdamW weight decay."""
    grad_clip: float = spec(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    betas: tuple[float, float] = spec((0.9, 0.95), ge=0, lt=1)
    """AdamW betas."""
    warmup_steps: int = spec(0, ge=0)
    """Optimizer steps over which the learning rate rises linearly to lr (step k uses (k+1)/warmup_steps of it)."""
    lr_schedule: str = spec("constant", choices=("constant", "cosine"))
    """After the warm-up: a constant lr, or a cosine decay reaching min_lr_ratio × lr at the run's last step."""
    min_lr_ratio: float = spec(0.0, ge=0, le=1)
    """Where the cosine decay ends, as a fraction of lr."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of a Llama-style layer: what ``lora.target_modules`` may name."""


@dataclass(frozen=True)
class LoraConfig(ValidatedConfig):
    r: int = spec(0, ge=0, le=4096)
    """Rank of the adapters; 0 trains every weight (no LoRA)."""
    alpha: float = spec(32.0, gt=0)
    """Scale numerator: each adapter's update is multiplied by alpha / r."""
    dropout: float = spec(0.0, ge=0, lt=1)
    """Dropout on the adapters' inputs in training (drawn from each process's own stream: plans equal the
    reference executor at 0 only)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """The projections that get adapters, by name."""
    reference: str = spec("base", choices=("base", "copy"))
    """With a LoRA actor, where the KL reference's log-probs come from: 'base' runs the actor's own weights with
    its adapters off (no reference model exists), 'copy' a separate frozen model as without LoRA."""

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def validate(self) -> None:
        if not self.target_modules:
            fail("target_modules", f"is empty; name one or more of {', '.join(LORA_TARGETS)}")
        bad = [m for m in self.target_modules if m not in LORA_TARGETS]
        if bad:
            fail("target_modules", f"{bad[0]!r} is not a projection (valid: {', '.join(LORA_TARGETS)})")


@dataclass(frozen=True)
class PolicyConfig(ValidatedConfig):
    model: str = "llama-1m"
    """Zoo name (llama-1m, llama-10m, llama-30m, qwen2-1m, gpt2-1m) or a local HF checkpoint directory."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters: with ``lora.r`` > 0 only they train (in fp32), the base stays frozen in the run's
    precision, and only they move between layouts and into checkpoints."""


@dataclass(frozen=True)
class CriticConfig(ValidatedConfig):
    model: str | None = None
    """Checkpoint or zoo name the critic starts from; None initialises it from the actor's checkpoint."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4))
    """Optimizer of the critic."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters of the critic (its value head trains in full); ``lora.reference`` does not apply."""


@dataclass(frozen=True)
class JudgeConfig(ValidatedConfig):
    model: str = ""
    """The judge: a causal LM (a checkpoint directory, e.g. from `loomrl sft task.name=judge`, or a zoo name)."""
    weight: float = 1.0
    """Weight of this judge's score in the reward (the judges' weighted sum)."""
    template: str = "judge {prompt}{response}|{answer}:"
    """The judge's prompt, from the sample's {prompt}, {response} and reference {answer}."""
    verdict: str = "yes-no"
    """How a verdict becomes a score: 'yes-no' (1 for yes, 0 for no), 'regex:PATTERN' (its first group, as a
    number) or a function 'module:function' / 'file.py:function' of the verdict's text returning a number or None.
    An unreadable verdict scores 0 (judge<i>/unreadable in the metrics)."""
    max_new_tokens: int = spec(4, ge=1, le=131072)
    """Longest verdict, in tokens (written greedily)."""

    def validate(self) -> None:
        from loomrl.data.judges import check_template, check_verdict

        if not self.model:
            fail("model", "is empty: give the judge's checkpoint directory or a zoo model")
        problem = check_template(self.template)
        if problem:
            fail("template", f"{self.template!r}: {problem}")
        problem = check_verdict(self.verdict)
        if problem:
            fail("verdict", f"{self.verdict!r} {problem}")


@dataclass(frozen=True)
class RewardConfig(ValidatedConfig):
    source: str = spec("rule", choices=("rule", "model", "both", "judge"))
    """Where the scalar reward comes from: the task's rule, a trained reward model, their weighted sum, or
    generative reward models (judges) that write a verdict per sample."""
    judges: tuple[JudgeConfig, ...] = ()
    """Source 'judge': the judges (roles judge0, judge1, ...), each a generate call of its own in the workflow,
    placed like any call; the reward is their weighted sum."""
    model: str | None = None
    """Reward-model checkpoint directory (from `loomrl rm`), needed for source 'model' or 'both'."""
    rule_weight: float = spec(1.0, ge=0)
    """Weight of the rule's score when source is 'both'."""
    model_weight: float = spec(1.0, ge=0)
    """Weight of the reward model's score when source is 'both'."""

    def validate(self) -> None:
        if self.source in ("model", "both") and not self.model:
            fail("model", f"reward source '{self.source}' needs a reward-model checkpoint directory")
        if self.source == "judge" and not self.judges:
            fail("judges", "reward source 'judge' needs at least one judge, e.g. reward.judges=[{model: runs/judge}]")
        if self.judges and self.source != "judge":
            fail("judges", f"judges are given but reward.source is '{self.source}' (valid with judges: judge)")


@dataclass(frozen=True)
class DynamicSamplingConfig(ValidatedConfig):
    enabled: bool = False
    """DAPO's dynamic sampling (grpo, rloo): groups the filter drops carry no learning signal; waves of extra
    prompts are generated and scored until rollout.prompts_per_iter groups are kept, and only those train."""
    filter: str = "equal_rewards"
    """Which groups are kept: 'equal_rewards' drops a group whose responses all got the same reward (DAPO's); or a
    function 'module:function' / 'file.py:function' given a group's rewards (a list of floats) that returns
    whether to keep it."""
    max_waves: int = spec(4, ge=1)
    """Most waves an iteration generates; when they have kept too few groups, dropped groups fill the batch (in
    the order generated: sampling/filled_groups in the metrics)."""
    max_wave_factor: float = spec(4.0, ge=1)
    """A wave has ceil(groups still missing / estimated kept fraction) prompts, at most this many times
    rollout.prompts_per_iter."""

    def validate(self) -> None:
        module, colon, function = self.filter.rpartition(":")
        if self.filter != "equal_rewards" and not (colon and module and function):
            fail(
                "filter",
                f"'{self.filter}' is neither 'equal_rewards' nor a function 'module:function' or 'file.py:function'",
            )


@dataclass(frozen=True)
class AlgoConfig(ValidatedConfig):
    name: str = spec("ppo", choices=ALGORITHMS)
    """RL algorithm: ppo, grpo, rloo, remax or reinforce_pp."""
    ppo_epochs: int = spec(1, ge=1, le=16)
    """Passes over each rollout batch per iteration."""
    minibatches: int = spec(2, ge=1)
    """Optimizer steps per epoch (the rollout batch is split into this many minibatches)."""
    clip_eps: float = spec(0.2, gt=0, le=1)
    """PPO ratio clip range (lower side; also the upper side unless clip_eps_high is set)."""
    clip_eps_high: float | None = spec(None, gt=0, le=1)
    """Upper ratio clip (DAPO's clip-higher); None uses clip_eps."""
    policy_loss: str = spec("ppo", choices=POLICY_LOSSES)
    """Actor objective: 'ppo' clips each token's importance ratio; 'gspo' (Group Sequence Policy Optimization)
    clips each response's, the geometric mean of its tokens' ratios, and suits clip ranges near 3e-4/4e-4
    (clip_eps/clip_eps_high). Either takes any algorithm's advantages."""
    loss_agg: str = spec("token-mean", choices=LOSS_AGGS)
    """How the actor's per-token losses (and its entropy and KL terms) make a minibatch's loss: 'token-mean' over
    all its response tokens (DAPO's: a long response weighs more); 'seq-mean-token-mean' per response, then over
    responses (the GRPO paper's); 'seq-mean-token-sum' summed per response, then averaged over responses (Dr.
    GRPO's). Exact whatever the micro-batches and data-parallel split. The critic's loss stays a token-mean."""
    overlong_buffer: int = spec(0, ge=0)
    """DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens - overlong_buffer tokens
    loses overlong_penalty x (its excess / overlong_buffer) of its reward before advantages are computed
    (reward/overlong_penalty in the metrics is the mean reward lost); 0 disables."""
    overlong_penalty: float = spec(1.0, ge=0)
    """Reward lost by a response of rollout.max_new_tokens tokens under overlong_buffer."""
    value_clip_eps: float = spec(0.2, gt=0)
    """Clip range of the critic's value update around the rollout's values."""
    gamma: float = spec(1.0, ge=0, le=1)
    """Discount factor over response tokens."""
    lam: float = spec(0.95, ge=0, le=1)
    """GAE lambda."""
    kl_coef: float = spec(0.01, ge=0)
    """Weight of the KL penalty to the reference policy."""
    kl_estimator: str = spec("k1", choices=("k1", "k2", "k3"))
    """KL estimator: k1 (log-ratio), k2 (squared), k3 (Schulman's low-variance unbiased)."""
    group_size: int = spec(4, ge=1)
    """Samples per prompt for group-based algorithms (grpo, rloo); 1 for the others."""
    whiten_advantages: bool = True
    """Normalise advantages over the batch (ppo)."""
    entropy_coef: float = spec(0.0, ge=0)
    """Entropy bonus weight in the actor loss."""
    recompute_logprobs: bool = False
    """Recompute the behaviour log-probs with the actor's own forward pass after generation (an ``actor_inf``
    call, as verl, OpenRLHF and NeMo RL do) rather than take the sampler's; top-k / top-p sampling implies it."""
    off_policy: str = spec("none", choices=OFF_POLICY)
    """Correction for samples drawn by an older policy than the one being updated (an asynchronous plan's
    staleness; the sampler's numerical differences too): 'none' clips the ratio around the sampler's log-probs
    (plain PPO); 'decoupled' (AReaL's decoupled PPO) clips it around the policy at the update's start (recomputed
    by an ``actor_inf`` call) and weights each token by that policy's probability over the sampler's, leaving out
    tokens whose weight exceeds ``is_cap``; 'tis' (truncated importance sampling) caps the weight at ``is_cap``;
    'mis' (masked importance sampling, IcePop's) weights as 'decoupled' but leaves out the tokens whose weight leaves
    [is_low, is_cap]; 'geo_reject' leaves out each response whose geometric-mean weight leaves [is_low, is_cap] and
    weighs the others' tokens 1. The training-inference mismatch (mismatch/ metrics) is logged under any of them."""
    is_cap: float = spec(2.0, gt=0)
    """The importance-weight cap of ``off_policy``: 'decoupled' leaves out tokens above it, 'tis' truncates to it;
    the upper end of the band of 'mis' and 'geo_reject'."""
    is_low: float = spec(0.5, ge=0)
    """The lower end of the importance-weight band of ``off_policy`` 'mis' (tokens below it left out) and
    'geo_reject' (responses whose geometric-mean weight is below it left out); below is_cap."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: drop groups without learning signal and generate more until the batch is full."""

    @property
    def samples_per_prompt(self) -> int:
        """Samples drawn per prompt: ``group_size`` for the group-based algorithms, 1 for the others."""
        return self.group_size if self.name in GROUP_ALGORITHMS else 1

    def validate(self) -> None:
        if self.off_policy in ("mis", "geo_reject") and self.is_low >= self.is_cap:
            fail("is_low", f"{self.is_low} must be below is_cap ({self.is_cap}) for off_policy {self.off_policy}")
        if self.name in GROUP_ALGORITHMS and self.group_size < 2:
            fail("group_size", f"{self.group_size} is too small for {self.name} (must be >= 2)")
        if self.dynamic_sampling.enabled and self.name not in GROUP_ALGORITHMS:
            fail(
                "dynamic_sampling.enabled",
                f"dynamic sampling filters groups of samples; {self.name} has none (valid with it: grpo, rloo)",
            )


@dataclass(frozen=True)
class RolloutConfig(ValidatedConfig):
    prompts_per_iter: int = spec(32, ge=1)
    """Prompts drawn per iteration (each sampled group_size times for grpo/rloo)."""
    max_new_tokens: int = spec(8, ge=1, le=131072)
    """Longest response, in tokens (eos included)."""
    temperature: float = spec(1.0, gt=0, le=10)
    """Sampling temperature of rollouts (evaluation is greedy)."""
    top_k: int = spec(0, ge=0)
    """Sample only from the k most likely tokens; 0 disables."""
    top_p: float = spec(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts: an environment answers each assistant turn (none by default)."""
    backend: str = spec("loomrl", choices=ROLLOUT_BACKENDS)
    """The engine of the rollout generate calls: 'loomrl' (its own) or 'vllm' (an engine in each generating worker,
    fed the trainer's weights before every call and checked against them; behaviour log-probs are then recomputed
    by the trainer, and their difference from vLLM's is the mismatch/... metrics)."""


@dataclass(frozen=True)
class LoopConfig(ValidatedConfig):
    iterations: int = spec(50, ge=1)
    """RL iterations (one rollout batch and its updates each)."""
    eval_every: int = spec(10, ge=0)
    """Evaluate greedy held-out accuracy every this many iterations; 0 only at the end."""
    eval_prompts: int = spec(128, ge=1)
    """Held-out prompts per evaluation."""
    save_every: int = spec(10, ge=0)
    """Write a checkpoint every this many iterations; 0 only at the end."""
    keep_checkpoints: int | None = spec(None, ge=1)
    """Old name of checkpoint.keep_last, kept so configs written before it still load (with a warning; its value
    moves to checkpoint.keep_last); leave it unset."""
    progress: bool = True
    """Show progress: a bar on a terminal; plain lines (every progress_every iterations) when output is not one
    (a log file, `ray job submit`, a scheduler)."""
    progress_every: int = spec(10, ge=1)
    """Iterations between two plain progress lines when output is not a terminal (the last one is always shown)."""


@dataclass(frozen=True)
class CheckpointConfig(ValidatedConfig):
    keep_last: int = spec(2, ge=1)
    """Checkpoints kept on disk (older ones are deleted once a newer one is complete)."""
    format: str = spec("sharded", choices=("sharded", "full"))
    """'sharded': every worker writes its own shards of the weights and optimizer state, nothing is gathered
    (`loomrl export RUN_DIR/checkpoints/iter_N --role actor` writes a role's Hugging Face form); 'full': each role
    gathered whole onto one worker and written as a Hugging Face directory (memory: the whole roles there)."""


@dataclass(frozen=True)
class StepConfig(ValidatedConfig):
    on_nonfinite: str = spec("skip", choices=NONFINITE_ACTIONS)
    """An optimizer step of a trained role (actor, critic) whose loss or gradient norm is NaN or inf: 'skip' zeros
    its gradients and leaves weights and optimizer state as they were (a warning; <role>/skipped_steps in the
    metrics counts them); 'stop' ends the run with an error naming the role, iteration and step."""


@dataclass(frozen=True)
class ReportConfig(ValidatedConfig):
    backends: tuple[str, ...] = ()
    """Where metrics go besides RUN_DIR/metrics.jsonl and report.html: any of tensorboard (RUN_DIR/tb), wandb,
    mlflow. Each needs its package, an optional extra: pip install 'loomrl[tensorboard,wandb,mlflow]'."""
    project: str = "loomrl"
    """The wandb project and MLflow experiment the run is logged under."""
    run_name: str | None = None
    """The run's name in wandb and MLflow; None: the last part of run_dir."""
    wandb_mode: str = spec("auto", choices=("auto", "online", "offline"))
    """'auto': online when wandb's server answers and an API key is set (WANDB_MODE, when set, decides), else
    offline into RUN_DIR/wandb (upload later with `wandb sync`)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store (e.g. http://host:5000, sqlite:///mlflow.db); None: MLflow's own default
    (MLFLOW_TRACKING_URI when set)."""
    html: bool = True
    """Write RUN_DIR/report.html (curves, measured and predicted timelines, the plan, the config), refreshed with
    the plots every loop.save_every iterations and at the end."""

    def validate(self) -> None:
        for name in self.backends:
            if name not in BACKENDS:
                fail("backends", f"'{name}' is not a backend (valid: {', '.join(BACKENDS)})")
        if len(set(self.backends)) != len(self.backends):
            fail("backends", f"{list(self.backends)} names a backend twice")


@dataclass(frozen=True)
class LayoutConfig(ValidatedConfig):
    dp: int = spec(0, ge=0)
    """Data-parallel replicas; 0 means runtime.devices / tp."""
    tp: int = spec(1, ge=1)
    """Tensor-parallel shards (attention heads and MLP columns split over devices)."""
    pp: int = spec(1, ge=1)
    """Pipeline stages for train and inference calls (generation runs with pp=1: the weights are reallocated)."""
    sharding: str = spec("none", choices=("none", "zero", "fsdp"))
    """Trained roles (actor, critic): 'zero' shards the optimizer state over dp (ZeRO-1), 'fsdp' the weights,
    gradients and optimizer state (FSDP, each tp shard over dp; pp = 1; the role's other calls then run on a
    whole copy reallocated from the shards). Applies to its train calls."""

    def validate(self) -> None:
        if self.sharding == "fsdp" and self.pp > 1:
            fail(
                "sharding",
                f"fsdp does not combine with pipeline stages; with pp={self.pp} use zero "
                "(valid with fsdp: pp=1, any dp and tp)",
            )


@dataclass(frozen=True)
class DynamicPlacementConfig(ValidatedConfig):
    window: int = spec(10, ge=1)
    """Iterations over which a better plan's predicted gain per iteration is weighed against the cost of switching
    to it (fewer when the run ends sooner)."""
    margin_s: float = spec(0.0, ge=0)
    """Seconds by which that gain must exceed the priced switch cost."""
    min_gain: float = spec(0.1, ge=0, lt=1)
    """Least predicted gain per iteration, as a fraction of the current plan's time (a hysteresis band: two plans
    closer than this never trade places)."""
    confirm: int = spec(2, ge=1)
    """Consecutive checks (one after each iteration) a better plan must win before the run switches to it."""
    dwell: int = spec(5, ge=0)
    """Least iterations a plan runs before the run may switch away from it."""
    search_s: float = spec(5.0, gt=0)
    """Most seconds a search for candidate plans may take (heuristics, then a short annealing search); it runs
    between iterations, at the first check and whenever the workload has drifted (drift)."""
    search_share: float = spec(0.25, gt=0)
    """A search also takes at most this share of the latest iteration's time, so that searching stays a small part
    of a run whose iterations are short."""
    check_share: float = spec(0.01, ge=0)
    """Most share of the run's iteration time so far that the checks between searches (refit and re-pricing, some
    milliseconds each) may take: a check that finds them over it is skipped (its iteration is still recorded and
    fitted later), so their cost stays bounded when iterations are short. Searches are bounded by search_s and
    search_share instead; 0 re-prices only when a search runs."""
    drift: float = spec(0.5, gt=0)
    """Search again when the observed mean sample length (prompt + response) has moved by more than this fraction
    since the last search; between searches the candidates found are re-priced at every check."""
    history: int = spec(8, ge=1)
    """Latest iterations whose per-call times the cost model's corrections are refitted on."""


@dataclass(frozen=True)
class RuntimeConfig(ValidatedConfig):
    executor: str = spec("ray", choices=("ray", "reference"))
    """'reference' runs every MFC in this process, in workflow order (the ground truth); 'ray' runs them on
    one worker per device through Ray and torch.distributed, the controller moving only metadata."""
    devices: int = spec(0, ge=0)
    """Devices of the 'ray' executor: worker processes on CPU, GPUs on GPU machines; 0 means one per GPU, or
    one per CPU core where there is no GPU."""
    layouts: dict[str, LayoutConfig] = field(default_factory=dict)
    """Parallel layout per role (actor, critic, ref, reward); a role not named gets dp = devices, tp = 1."""
    plan: str | None = None
    """Execution plan of the 'ray' executor: colocate | interleave | separate[:N] | a plan string | a
    .json/.yaml plan file (see loomrl/plan/plan_string.py); None places every call on all devices with
    runtime.layouts. Each model call gets its own devices and layout; a role's weights move between them. The
    'reference' executor places nothing but takes what a plan changes of the run itself, its staleness (async),
    and what bounds its memory: each call's micro-batches (``mbN``) and recomputation (``rc``), e.g.
    'actor_gen=0; actor_train=0:mb8' on one device."""
    plan_changes: dict[int, str] = field(default_factory=dict)
    """Plans to switch to between iterations, by the iteration they start at, e.g. {4: separate:1, 8: interleave}
    (each a strategy, plan string or plan file, as for plan); every role's state moves to the new layouts and
    the run continues as it would have under the old plan."""
    placement: str = spec("static", choices=("static", "dynamic"))
    """'static' keeps runtime.plan (and its plan_changes); 'dynamic' (G-Core) re-plans between iterations from the
    run's own per-call times and observed response lengths, and switches plans when the predicted gain over
    runtime.dynamic.window iterations beats the priced switch (runtime.dynamic sets the rule); each decision goes
    to the metrics (placement/*) and RUN_DIR/placement.jsonl."""
    dynamic: DynamicPlacementConfig = field(default_factory=DynamicPlacementConfig)
    """The switch rule and re-planning budget of placement 'dynamic'."""
    cost_profile: str | None = None
    """Hardware profile JSON the runtime's own decisions price with (``loomrl calibrate`` writes one; e.g. a fused
    stage's ``migrate_at: auto``); None: the device kind's nominal profile."""
    cost_corrections: str | None = None
    """Fitted cost-model corrections JSON for those decisions (``loomrl calibrate --from``); None: uncorrected."""
    verify_reallocation: bool = False
    """Check every reallocated parameter piece against a checksum sent by its sender (costs a little time)."""
    ray_dashboard: bool = False
    """Start the Ray dashboard with the local Ray instance."""
    ray_address: str | None = None
    """Address of an existing Ray cluster to join; None starts a local Ray instance bound to this machine."""
    device: str = spec("auto", choices=("auto", "cpu", "cuda"))
    """Torch device kind; auto picks cuda when available."""
    precision: str = spec("auto", choices=("auto", "fp32", "bf16"))
    """fp32 throughout, or bf16 weights and activations with fp32 gradient sums, master weights and Adam moments
    (mixed precision; log-probs, values and losses stay fp32); auto is bf16 on cuda, fp32 on cpu."""
    threads: int = spec(0, ge=0)
    """Torch intra-op threads per process; 0 keeps torch's default (ray: cores / devices)."""
    timeout_s: float = spec(600.0, gt=0)
    """Longest wait for one MFC on the workers before the run fails with an error naming the stuck worker."""
    controllers: int = spec(1, ge=1)
    """Parallel controllers of the 'ray' executor (G-Core): each is a Ray actor that drives a shard of every
    iteration's prompts (whole groups) through the data-parallel replicas serving it; they agree through a small
    coordinator on what is global (training schedules, batch statistics). 1 is a single controller; it must
    divide every call's data-parallel degree."""
    max_failures: int = spec(0, ge=0)
    """Times the run recovers from a lost worker or controller (a process that died or stalled past timeout_s):
    every worker is replaced and the run continues from its latest checkpoint (from the start without one),
    each recovery logged to RUN_DIR/failures.jsonl and the metrics. 0 stops at the first failure; an error
    raised by a model call itself (a bug, bad data) always stops the run, since it would recur."""

    def validate(self) -> None:
        if self.controllers > 1 and self.executor != "ray":
            fail("controllers", f"{self.controllers} needs executor 'ray' (the reference executor has no controllers)")
        if self.placement == "dynamic":
            if self.executor != "ray":
                fail("placement", "'dynamic' needs executor 'ray' (the reference executor has no placement)")
            if self.controllers > 1:
                fail(
                    "placement",
                    f"'dynamic' needs one controller, not {self.controllers} (its candidate plans are "
                    "searched for one; valid with dynamic: controllers=1)",
                )
            if self.plan_changes:
                fail(
                    "plan_changes",
                    "fixed plan changes do not combine with placement 'dynamic', which chooses its "
                    "own; give one or the other",
                )
        for iteration, plan in self.plan_changes.items():
            if self.executor != "ray":
                fail(f"plan_changes.{iteration}", "needs executor 'ray' (the reference executor has no placement)")
            if iteration < 1:
                fail(f"plan_changes.{iteration}", "iterations of plan changes start at 1 (runtime.plan is the first)")
            if not plan.strip():
                fail(
                    f"plan_changes.{iteration}",
                    "'' is empty; give colocate, interleave, separate[:N], a plan string or a plan file",
                )
        for role, layout in self.layouts.items():
            if role not in ROLES and ((index := judge_index(role)) is None or role != judge_role(index)):
                fail(f"layouts.{role}", f"unknown role; valid roles: {', '.join(ROLES)}, judge0, judge1, ...")
            if layout.sharding != "none" and role not in ("actor", "critic"):
                fail(
                    f"layouts.{role}.sharding",
                    f"{layout.sharding} shards a trained role's state; {role} is "
                    "frozen (valid: none; actor and critic may shard)",
                )
            if not self.devices:
                continue  # checked once the device count is known (RayExecutor)
            dp = layout.dp or self.devices // (layout.tp * layout.pp)
            if dp * layout.tp * layout.pp != self.devices:
                fail(
                    f"layouts.{role}",
                    f"dp {dp} x tp {layout.tp} x pp {layout.pp} = "
                    f"{dp * layout.tp * layout.pp} does not match devices {self.devices}",
                )


@dataclass(frozen=True)
class TrainConfig(ValidatedConfig):
    seed: int = spec(0, ge=0, lt=2**63)
    """Seed of model init, data order and every sample's random stream."""
    run_dir: str = "runs/train"
    """Where metrics, checkpoints and plots are written."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The prompts and the rule that scores responses."""
    actor: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy being trained (its initial weights also serve as the frozen reference)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (ppo only)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward signal."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm and its hyper-parameters."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation settings of rollouts."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """Iterations, evaluation, checkpoints and progress."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What is kept of the run's checkpoints (loop.save_every says when one is written)."""
    train: StepConfig = field(default_factory=StepConfig)
    """How the trained roles' optimizer steps meet numerical faults."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """Where metrics are logged and the run report is written."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Where and how the workflow executes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        old = self.loop.keep_checkpoints
        if old is None:
            return
        # The one rename this tree has: configs (and runs' config.yaml) written before checkpoint.keep_last load,
        # their value moved to where it is read now, once and loudly, so nothing reads two fields for it.
        if self.checkpoint.keep_last not in (old, CheckpointConfig().keep_last):
            fail(
                "loop.keep_checkpoints",
                f"{old} conflicts with checkpoint.keep_last {self.checkpoint.keep_last}; "
                "loop.keep_checkpoints is its old name: give checkpoint.keep_last only",
            )
        warnings.warn(
            f"loop.keep_checkpoints is the old name of checkpoint.keep_last; using checkpoint.keep_last="
            f"{old} (write that instead)",
            FutureWarning,
            stacklevel=2,
        )
        object.__setattr__(self, "checkpoint", dataclasses.replace(self.checkpoint, keep_last=old))
        object.__setattr__(self, "loop", dataclasses.replace(self.loop, keep_checkpoints=None))

    def validate(self) -> None:
        self.task.check_rewarded(self.rollout.env.enabled)
        count = len(self.reward.judges)
        for role in self.runtime.layouts:
            index = judge_index(role)
            if index is not None and index >= count:
                valid = ", ".join(judge_role(i) for i in range(count)) or "none"
                fail(f"runtime.layouts.{role}", f"no such judge: reward.judges has {count} (valid: {valid})")
        longest = self.rollout.max_new_tokens
        if self.algo.overlong_buffer > longest:
            fail(
                "algo.overlong_buffer",
                f"{self.algo.overlong_buffer} is more than rollout.max_new_tokens {longest} (valid: 0 to {longest})",
            )
        if self.algo.dynamic_sampling.enabled and self.runtime.controllers > 1:
            fail(
                "algo.dynamic_sampling.enabled",
                f"dynamic sampling runs with one controller, not "
                f"{self.runtime.controllers} (valid with it: runtime.controllers=1)",
            )
        if self.algo.dynamic_sampling.enabled and self.runtime.placement == "dynamic":
            fail(
                "algo.dynamic_sampling.enabled",
                "dynamic sampling does not combine with runtime.placement "
                "'dynamic', whose per-call timings assume one batch an iteration "
                "(valid with it: runtime.placement=static)",
            )
        lora = [role for role, cfg in (("actor", self.actor.lora), ("critic", self.critic.lora)) if cfg.enabled]
        if lora and self.checkpoint.format == "full":
            fail(
                "checkpoint.format",
                f"'full' writes whole models; {lora[0]}.lora trains adapters, which sharded checkpoints hold "
                "(valid with LoRA: sharded; loomrl export --merged writes the whole model)",
            )
        if self.rollout.env.enabled and (self.reward.source != "rule" or self.algo.name == "remax"):
            bad = ("algo.name", "remax") if self.algo.name == "remax" else ("reward.source", self.reward.source)
            fail(
                bad[0],
                f"'{bad[1]}' does not combine with rollout.env, whose episodes' rewards are their environment's "
                "(valid with it: reward.source rule; algo.name ppo, grpo, rloo, reinforce_pp)",
            )
        if self.runtime.controllers > self.rollout.prompts_per_iter:
            fail(
                "runtime.controllers",
                f"{self.runtime.controllers} controllers need at least as many prompts an "
                f"iteration (rollout.prompts_per_iter is {self.rollout.prompts_per_iter})",
            )

    @property
    def reference_role(self) -> str:
        """The role whose model gives the KL reference's log-probs: ``ref``, or ``actor`` (its base, adapters
        off) for a LoRA actor with ``actor.lora.reference: base``."""
        lora = self.actor.lora
        return "actor" if lora.enabled and lora.reference == "base" else "ref"

    def model_of(self, role: str) -> str | None:
        """The model ``role`` is built from (a zoo name or a checkpoint directory), with the config field it comes
        from; None for a reward without a model (``reward.source: rule``). The reference policy is the actor's
        starting point, the critic starts from ``critic.model`` (else the actor's), the reward model and the judges
        from their own fields."""
        return self.model_field(role)[0]

    def model_field(self, role: str) -> tuple[str | None, str]:
        """``(model, the config field it comes from)`` of ``role`` (:meth:`model_of`); a one-line error names the
        roles there are."""
        index = judge_index(role)
        if index is not None and index < len(self.reward.judges):
            return self.reward.judges[index].model, f"reward.judges[{index}].model"
        if role in ("actor", "ref"):
            return self.actor.model, "actor.model"
        if role == "critic":
            return (self.critic.model, "critic.model") if self.critic.model else (self.actor.model, "actor.model")
        if role == "reward":
            return (self.reward.model if self.reward.source in ("model", "both") else None), "reward.model"
        known = [*ROLES, *(judge_role(i) for i in range(len(self.reward.judges)))]
        raise ConfigError(f"no model for role '{role}'; known roles: {', '.join(known)}")


@dataclass(frozen=True)
class SFTConfig(ValidatedConfig):
    seed: int = spec(0, ge=0, lt=2**63)
    """Seed of model init and data order."""
    out_dir: str = "runs/sft"
    """The HF checkpoint (model + tokenizer) is written here."""
    model: str = "llama-1m"
    """Zoo name or local checkpoint directory to start from."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Task whose demonstrations are learned."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn demonstrations: ``env.name`` names an environment whose ``demonstrate(row)`` gives each row's
    turns (the built-ins': a tool call and the answer; a binary search), played through it; the loss covers the
    turns, not the observations. None: the task's single-response demonstrations."""
    steps: int = spec(200, ge=1)
    """Optimizer steps."""
    batch_size: int = spec(64, ge=1)
    """Demonstrations per step."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, weight_decay=0.01))
    """Optimizer."""
    eval_prompts: int = spec(128, ge=1)
    """Held-out prompts for the final greedy exact-match evaluation."""
    max_new_tokens: int = spec(8, ge=1, le=131072)
    """Generation budget of the evaluation."""
    device: str = spec("auto", choices=("auto", "cpu", "cuda"))
    """Torch device kind; auto picks cuda when available."""
    precision: str = spec("auto", choices=("auto", "fp32", "bf16"))
    """Weights, activations and gradients in fp32, or in bf16 with fp32 master weights and Adam moments in the
    optimizer (mixed precision; log-probs, values and losses stay fp32); auto is bf16 on cuda, fp32 on cpu."""

    def validate(self) -> None:
        self.task.check_rewarded(self.env.enabled if self.env.enabled else None)


@dataclass(frozen=True)
class RMConfig(ValidatedConfig):
    seed: int = spec(0, ge=0, lt=2**63)
    """Seed of head init, pair generation and data order."""
    out_dir: str = "runs/rm"
    """The HF sequence-classification checkpoint is written here."""
    model: str = "llama-1m"
    """Zoo name or checkpoint to start from (an SFT checkpoint gives the RM a head start)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Task whose rule ranks the preference pairs."""
    train_pairs: int = spec(4096, ge=2)
    """Preference pairs to train on."""
    eval_pairs: int = spec(512, ge=2)
    """Held-out pairs for the accuracy report."""
    epochs: int = spec(2, ge=1)
    """Passes over the training pairs."""
    batch_size: int = spec(64, ge=1)
    """Pairs per step."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer."""
    device: str = spec("auto", choices=("auto", "cpu", "cuda"))
    """Torch device kind; auto picks cuda when available."""
    precision: str = spec("auto", choices=("auto", "fp32", "bf16"))
    """Weights, activations and gradients in fp32, or in bf16 with fp32 master weights and Adam moments in the
    optimizer (mixed precision; log-probs, values and losses stay fp32); auto is bf16 on cuda, fp32 on cpu."""

    def validate(self) -> None:
        self.task.check_rewarded()


@dataclass(frozen=True)
class EvalConfig(ValidatedConfig):
    model: str = ""
    """The policy: a checkpoint directory (set from the command's CHECKPOINT_OR_RUN argument)."""
    seed: int = spec(0, ge=0, lt=2**63)
    """Seed of every sampled response's random stream."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The prompts (task.eval_file, a prompt file or a synthetic task's eval stream) and the rule that scores
    responses; a run's own task settings unless overridden."""
    prompts: int = spec(128, ge=0)
    """Prompts evaluated, the first of the evaluation set; 0 means all of a prompt file."""
    samples: int = spec(8, ge=0)
    """Responses sampled per prompt (n of the pass@k estimator); 0 evaluates greedily only."""
    pass_k: tuple[int, ...] = (1, 4, 8)
    """The k of each pass@k reported: the chance that at least one of k samples is exactly right, estimated
    without bias from the n = samples drawn (each k must be <= samples)."""
    temperature: float = spec(1.0, gt=0, le=10)
    """Sampling temperature of the pass@k samples (the accuracy is greedy)."""
    top_p: float = spec(1.0, gt=0, le=1)
    """Nucleus sampling mass of the samples; 1.0 disables."""
    max_new_tokens: int = spec(8, ge=1, le=1024)
    """Longest response, in tokens; a run's own rollout.max_new_tokens unless overridden."""
    batch_size: int = spec(128, ge=1)
    """Sequences generated together."""
    out: str | None = None
    """JSON file of the results; None writes eval.json into the run (or checkpoint) directory."""
    device: str = spec("auto", choices=("auto", "cpu", "cuda"))
    """Torch device kind; auto picks cuda when available."""
    precision: str = spec("auto", choices=("auto", "fp32", "bf16"))
    """Weights and activations in fp32 or bf16 (log-probabilities in fp32); auto is bf16 on cuda, fp32 on cpu."""

    def validate(self) -> None:
        if not self.model:
            fail("model", "no checkpoint given (loomrl eval CHECKPOINT_OR_RUN)")
        self.task.check_rewarded()
        bad = [k for k in self.pass_k if k < 1 or (self.samples and k > self.samples)]
        if bad:  # with samples 0 there is no pass@k to report, whatever pass_k says
            fail("pass_k", f"k={bad[0]} needs 1 <= k <= samples ({self.samples}); lower k or raise samples")
