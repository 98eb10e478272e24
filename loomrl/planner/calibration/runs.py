"""`loomrl calibrate --from`: fit the cost model's corrections from finished runs, and predict runs again.

A run directory holds everything needed to price its own calls again: ``config.yaml`` (the workflow, the
plan, the models), ``metrics.jsonl`` (per-iteration call times and length statistics). Observations from
several runs are fitted together (:func:`loomrl.planner.cost.corrections.fit_corrections`); :func:`simulate_run`
predicts a run's iteration time with the simulator, which is how the estimator's accuracy is measured
(``benchmarks/estimator_accuracy.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError, DataError
from loomrl.plan import ClusterSpec, ExecutionPlan
from loomrl.plan.from_config import plan_from_config
from loomrl.planner.cost.corrections import ITERATION, Corrections, fit_corrections, fit_line
from loomrl.planner.cost.model import PRECISION_BYTES, CostModel
from loomrl.planner.cost.system import RUNTIME
from loomrl.planner.planning import model_config
from loomrl.plan.hardware import HardwareProfile
from loomrl.planner.simulation.simulator import SimResult, simulate
from loomrl.planner.calibration.traces import lengths_from_summary, observations_from_metrics, trace_predictor
from loomrl.planner.cost.workload import ModelShape, Workload
from loomrl.report import read_metrics
from loomrl.workflow import Workflow

__all__ = ["Run", "fit_from_runs", "fit_observations", "load_run", "run_observations", "sharing_profile",
           "simulate_run"]


@dataclass
class Run:
    """A finished run as the planner sees it."""

    path: Path
    cfg: TrainConfig
    workflow: Workflow
    cluster: ClusterSpec
    plan: ExecutionPlan
    shapes: dict[str, ModelShape]
    records: list[dict]
    batch: int
    """Samples per iteration."""
    prompt_len: float
    """Mean prompt tokens over the run."""

    def profile(self, profile: HardwareProfile, cores: int | None) -> HardwareProfile:
        """``profile`` with the run's devices sharing ``cores`` cores (on CPU, when known)."""
        return sharing_profile(profile, self.cluster, cores)

    def steady_records(self) -> list[dict]:
        """Every iteration but the first (one-off costs: allocation, warm-up)."""
        return self.records[1:] if len(self.records) > 1 else self.records

    def measured_iteration_s(self) -> float:
        """Median seconds per iteration after the first."""
        return statistics.median(r["time/iteration_s"] for r in self.steady_records())

    @property
    def bytes_per_param(self) -> int | None:
        """The run's weight size (None: ``precision: auto``, the cost model's default on its profile)."""
        return PRECISION_BYTES.get(self.cfg.runtime.precision)

    def workload(self) -> Workload:
        """The run's iteration shape: its batch, mean prompt length and response lengths (mean statistics)."""
        recs = self.steady_records()
        mean = statistics.fmean(r["response/length"] for r in recs)
        p90 = statistics.fmean(r["response/length_p90"] for r in recs)
        longest = max(r["response/length_max"] for r in recs)
        algo = self.cfg.algo
        return Workload(self.batch, self.prompt_len, lengths_from_summary(mean, p90, longest),
                        ppo_epochs=algo.ppo_epochs, minibatches=algo.minibatches,
                        samples_per_prompt=algo.samples_per_prompt)


def _recorded_devices(run: Path) -> int | None:
    """The devices the run's plan was made for (the trainer writes plan.json; a run on a Ray cluster counted
    them there, not on this machine), or None for a run from before plan.json."""
    path = run / "plan.json"
    if not path.is_file():
        return None
    cluster = json.loads(path.read_text(encoding="utf-8")).get("cluster", {})
    return int(cluster.get("nodes", 1)) * int(cluster.get("devices_per_node", 0)) or None


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory: its config, the plan it ran, its models' shapes and its metrics."""
    from loomrl.role.devices import available_devices
    from loomrl.models.tokenizer import task_tokenizer

    run = Path(run_dir)
    if not (run / "config.yaml").is_file() or not (run / "metrics.jsonl").is_file():
        raise DataError(f"{run}: not a run directory (config.yaml and metrics.jsonl are needed)")
    cfg = load_config(TrainConfig, run / "config.yaml")
    workflow = build_workflow(cfg.algo, cfg.rollout, cfg.reward)
    devices = 1 if cfg.runtime.executor == "reference" else (cfg.runtime.devices or _recorded_devices(run)
                                                             or available_devices())
    cluster = ClusterSpec(nodes=1, devices_per_node=devices, device_kind="cpu", profile="local")
    runtime = cfg.runtime if cfg.runtime.executor != "reference" else dataclasses.replace(cfg.runtime, plan=None)
    plan = plan_from_config(runtime, workflow, cluster)
    tokenizer = task_tokenizer(cfg.task, cfg.actor.model)
    specs = {"actor": cfg.actor.model, "ref": cfg.actor.model, "critic": cfg.critic.model or cfg.actor.model,
             "reward": cfg.reward.model or cfg.actor.model}
    try:
        shapes = {role: ModelShape.from_config(model_config(specs[role], tokenizer)) for role in workflow.roles()}
    except ConfigError as err:  # e.g. a checkpoint the run used that is gone since
        raise DataError(f"{run / 'config.yaml'}: {err}") from None
    records = read_metrics(run / "metrics.jsonl")
    if not records:
        raise DataError(f"{run / 'metrics.jsonl'}: no iterations recorded")
    prompt_len = statistics.fmean(r.get("prompt/length", 0.0) for r in records)
    batch = cfg.rollout.prompts_per_iter * cfg.algo.samples_per_prompt
    return Run(run, cfg, workflow, cluster, plan, shapes, records, batch, prompt_len)


def run_observations(run_dir: str | Path, profile: HardwareProfile,
                     cores: int | None = None) -> tuple[list[dict], object]:
    """The observations of one run and a predictor pricing them on its cluster (``profile`` per device)."""
    return _observations(load_run(run_dir), profile, cores)


def _observations(run: Run, profile: HardwareProfile, cores: int | None) -> tuple[list[dict], object]:
    observations = observations_from_metrics(run.records, run.plan, run.workflow, run.batch, run.prompt_len,
                                             samples_per_prompt=run.cfg.algo.samples_per_prompt)
    return observations, trace_predictor(run.cluster, run.profile(profile, cores), run.shapes,
                                         bytes_per_param=run.bytes_per_param, settings=RUNTIME)


def simulate_run(run: Run, profile: HardwareProfile, corrections: Corrections | None = None,
                 cores: int | None = None, iterations: int = 3) -> SimResult:
    """The simulator's prediction of ``run`` (its plan, models and workload) with ``corrections``."""
    prof = run.profile(profile, cores)
    cost = CostModel(run.cluster, prof, run.shapes, run.workload(), corrections, bytes_per_param=run.bytes_per_param,
                     settings=RUNTIME)
    return simulate(run.plan, run.workflow, cost, prof.memory_bytes, iterations=iterations)


def fit_from_runs(run_dirs: Sequence[str | Path], profile: HardwareProfile, cores: int | None = None) -> Corrections:
    """Corrections fitted over every call of every iteration (but each run's first) of the given runs, then
    the per-iteration time no call accounts for (the controller's serial work between and around calls,
    fitted on the simulated iteration times of the same runs)."""
    runs = [load_run(d) for d in run_dirs]
    observations = []
    for run in runs:
        found, predict = _observations(run, profile, cores)
        observations += [{**o, "predicted_terms": predict(o)} for o in found]
    if not observations:
        raise DataError(f"{', '.join(map(str, run_dirs))}: no timed calls to fit (runs need 2+ iterations)")
    return fit_observations(observations, lambda calls: [simulate_run(r, profile, calls, cores).iteration_time
                                                         for r in runs], [r.measured_iteration_s() for r in runs])


def fit_observations(observations: Sequence[dict], simulated: Callable[[Corrections], list[float]],
                     measured: Sequence[float]) -> Corrections:
    """Corrections fitted over ``observations`` (each with its ``predicted_terms``), then the whole-iteration
    line from the iteration times ``simulated`` predicts with those call corrections to the ``measured`` ones
    (the same iterations, in order)."""
    calls = fit_corrections(observations)
    scale, overhead = fit_line(simulated(calls), list(measured))
    return dataclasses.replace(calls, scale={**calls.scale, ITERATION: scale},
                               overhead_s={**calls.overhead_s, ITERATION: overhead},
                               observations={**calls.observations, ITERATION: len(measured)})


def sharing_profile(profile: HardwareProfile, cluster: ClusterSpec, cores: int | None) -> HardwareProfile:
    """``profile`` with ``cluster``'s devices sharing ``cores`` cores: a CPU machine (the ``local`` profile)
    running more worker processes than it has cores; unchanged when ``cores`` is unknown or for accelerators."""
    if cores is None or profile.name != "local":
        return profile
    return dataclasses.replace(profile, devices_share_cores=max(1, math.ceil(cluster.n_devices / cores)))
