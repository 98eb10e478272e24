"""`loomrl calibrate`: measure this machine, and fit the cost model's corrections from finished runs.

A run directory holds everything needed to price its own calls again: ``config.yaml`` (the workflow, the
plan, the models), ``metrics.jsonl`` (per-iteration call times and length statistics). Observations from
several runs are fitted together (:func:`loomrl.planner.corrections.fit_corrections`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from loomrl.algorithms.workflows import build_workflow
from loomrl.config import TrainConfig
from loomrl.configtools import load_config
from loomrl.errors import DataError
from loomrl.plan import ClusterSpec
from loomrl.planner.corrections import Corrections, fit_corrections
from loomrl.planner.profiles import HardwareProfile
from loomrl.planner.traces import observations_from_metrics, trace_predictor
from loomrl.planner.workload import ModelShape
from loomrl.report import read_metrics


def _model_config(spec: str, tokenizer):
    from transformers import AutoConfig

    from loomrl.models.zoo import ZOO, zoo_config

    return zoo_config(spec, tokenizer) if spec in ZOO else AutoConfig.from_pretrained(spec)


def run_observations(run_dir: str | Path, profile: HardwareProfile) -> tuple[list[dict], object]:
    """The observations of one run and a predictor pricing them on its cluster (``profile`` per device)."""
    from loomrl.runtime.placement import execution_plan
    from loomrl.train.common import tokenizer_for

    run = Path(run_dir)
    if not (run / "config.yaml").is_file() or not (run / "metrics.jsonl").is_file():
        raise DataError(f"{run}: not a run directory (config.yaml and metrics.jsonl are needed)")
    cfg = load_config(TrainConfig, run / "config.yaml")
    workflow = build_workflow(cfg.algo, cfg.rollout)
    from loomrl.launch import available_devices

    devices = 1 if cfg.runtime.executor == "reference" else (cfg.runtime.devices or available_devices())
    cluster = ClusterSpec(nodes=1, devices_per_node=devices, device_kind="cpu", profile="local")
    if cfg.runtime.executor == "reference":
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, executor="ray", plan=None))
    plan = execution_plan(cfg, workflow, cluster)
    tokenizer = tokenizer_for(cfg.actor.model)
    specs = {"actor": cfg.actor.model, "ref": cfg.actor.model, "critic": cfg.critic.model or cfg.actor.model,
             "reward": cfg.reward.model or cfg.actor.model}
    shapes = {role: ModelShape.from_config(_model_config(specs[role], tokenizer)) for role in workflow.roles()}
    records = read_metrics(run / "metrics.jsonl")
    group = cfg.algo.group_size if cfg.algo.name in ("grpo", "rloo") else 1
    prompt_len = sum(r.get("prompt/length", 0.0) for r in records) / max(len(records), 1)
    observations = observations_from_metrics(records, plan, workflow, cfg.rollout.prompts_per_iter * group, prompt_len)
    return observations, trace_predictor(cluster, profile, shapes)


def fit_from_runs(run_dirs: Sequence[str | Path], profile: HardwareProfile) -> Corrections:
    """Corrections fitted over every call of every iteration (but each run's first) of the given runs."""
    observations = []
    for run_dir in run_dirs:
        found, predict = run_observations(run_dir, profile)
        observations += [{**o, "predicted_s": predict(o)} for o in found]
    if not observations:
        raise DataError(f"{', '.join(map(str, run_dirs))}: no timed calls to fit (runs need 2+ iterations)")
    return fit_corrections(observations)
