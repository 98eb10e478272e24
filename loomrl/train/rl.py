"""`loomrl train`: one RL training loop for every algorithm (PPO, GRPO, RLOO, ReMax, REINFORCE++).

Each iteration takes ``rollout.prompts_per_iter`` prompts at the current data position (each repeated
``group_size`` times for group algorithms), runs the algorithm's workflow on the executor, and logs reward,
KL, response length and the training statistics. Held-out greedy evaluation, atomic checkpoints and
``--resume`` (model, optimizer, RNG and data position) make a stopped run continue exactly as if it had not
stopped.

Run:  loomrl train examples/ppo_sort.yaml loop.iterations=20
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from loomrl.algorithms.context import Role
from loomrl.algorithms.dynamic_sampling import DynamicSampler
from loomrl.algorithms.episode_ops import env_prompt
from loomrl.algorithms.evaluate import evaluate_policy
from loomrl.algorithms.metrics import rollout_metrics
from loomrl.algorithms.mismatch import mismatch_metrics
from loomrl.algorithms.workflows import build_workflow
from loomrl.checkpoint.store import latest_checkpoint, remove_leftovers
from loomrl.config.environment import EnvConfig
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import dump_yaml, to_dict
from loomrl.data.sources import build_task, examples_window, held_out, prompt_source
from loomrl.envs import load_environment
from loomrl.errors import ConfigError, DataError, LoomError
from loomrl.models.tokenizer import decode_response, encode_prompt, task_tokenizer
from loomrl.models.zoo import check_model_spec
from loomrl.plan import ClusterSpec, ExecutionPlan, colocate
from loomrl.plan.combinations import check_combinations
from loomrl.plan.from_config import plan_from_config
from loomrl.plan.plan_string import format_plan_string
from loomrl.plan.schedule import build_schedule
from loomrl.planner.calibration.local import usable_cores
from loomrl.planner.inputs import PlannerInputs, inputs_from_config
from loomrl.report import MetricsLogger, plot_reward_curve
from loomrl.report.backends import check_backends, open_backends
from loomrl.report.html import write_run_report
from loomrl.role import (
    ModelPasses,
    RoleSpec,
    build_model,
    make_role,
    resolve_device,
    resolve_dtype,
    role_specs,
    set_threads,
)
from loomrl.run_dir import RunDir
from loomrl.runtime.executor import GENERATED_AHEAD, Executor, IterationResult
from loomrl.runtime.launch import local_cluster, ray_address, runtime_cluster
from loomrl.runtime.reference import ReferenceExecutor
from loomrl.runtime.spec import WorkerSpec
from loomrl.train.dynamic_placement import DynamicPlacement, timed_check
from loomrl.train.progress import RunProgress
from loomrl.workflow import Workflow
from loomrl.workflow.batch import Batch


def check_models(cfg: TrainConfig) -> None:
    specs = {
        "actor.model": cfg.actor.model,
        "critic.model": cfg.critic.model,
        "reward.model": cfg.reward.model,
        **{f"reward.judges[{i}].model": j.model for i, j in enumerate(cfg.reward.judges)},
    }
    for field, spec in specs.items():
        if spec is not None:
            try:
                check_model_spec(spec)
            except DataError as err:
                raise DataError(f"{field}: {err}") from None
    if cfg.rollout.env.name is not None:  # the environment too
        try:
            load_environment(cfg.rollout.env.name)
        except DataError as err:
            raise DataError(f"rollout.env.name: {err}") from None


def worker_spec(cfg: TrainConfig, workflow: Workflow) -> WorkerSpec:
    """What every worker of the run needs: its roles' specs and the settings that reach a device."""
    rt = cfg.runtime
    return WorkerSpec(
        role_specs(cfg, workflow.roles()),
        cfg.task,
        cfg.actor.model,
        cfg.seed,
        rt.device,
        rt.precision,
        rt.threads,
        rt.timeout_s,
        rt.verify_reallocation,
        cfg.rollout.max_new_tokens,
        cfg.rollout.env,
    )


def build_roles(
    specs: dict[str, RoleSpec], tokenizer, task, device: torch.device, dtype: torch.dtype
) -> dict[str, Role]:
    """Every role whole in this process (the reference executor's): trained roles with their optimizers."""
    roles = {}
    for name, spec in specs.items():
        model = build_model(spec, tokenizer, device, dtype)
        roles[name] = make_role(
            spec, model, task, None if model is None else ModelPasses(model), trainable=spec.trained
        )
    return roles


def run_cluster(cfg: TrainConfig) -> ClusterSpec:
    """The devices of the run: one for the reference executor (which has no placement); for the Ray runtime,
    this machine's, or those of the Ray cluster it joins (counted from the cluster's resources)."""
    rt = cfg.runtime
    if rt.executor == "reference":
        return ClusterSpec(nodes=1, devices_per_node=1)
    return runtime_cluster(rt.devices, rt.device, ray_address(rt.ray_address))


def surviving_cluster(cfg: TrainConfig, cluster: ClusterSpec) -> ClusterSpec:
    """The devices a recovery can run on after losing a worker of ``cluster``: ``cluster`` itself where its devices
    are processes on this machine's CPUs (a lost one is started again); else the GPUs or the Ray cluster's nodes
    counted anew, when fewer are left than ``cluster`` has (a GPU or a node lost with its worker)."""
    rt = cfg.runtime
    address = ray_address(rt.ray_address)
    if rt.executor == "reference" or (address is None and cluster.device_kind == "cpu"):
        return cluster
    now = runtime_cluster(0, rt.device, address)
    return now if now.n_devices < cluster.n_devices else cluster


def run_plan(cfg: TrainConfig, workflow: Workflow, cluster: ClusterSpec, text: str | None = None) -> ExecutionPlan:
    """The plan the run's executor runs on ``cluster``: ``text`` (by default the run's ``runtime.plan``); for the
    reference executor the whole workflow colocated, with the given plan's staleness (the one setting of a plan
    that changes the run it computes) and each call's micro-batches and recomputation (what bounds its memory)."""
    if cfg.runtime.executor == "reference":
        given = text if text is not None else cfg.runtime.plan
        plan = colocate(workflow, cluster)
        if not given:
            return plan
        devices = local_cluster(cfg.runtime.devices, cfg.runtime.device)  # this machine's, as a local Ray run's
        told = plan_from_config(cfg.runtime, workflow, devices, given)
        allocations = {
            name: dataclasses.replace(alloc, micro_batches=mine.micro_batches, recompute=mine.recompute)
            if (mine := told.allocations.get(name)) is not None
            else alloc
            for name, alloc in plan.allocations.items()
        }
        return dataclasses.replace(plan, allocations=allocations, asynchronous=told.asynchronous)
    return plan_from_config(cfg.runtime, workflow, cluster, text)


def planner_inputs(cfg: TrainConfig, workflow: Workflow, cluster: ClusterSpec, tokenizer) -> PlannerInputs:
    """The run's planner inputs on ``cluster``, built once: what the runtime prices its own decisions with and
    dynamic placement re-plans with. Worker processes on this machine's CPUs share its cores."""
    local = cluster.device_kind == "cpu" and ray_address(cfg.runtime.ray_address) is None
    return inputs_from_config(
        cfg, cluster, workflow=workflow, cores=usable_cores() if local else None, tokenizer=tokenizer
    )


def make_executor(
    cfg: TrainConfig,
    workflow: Workflow,
    plan: ExecutionPlan,
    tokenizer,
    task,
    device: torch.device,
    inputs: PlannerInputs | None,
) -> Executor:
    """The executor named by ``runtime.executor``, with every role built, running ``plan``; the Ray executor
    prices its own decisions with ``inputs``."""
    if cfg.runtime.executor == "ray":
        from loomrl.runtime.ray_executor import RayExecutor  # imports Ray only when asked for

        assert inputs is not None, "the Ray executor prices its own decisions: give it the run's planner inputs"
        return RayExecutor(
            cfg.runtime, worker_spec(cfg, workflow), workflow, plan, inputs, group_size=cfg.algo.samples_per_prompt
        )
    dtype = resolve_dtype(cfg.runtime.precision, device)
    roles = build_roles(role_specs(cfg, workflow.roles()), tokenizer, task, device, dtype)
    decode = partial(decode_response, tokenizer)
    evaluate = partial(
        _evaluate, tokenizer=tokenizer, task=task, max_new_tokens=cfg.rollout.max_new_tokens, env=cfg.rollout.env
    )
    return ReferenceExecutor(
        build_schedule(workflow, plan),
        roles,
        cfg.seed,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        decode,
        metrics_fn=partial(rollout_metrics, decode=decode, task=task),
        evaluate_fn=evaluate,
        tokenizer=tokenizer,
    )


def _evaluate(model, examples, tokenizer, task, max_new_tokens: int, env: EnvConfig) -> dict[str, float]:
    return evaluate_policy(model, tokenizer, task, examples, max_new_tokens, env=env)


@dataclass
class RunState:
    iteration: int = 0
    """Next iteration to run; also fixes the data position (iteration × prompts_per_iter)."""


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with every file and directory it names made absolute against this process's working directory.

    The workers of a run may start elsewhere (on a cluster started by ``ray start``, in the directory it ran
    in), where a relative path would name another file or none; zoo names and keywords stay as they are."""

    def path(value: str | None, keywords: tuple[str, ...] = ()) -> str | None:
        return str(Path(value).resolve()) if value and value not in keywords and os.path.exists(value) else value

    def reward(spec: str | None) -> str | None:  # 'file.py:function' names a file; 'module:function' does not
        module, colon, function = (spec or "").rpartition(":")
        return f"{path(module)}{colon}{function}" if colon and module.endswith(".py") else spec

    task = cfg.task
    task = dataclasses.replace(
        task,
        prompt_file=path(task.prompt_file),
        eval_file=path(task.eval_file),
        tokenizer=path(task.tokenizer, ("auto", "task")),
        chat_template=path(task.chat_template, ("auto", "none")),
        reward_fn=reward(task.reward_fn),
        reward_fns=tuple(reward(s) for s in task.reward_fns),
    )
    sampling = cfg.algo.dynamic_sampling
    algo = dataclasses.replace(cfg.algo, dynamic_sampling=dataclasses.replace(sampling, filter=reward(sampling.filter)))
    env = dataclasses.replace(cfg.rollout.env, name=reward(cfg.rollout.env.name))
    return dataclasses.replace(
        cfg,
        run_dir=str(Path(cfg.run_dir).resolve()),
        task=task,
        algo=algo,
        rollout=dataclasses.replace(cfg.rollout, env=env),
        actor=dataclasses.replace(cfg.actor, model=path(cfg.actor.model)),
        critic=dataclasses.replace(cfg.critic, model=path(cfg.critic.model)),
        reward=dataclasses.replace(
            cfg.reward,
            model=path(cfg.reward.model),
            judges=tuple(
                dataclasses.replace(j, model=path(j.model), verdict=reward(j.verdict)) for j in cfg.reward.judges
            ),
        ),
    )


class RLTrainer:
    """Builds everything a run needs from its config, then runs (or resumes) the loop."""

    def __init__(self, cfg: TrainConfig):
        cfg = absolute_paths(cfg)
        set_threads(cfg.runtime.threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.runtime.device)
        self.run_dir = Path(cfg.run_dir)
        check_models(cfg)  # before any worker starts, so a typo costs nothing
        check_backends(cfg.report.backends)  # and so does a logging backend that is not installed
        self.tokenizer = task_tokenizer(cfg.task, cfg.actor.model)
        self.task = build_task(cfg.task)
        self.train_prompts = prompt_source(cfg.task, self.task, cfg.seed, "train")
        self.eval_examples = held_out(cfg.task, self.task, cfg.seed, cfg.loop.eval_prompts)
        self.workflow = build_workflow(cfg.algo, cfg.rollout, cfg.reward, cfg.reference_role)
        self.plans = self._plans(run_cluster(cfg))  # every plan checked before any worker starts
        self.plan = self.plans[0]
        self.inputs = self._inputs()
        self.executor: Executor = make_executor(
            cfg, self.workflow, self.plan, self.tokenizer, self.task, self.device, self.inputs
        )
        """What runs the iterations: only the :class:`~loomrl.runtime.executor.Executor` protocol is used of it."""
        self.placement = self._placement()
        self.sampler = self._sampler()
        self.state = RunState()
        self.generated_ahead: frozenset[int] = frozenset()
        """The iterations whose batches generated ahead the checkpoint resumed from held."""
        self.running, self.completed = 0, -1
        """The iteration under way (a failure's), and the last one logged."""
        self.recovery: dict[str, float] = {}
        """What the next logged iteration reports of a recovery just made."""

    def _plans(self, cluster: ClusterSpec, recovering: bool = False) -> dict[int, ExecutionPlan]:
        """The run's plans on ``cluster`` by the iteration they start at: ``runtime.plan`` and its
        ``plan_changes``. When a recovery continues on fewer devices than the plans were given for, a plan that
        does not fit them falls back to every call colocated on all of them, at the run's staleness (the
        checkpoint's batches generated ahead are trained on as planned), and such a plan change is dropped."""
        cfg = self.cfg
        try:
            plans = {0: run_plan(cfg, self.workflow, cluster)}
        except ConfigError:
            if not recovering:
                raise
            fallback = colocate(self.workflow, cluster)
            plans = {0: dataclasses.replace(fallback, asynchronous=self.plans[0].asynchronous)}
        for iteration, text in sorted(cfg.runtime.plan_changes.items()):
            try:
                plans[iteration] = run_plan(cfg, self.workflow, cluster, text)
            except ConfigError as err:
                if not recovering:
                    raise ConfigError(f"runtime.plan_changes.{iteration}: {err}") from None
            if iteration in plans and plans[iteration].staleness != plans[0].staleness:
                raise ConfigError(
                    f"runtime.plan_changes.{iteration}: its staleness (async) {plans[iteration].staleness} differs "
                    f"from the run's plan's {plans[0].staleness}; a run keeps one (valid: {plans[0].staleness})"
                )
        for iteration, plan in plans.items():
            try:
                check_combinations(cfg, self.workflow, plan)
            except ConfigError as err:
                raise ConfigError(f"runtime.plan_changes.{iteration}: {err}" if iteration else str(err)) from None
        return plans

    def _inputs(self) -> PlannerInputs | None:
        """The planner inputs of a Ray run on ``self.plan``'s cluster (:func:`planner_inputs`); None for the
        reference executor, which prices nothing."""
        if self.cfg.runtime.executor != "ray":
            return None
        return planner_inputs(self.cfg, self.workflow, self.plan.cluster, self.tokenizer)

    def _placement(self) -> DynamicPlacement | None:
        """Dynamic placement (``runtime.placement: dynamic``) of a run starting on ``self.plan``'s cluster, or
        None."""
        if self.cfg.runtime.placement != "dynamic" or self.inputs is None:
            return None
        return DynamicPlacement(self.cfg, self.inputs, worker_spec(self.cfg, self.workflow))

    def _sampler(self) -> DynamicSampler | None:
        """Dynamic sampling's waves across iterations (``algo.dynamic_sampling``), or None."""
        settings = self.cfg.algo.dynamic_sampling
        if not settings.enabled:
            return None
        return DynamicSampler(settings, self.cfg.rollout.prompts_per_iter, self.group_size, self.prompt_batch)

    def plan_at(self, iteration: int) -> ExecutionPlan:
        """The plan in force at ``iteration``: the latest change starting at or before it, else the first."""
        return self.plans[max(k for k in self.plans if k <= iteration)]

    @property
    def group_size(self) -> int:
        return self.cfg.algo.samples_per_prompt

    def make_batch(self, iteration: int) -> Batch:
        """The prompts of ``iteration`` (without dynamic sampling, whose waves draw prompts as they go)."""
        n = self.cfg.rollout.prompts_per_iter
        return self.prompt_batch(iteration * n, n)

    def prompt_batch(self, start: int, n: int) -> Batch:
        """``n`` prompts from data position ``start``; sample ids are global (data position × group + member)."""
        g = self.group_size
        examples = examples_window(self.train_prompts, start, n)
        ids = [(start + i) * g + j for i in range(n) for j in range(g)]
        rows = [ex for ex in examples for _ in range(g)]
        env = self.cfg.rollout.env
        prompts = [
            encode_prompt(self.tokenizer, ex.model_input) if not env.enabled else env_prompt(self.tokenizer, env, ex)
            for ex in examples
        ]
        return Batch(
            ids,
            {
                "prompt_ids": [p for p in prompts for _ in range(g)],
                "prompt_text": [ex.prompt for ex in rows],
                "answer": [ex.answer for ex in rows],
                "row": [ex.row for ex in rows],
            },
        )

    def ahead(self, iteration: int) -> tuple[int, Batch] | None:
        """The batch an asynchronous plan generates during ``iteration`` (``max_staleness`` iterations ahead) with
        its iteration; None for a synchronous plan and near the run's end."""
        later = iteration + self.plan.staleness
        if not self.plan.staleness or later >= self.cfg.loop.iterations:
            return None
        return later, self.make_batch(later)

    def fill_pipeline(self, start: int) -> None:
        """An asynchronous run starting at ``start``: the batches of iterations ``start`` to ``start +
        max_staleness - 1`` that were not generated ahead (all of them at a run's start; none where a checkpoint
        taken mid-run held them; those past a finished run's end when it is extended), generated now with the
        current weights, as at a run's start."""
        for iteration in range(start, min(start + self.plan.staleness, self.cfg.loop.iterations)):
            if iteration not in self.generated_ahead:
                self.executor.generate_ahead(iteration, self.make_batch(iteration), start)

    def resume(self) -> bool:
        """Load the latest checkpoint of run_dir, if any; returns whether one was found."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False
        remove_leftovers(self.run_dir)  # of the saves and prunings the interruption cut short
        state = self.executor.load(path)
        self.state = RunState(iteration=int(state["iteration"]) + 1)
        self.generated_ahead = frozenset(state.get(GENERATED_AHEAD, ()))
        if self.sampler is not None:
            if "sampler" not in state:
                raise ConfigError(
                    f"algo.dynamic_sampling: checkpoint '{path}' was written without dynamic sampling "
                    "and has no sampler state to resume (valid: resume it with "
                    "algo.dynamic_sampling.enabled=false)"
                )
            self.sampler.load_state_dict(state["sampler"])
        return True

    def save(self, iteration: int) -> Path:
        state = {"data_position": (iteration + 1) * self.cfg.rollout.prompts_per_iter}
        if self.sampler is not None:  # the waves drew prompts as they went
            state["data_position"] = self.sampler.cursor
            state["sampler"] = self.sampler.state_dict()
        return self.executor.save(
            self.run_dir,
            iteration,
            state,
            self.cfg.checkpoint.keep_last,
            sharded=self.cfg.checkpoint.format == "sharded",
        )

    def iteration_metrics(self, result: IterationResult, seconds: float) -> dict[str, float]:
        metrics = {
            **mismatch_metrics(result.stats),  # the mismatch sums, added up over ranks and controllers, as figures
            "perf/samples_per_s": self.cfg.rollout.prompts_per_iter * self.group_size / seconds,
            "time/iteration_s": seconds,
            **self.recovery,
        }
        self.recovery = {}
        for trace in result.traces:
            if trace.kind in ("call", "stream_fusion", "pipeline_fusion"):  # every wave's, with dynamic sampling
                key = f"time/{trace.step}_s"
                metrics[key] = metrics.get(key, 0.0) + trace.seconds
        return metrics

    def write_traces(self, traces) -> None:
        """Each executed step's start and end per device, so any run can be drawn like a simulated plan and
        checked against its schedule (`loomrl timeline`)."""
        with open(RunDir(self.run_dir).traces, "a", encoding="utf-8") as f:
            for trace in traces:
                f.write(json.dumps(trace.to_dict(), ensure_ascii=False) + "\n")

    def evaluate(self) -> dict[str, float]:
        return {f"eval/{k}": v for k, v in self.executor.evaluate(self.eval_examples).items()}

    def run(self, resume: bool = False) -> dict[str, float]:
        """Run the remaining iterations, then release the executor; returns the last iteration's metrics. A lost
        worker or controller is recovered from up to ``runtime.max_failures`` times (:meth:`_recover`)."""
        failures = 0
        try:
            while True:
                try:
                    return self._run(resume)
                except LoomError as err:
                    if not err.recoverable or failures >= self.cfg.runtime.max_failures:
                        raise
                    failures += 1
                    self._recover(err, failures)
                    resume = True
        finally:
            self.close()

    def _recover(self, err: LoomError, failures: int) -> None:
        """After a lost process: every worker replaced (the executor closed and made anew, on the run's first
        plan: the loop applies the plan in force where it resumes), the run resumed from its latest checkpoint or
        restarted without one; the failure goes to ``failures.jsonl`` and, with the iterations it replays, to the
        metrics of the next iteration logged."""
        failed_at = self.running
        self.executor.close()
        checkpoint = latest_checkpoint(self.run_dir)
        resumes_after = int(json.loads((checkpoint / "state.json").read_text())["iteration"]) if checkpoint else -1
        record = {
            "failure": failures,
            "iteration": failed_at,
            "resumes_after": resumes_after,
            "replayed_iterations": max(self.completed - resumes_after, 0),
            "error": str(err),
            "time": time.time(),
        }
        with open(RunDir(self.run_dir).failures, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(
            f"loomrl: recovering ({failures} of {self.cfg.runtime.max_failures}) from: {err}; "
            + (f"resuming after iteration {resumes_after}" if checkpoint else "restarting from the start"),
            flush=True,
        )
        self.recovery = {
            "recovery/failures": float(failures),
            "recovery/replayed_iterations": float(record["replayed_iterations"]),
        }
        self.state = RunState()
        if self.placement is not None:  # dynamic placement's switches are forgotten: it decides anew from plans[0]
            self.plans = {0: self.plans[0]}
        cluster = surviving_cluster(self.cfg, self.plans[0].cluster)
        if cluster != self.plans[0].cluster:  # a device or node was lost with the worker: plan for those left
            self.plans = self._plans(cluster, recovering=True)
            self.recovery["recovery/devices"] = float(cluster.n_devices)
            print(
                f"loomrl: {cluster.n_devices} of {self.plan.cluster.n_devices} devices left; continuing on them "
                f"with the plan {format_plan_string(self.plans[0], self.workflow)}",
                flush=True,
            )
        self.plan = self.plans[0]
        if self.inputs is not None and self.inputs.cluster != self.plan.cluster:
            self.inputs = self._inputs()
        self.executor = make_executor(
            self.cfg, self.workflow, self.plan, self.tokenizer, self.task, self.device, self.inputs
        )
        self.placement = self._placement()

    def _run(self, resume: bool) -> dict[str, float]:
        cfg, loop = self.cfg, self.cfg.loop
        resumed = resume and self.resume()
        if not resumed and self.sampler is not None:
            self.sampler = self._sampler()  # a restart from the start draws the first prompts again
        if not resumed and latest_checkpoint(self.run_dir) is not None:
            raise ConfigError(
                f"run_dir: '{self.run_dir}' already holds checkpoints; pass --resume to continue it "
                "or choose another run_dir"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.executor.check_shared_dir(self.run_dir)
        files = RunDir(self.run_dir)
        files.config.write_text(dump_yaml(cfg))
        self.plan.save(files.plan)  # the plan in force, with the cluster it runs on
        traces = files.traces
        if not resumed and traces.exists():  # a restart from iteration 0 keeps the old traces aside
            traces.replace(files.superseded_traces)
        if not resumed:  # the decisions of an earlier start of this run are not this run's
            files.placement.unlink(missing_ok=True)
        last: dict[str, float] = {}
        start = self.state.iteration
        self.fill_pipeline(start)
        backends = open_backends(
            cfg.report.backends, self.run_dir, cfg.report, to_dict(cfg), start - 1 if resumed else None
        )
        with (
            MetricsLogger(self.run_dir, backends, resume_from_iteration=start - 1) as logger,
            RunProgress(loop.iterations, start, enabled=loop.progress, every=loop.progress_every) as progress,
        ):
            for it in range(start, loop.iterations):
                self.running = it
                switch_s = None
                if self.plan_at(it) is not self.plan:  # a change starts here (or a resumed run is past one)
                    self.plan = self.plan_at(it)
                    t0 = time.perf_counter()
                    self.executor.apply_plan(self.plan)
                    switch_s = time.perf_counter() - t0
                    if self.placement is not None:
                        self.placement.switched(switch_s)
                    self.plan.save(files.plan)
                before = self.executor.drain_traces()  # the prologue, or a plan change
                t0 = time.perf_counter()
                if self.sampler is None:
                    result = self.executor.run_iteration(it, self.make_batch(it), ahead=self.ahead(it))
                else:
                    waves = self.sampler.waves()
                    result = self.executor.run_iteration(it, waves.first(), waves)
                last = self.iteration_metrics(result, time.perf_counter() - t0)
                if switch_s is not None:
                    last["time/plan_change_s"] = switch_s
                final = it == loop.iterations - 1
                if final or (loop.eval_every and (it + 1) % loop.eval_every == 0):
                    last.update(self.evaluate())
                self.write_traces(
                    [dataclasses.replace(t, iteration=it) for t in before]
                    + result.traces
                    + [dataclasses.replace(t, iteration=it) for t in self.executor.drain_traces()]
                )
                if self.placement is not None and not final:  # decides the plan of the next iteration
                    new = timed_check(
                        self.placement, it, self.plan, last, result.response_lengths, loop.iterations - it - 1
                    )
                    if new is not None:
                        self.plans[it + 1] = new
                logger.log(it, last)
                self.completed = it
                progress.update(it, last)
                if final or (loop.save_every and (it + 1) % loop.save_every == 0):
                    self.save(it)
                    self.write_reports(running=not final)
        return last

    def write_reports(self, running: bool) -> None:
        """Refresh what a person looks at while the run goes: the reward curves and the HTML run report."""
        plot_reward_curve(self.run_dir)
        if self.cfg.report.html:
            write_run_report(self.run_dir, running, self.cfg.loop.iterations)

    def close(self) -> None:
        self.executor.close()
