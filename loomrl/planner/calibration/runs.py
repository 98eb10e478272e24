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
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError, DataError
from loomrl.plan import ClusterSpec, ExecutionPlan
from loomrl.plan.from_config import plan_from_config
from loomrl.plan.hardware import HardwareProfile
from loomrl.planner.calibration.traces import observations_from_metrics, trace_predictor
from loomrl.planner.cost.corrections import ITERATION, Corrections, fit_corrections, fit_line
from loomrl.planner.cost.workload import lengths_from_summary
from loomrl.planner.inputs import PlannerInputs, inputs_from_config
from loomrl.planner.simulation.simulator import SimResult, simulate
from loomrl.run_dir import RunDir

__all__ = ["FinishedRun", "fit_from_runs", "fit_observations", "load_run", "simulate_run"]


@dataclass
class FinishedRun:
    """A finished run as the planner sees it."""

    path: Path
    cfg: TrainConfig
    inputs: PlannerInputs
    """Its planner inputs on its devices, with the workload it measured (:meth:`measured_workload`)."""
    plan: ExecutionPlan
    records: list[dict]

    def steady_records(self) -> list[dict]:
        """Every iteration but the first (one-off costs: allocation, warm-up)."""
        return self.records[1:] if len(self.records) > 1 else self.records

    def measured_iteration_s(self) -> float:
        """Median seconds per iteration after the first."""
        return statistics.median(r["time/iteration_s"] for r in self.steady_records())


def _recorded_devices(run: Path) -> int | None:
    """The devices the run's plan was made for (the trainer writes plan.json; a run on a Ray cluster counted
    them there, not on this machine), or None for a run from before plan.json."""
    path = RunDir(run).plan
    if not path.is_file():
        return None
    cluster = json.loads(path.read_text(encoding="utf-8")).get("cluster", {})
    return int(cluster.get("nodes", 1)) * int(cluster.get("devices_per_node", 0)) or None


def load_run(run_dir: str | Path, profile: HardwareProfile, cores: int | None = None) -> FinishedRun:
    """Read a run directory: its config, the plan it ran, its models and its metrics, priced with ``profile``
    per device (its devices sharing ``cores`` cores where given: the run ran on this machine)."""
    from loomrl.role.devices import available_devices

    files = RunDir(run_dir)
    run = files.path
    if not files.is_run():
        raise DataError(f"{run}: not a run directory ({files.config.name} and {files.metrics.name} are needed)")
    cfg = load_config(TrainConfig, files.config)
    records = files.read_metrics()
    if not records:
        raise DataError(f"{files.metrics}: no iterations recorded")
    workflow = build_workflow(cfg.algo, cfg.rollout, cfg.reward, cfg.reference_role)
    devices = (
        1
        if cfg.runtime.executor == "reference"
        else (cfg.runtime.devices or _recorded_devices(run) or available_devices())
    )
    cluster = ClusterSpec(nodes=1, devices_per_node=devices, device_kind="cpu", profile="local")
    runtime = cfg.runtime if cfg.runtime.executor != "reference" else dataclasses.replace(cfg.runtime, plan=None)
    plan = plan_from_config(runtime, workflow, cluster)
    steady = records[1:] if len(records) > 1 else records
    lengths = lengths_from_summary(
        statistics.fmean(r["response/length"] for r in steady),
        statistics.fmean(r["response/length_p90"] for r in steady),
        max(r["response/length_max"] for r in steady),
    )
    prompt_len = statistics.fmean(r.get("prompt/length", 0.0) for r in records)
    try:  # priced uncorrected: what the run measured is what corrections are fitted to
        inputs = inputs_from_config(
            cfg,
            cluster,
            workflow=workflow,
            profile=profile,
            cores=cores,
            lengths=lengths,
            prompt_len=prompt_len,
            corrections=Corrections(),
        )
    except ConfigError as err:  # e.g. a checkpoint the run used that is gone since
        raise DataError(f"{files.config}: {err}") from None
    return FinishedRun(run, cfg, inputs, plan, records)


def _observations(run: FinishedRun) -> tuple[list[dict], Callable]:
    """The observations of one run and a predictor pricing them on its cluster, uncorrected."""
    inputs = run.inputs
    observations = observations_from_metrics(
        run.records,
        run.plan,
        inputs.workflow,
        inputs.workload.batch,
        inputs.workload.prompt_len,
        samples_per_prompt=inputs.workload.samples_per_prompt,
    )
    return observations, trace_predictor(
        inputs.cluster, inputs.profile, inputs.shapes, bytes_per_param=inputs.bytes_per_param, settings=inputs.settings
    )


def simulate_run(run: FinishedRun, corrections: Corrections | None = None, iterations: int = 3) -> SimResult:
    """The simulator's prediction of ``run`` (its plan, models and measured workload) with ``corrections``."""
    inputs = run.inputs
    return simulate(
        run.plan,
        inputs.workflow,
        inputs.cost_model(corrections=corrections),
        inputs.memory_per_device,
        iterations=iterations,
    )


def fit_from_runs(run_dirs: Sequence[str | Path], profile: HardwareProfile, cores: int | None = None) -> Corrections:
    """Corrections fitted over every call of every iteration (but each run's first) of the given runs, then
    the per-iteration time no call accounts for (the controller's serial work between and around calls,
    fitted on the simulated iteration times of the same runs)."""
    runs = [load_run(d, profile, cores) for d in run_dirs]
    observations = []
    for run in runs:
        found, predict = _observations(run)
        observations += [{**o, "predicted_terms": predict(o)} for o in found]
    if not observations:
        raise DataError(f"{', '.join(map(str, run_dirs))}: no timed calls to fit (runs need 2+ iterations)")
    return fit_observations(
        observations,
        lambda calls: [simulate_run(r, calls).iteration_time for r in runs],
        [r.measured_iteration_s() for r in runs],
    )


def fit_observations(
    observations: Sequence[dict], simulated: Callable[[Corrections], list[float]], measured: Sequence[float]
) -> Corrections:
    """Corrections fitted over ``observations`` (each with its ``predicted_terms``), then the whole-iteration
    line from the iteration times ``simulated`` predicts with those call corrections to the ``measured`` ones
    (the same iterations, in order)."""
    calls = fit_corrections(observations)
    scale, overhead = fit_line(simulated(calls), list(measured))
    return dataclasses.replace(
        calls,
        scale={**calls.scale, ITERATION: scale},
        overhead_s={**calls.overhead_s, ITERATION: overhead},
        observations={**calls.observations, ITERATION: len(measured)},
    )
