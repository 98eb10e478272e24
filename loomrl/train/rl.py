"""`loomrl train`: one RL training loop for every algorithm (PPO, GRPO, RLOO, ReMax, REINFORCE++).

Each iteration takes ``rollout.prompts_per_iter`` prompts at the current data position (each repeated
``group_size`` times for group algorithms), runs the algorithm's workflow on the executor, and logs reward,
KL, response length and the training statistics. Held-out greedy evaluation, atomic checkpoints and
``--resume`` (model, optimizer, RNG and data position) make a stopped run continue exactly as if it had not
stopped.

Run:  loomrl train examples/ppo_sort.yaml loop.iterations=20
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from loomrl.algorithms.lr import learning_rate
from loomrl.algorithms.roles import Role
from loomrl.algorithms.workflows import build_workflow
from loomrl.checkpoint import latest_checkpoint
from loomrl.config import TrainConfig
from loomrl.configtools import dump_yaml
from loomrl.errors import ConfigError, DataError
from loomrl.models.zoo import build_causal_lm, build_value_model, check_model_spec
from loomrl.parallel.main_grad import accumulate_in_fp32
from loomrl.report import MetricsLogger, plot_reward_curve
from loomrl.runtime.reference import IterationResult, ReferenceExecutor
from loomrl.train import common
from loomrl.train.evaluate import evaluate_policy
from loomrl.train.metrics import rollout_metrics
from loomrl.train.progress import RunProgress
from loomrl.workflow.batch import Batch

GROUP_ALGORITHMS = ("grpo", "rloo")


def check_models(cfg: TrainConfig) -> None:
    specs = {"actor.model": cfg.actor.model, "critic.model": cfg.critic.model, "reward.model": cfg.reward.model}
    for field, spec in specs.items():
        if spec is not None:
            _named(field, check_model_spec, spec)


def _named(field: str, build, *args):
    """Run a model builder; its one-line error gains the config field it came from."""
    try:
        return build(*args)
    except DataError as err:
        raise DataError(f"{field}: {err}") from None


def build_role_model(cfg: TrainConfig, name: str, tokenizer, device: torch.device) -> torch.nn.Module | None:
    """The initial model of one role (None for a rule-only reward); the same weights on every process, in the
    dtype of ``runtime.precision`` (drawn or loaded in fp32, then rounded, so every precision starts alike)."""
    dtype = common.resolve_dtype(cfg.runtime.precision, device)
    if name in ("actor", "ref"):  # the reference policy is the actor's starting point
        model = _named("actor.model", build_causal_lm, cfg.actor.model, tokenizer, cfg.seed).to(device, dtype)
        return model.eval().requires_grad_(False) if name == "ref" else model
    if name == "critic":
        field = "critic.model" if cfg.critic.model else "actor.model"
        return _named(field, build_value_model, cfg.critic.model or cfg.actor.model, tokenizer,
                      cfg.seed + 1).to(device, dtype)
    if name == "reward" and cfg.reward.source in ("model", "both"):
        model = _named("reward.model", build_value_model, cfg.reward.model, tokenizer, cfg.seed).to(device, dtype)
        return model.eval().requires_grad_(False)
    return None


def make_role(cfg: TrainConfig, name: str, model: torch.nn.Module | None, task, trainable: bool,
              zero_group=None) -> Role:
    """A role around an (already parallelised) model; trainable roles get their optimizer here (its state
    sharded over ``zero_group`` when given: ZeRO-1)."""
    if name == "reward":
        rule = task.score if cfg.reward.source in ("rule", "both") else None
        return Role("reward", model, rule=rule, rule_weight=cfg.reward.rule_weight,
                    model_weight=cfg.reward.model_weight)
    optim = {"actor": cfg.actor.optim, "critic": cfg.critic.optim}.get(name)
    if not trainable or optim is None:
        return Role(name, model)
    accumulate_in_fp32(model)  # 16-bit weights sum their gradients in fp32 (fp32 models are left alone)
    steps = cfg.loop.iterations * cfg.algo.ppo_epochs * cfg.algo.minibatches  # the run's optimizer steps
    return Role(name, model, common.adamw(model, optim, zero_group), optim.grad_clip,
                lr_at=partial(learning_rate, optim, total_steps=steps))


def build_roles(cfg: TrainConfig, tokenizer, task, device: torch.device) -> dict[str, Role]:
    """Actor (trainable), ref (frozen copy of the actor's start), critic (ppo), reward (rule and/or model)."""
    names = ["actor", "ref"] + (["critic"] if cfg.algo.name == "ppo" else []) + ["reward"]
    return {name: make_role(cfg, name, build_role_model(cfg, name, tokenizer, device), task,
                            trainable=name in ("actor", "critic")) for name in names}


def make_executor(cfg: TrainConfig, workflow, tokenizer, task, device: torch.device):
    """The executor named by ``runtime.executor``, with every role built."""
    if cfg.runtime.executor == "ray":
        from loomrl.runtime.ray_executor import RayExecutor  # imports Ray only when asked for

        return RayExecutor(cfg, workflow, tokenizer)
    roles = build_roles(cfg, tokenizer, task, device)
    decode = partial(common.decode_response, tokenizer)
    evaluate = partial(_evaluate, tokenizer=tokenizer, task=task, max_new_tokens=cfg.rollout.max_new_tokens)
    return ReferenceExecutor(workflow, roles, cfg.seed, tokenizer.pad_token_id, tokenizer.eos_token_id, decode,
                             metrics_fn=partial(rollout_metrics, decode=decode, task=task),
                             evaluate_fn=evaluate, tokenizer=tokenizer)


def _evaluate(model, examples, tokenizer, task, max_new_tokens: int) -> dict[str, float]:
    return evaluate_policy(model, tokenizer, task, examples, max_new_tokens)


@dataclass
class RunState:
    iteration: int = 0
    """Next iteration to run; also fixes the data position (iteration × prompts_per_iter)."""


class RLTrainer:
    """Builds everything a run needs from its config, then runs (or resumes) the loop."""

    def __init__(self, cfg: TrainConfig):
        common.set_threads(cfg.runtime.threads)
        self.cfg = cfg
        self.device = common.resolve_device(cfg.runtime.device)
        self.run_dir = Path(cfg.run_dir)
        self.tokenizer = common.tokenizer_for(cfg.actor.model)
        self.task = common.build_task(cfg.task)
        self.train_prompts = common.prompt_source(cfg.task, self.task, cfg.seed, "train")
        self.eval_examples = common.examples_window(
            common.prompt_source(cfg.task, self.task, cfg.seed, "eval"), 0, cfg.loop.eval_prompts)
        self.workflow = build_workflow(cfg.algo, cfg.rollout)
        check_models(cfg)  # before any worker starts, so a typo costs nothing
        self.executor = make_executor(cfg, self.workflow, self.tokenizer, self.task, self.device)
        self.state = RunState()

    @property
    def group_size(self) -> int:
        return self.cfg.algo.group_size if self.cfg.algo.name in GROUP_ALGORITHMS else 1

    def make_batch(self, iteration: int) -> Batch:
        """The prompts of ``iteration``; sample ids are global (data position × group + member)."""
        n, g = self.cfg.rollout.prompts_per_iter, self.group_size
        start = iteration * n
        examples = common.examples_window(self.train_prompts, start, n)
        ids = [(start + i) * g + j for i in range(n) for j in range(g)]
        rows = [ex for ex in examples for _ in range(g)]
        return Batch(ids, {
            "prompt_ids": [common.encode_prompt(self.tokenizer, ex.prompt) for ex in rows],
            "prompt_text": [ex.prompt for ex in rows],
            "answer": [ex.answer for ex in rows],
        })

    def resume(self) -> bool:
        """Load the latest checkpoint of run_dir, if any; returns whether one was found."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False
        state = self.executor.load(path)
        self.state = RunState(iteration=int(state["iteration"]) + 1)
        return True

    def save(self, iteration: int) -> Path:
        state = {"data_position": (iteration + 1) * self.cfg.rollout.prompts_per_iter}
        return self.executor.save(self.run_dir, iteration, state, self.cfg.loop.keep_checkpoints)

    def iteration_metrics(self, result: IterationResult, seconds: float) -> dict[str, float]:
        metrics = {**result.stats, "perf/samples_per_s": self.cfg.rollout.prompts_per_iter * self.group_size / seconds,
                   "time/iteration_s": seconds}
        for tr in result.traces:
            metrics[f"time/{tr.name}_s"] = tr.end - tr.start
        return metrics

    def write_traces(self, result: IterationResult) -> None:
        """Per-MFC start/end per device, so any run can be drawn like a simulated plan (`loomrl timeline`)."""
        kinds = {m.name: m.kind.value for m in self.workflow}
        with open(self.run_dir / "traces.jsonl", "a") as f:
            for tr in result.traces:
                f.write(json.dumps({"iteration": tr.iteration, "mfc": tr.name, "role": tr.role, "kind": kinds[tr.name],
                                    "start": tr.start, "end": tr.end, "devices": list(tr.devices)}) + "\n")

    def evaluate(self) -> dict[str, float]:
        return {f"eval/{k}": v for k, v in self.executor.evaluate(self.eval_examples).items()}

    def run(self, resume: bool = False) -> dict[str, float]:
        """Run the remaining iterations, then release the executor; returns the last iteration's metrics."""
        try:
            return self._run(resume)
        finally:
            self.close()

    def _run(self, resume: bool) -> dict[str, float]:
        cfg, loop = self.cfg, self.cfg.loop
        resumed = resume and self.resume()
        if not resumed and latest_checkpoint(self.run_dir) is not None:
            raise ConfigError(f"run_dir: '{self.run_dir}' already holds checkpoints; pass --resume to continue it "
                              "or choose another run_dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        traces = self.run_dir / "traces.jsonl"
        if not resumed and traces.exists():  # a restart from iteration 0 keeps the old traces aside
            traces.replace(self.run_dir / "traces.superseded.jsonl")
        last: dict[str, float] = {}
        start = self.state.iteration
        with MetricsLogger(self.run_dir, loop.tensorboard, resume_from_iteration=start - 1) as logger, \
                RunProgress(loop.iterations, start, enabled=loop.progress) as progress:
            for it in range(start, loop.iterations):
                t0 = time.perf_counter()
                result = self.executor.run_iteration(it, self.make_batch(it))
                last = self.iteration_metrics(result, time.perf_counter() - t0)
                self.write_traces(result)
                final = it == loop.iterations - 1
                if final or (loop.eval_every and (it + 1) % loop.eval_every == 0):
                    last.update(self.evaluate())
                logger.log(it, last)
                progress.update(it, last)
                if final or (loop.save_every and (it + 1) % loop.save_every == 0):
                    self.save(it)
        plot_reward_curve(self.run_dir)
        return last

    def close(self) -> None:
        self.executor.close()
