"""Run traces for fitting corrections: from ``metrics.jsonl`` records to observations, and their predictions.

An observation is one MFC call of one iteration, as a plain dict (JSON-ready)::

    {"mfc": "actor_train", "kind": "train", "role": "actor", "allocation": "0-7:dp4tp2mb4",
     "batch": 512, "prompt_len": 256.0, "response_mean": 240.5, "response_p90": 410.0,
     "response_max": 512, "epochs": 1, "minibatches": 4, "seconds": 12.3}

The runtime logs ``time/<mfc>_s`` and the response-length statistics ``response/length``,
``response/length_p90``, ``response/length_max`` per iteration (:mod:`loomrl.algorithms.metrics`);
:func:`observations_from_metrics` joins them with the plan and the workflow that produced them. The first
iteration of a run pays one-off costs (allocation, kernels' warm-up); pass ``skip_first`` to drop it.

:func:`trace_predictor` prices an observation with an uncorrected :class:`~loomrl.planner.cost.model.CostModel`, its
response-length distribution rebuilt from the three statistics by :func:`lengths_from_summary`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from loomrl.plan import Allocation, ClusterSpec, ExecutionPlan
from loomrl.plan.hardware import HardwareProfile
from loomrl.plan.model_shape import ModelShape
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.workload import Workload, lengths_from_summary
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = ["observations_from_metrics", "trace_predictor"]


def observations_from_metrics(
    records: Iterable[Mapping],
    plan: ExecutionPlan,
    workflow: Workflow,
    batch: int,
    prompt_len: float,
    skip_first: bool = True,
    samples_per_prompt: int = 1,
) -> list[dict]:
    """One observation per MFC per metrics record (an iteration) that logged its ``time/<mfc>_s``."""
    out = []
    for index, record in enumerate(records):
        if skip_first and index == 0:
            continue
        for mfc in workflow.topological_order():
            seconds = record.get(f"time/{mfc.name}_s")
            if seconds is None:
                continue
            out.append(
                {
                    "mfc": mfc.name,
                    "kind": mfc.kind.value,
                    "role": mfc.role,
                    "allocation": plan[mfc.name].text,
                    "batch": batch,
                    "prompt_len": float(prompt_len),
                    "samples_per_prompt": samples_per_prompt,
                    "response_mean": float(record["response/length"]),
                    "response_p90": float(record["response/length_p90"]),
                    "response_max": float(record["response/length_max"]),
                    "epochs": mfc.epochs,
                    "minibatches": mfc.minibatches,
                    "seconds": float(seconds),
                }
            )
    return out


def trace_predictor(
    cluster: ClusterSpec, profile: HardwareProfile, shapes: Mapping[str, ModelShape | None], **cost_kwargs
) -> Callable[[Mapping], dict[str, float]]:
    """A function pricing an observation's call with an uncorrected cost model: its terms by name (for
    :func:`fit_corrections`)."""

    def predict(obs: Mapping) -> dict[str, float]:
        lengths = lengths_from_summary(obs["response_mean"], obs["response_p90"], obs["response_max"])
        workload = Workload(
            int(obs["batch"]),
            float(obs["prompt_len"]),
            lengths,
            samples_per_prompt=int(obs.get("samples_per_prompt", 1)),
        )
        model = CostModel(cluster, profile, shapes, workload, **cost_kwargs)
        kind = MFCKind(obs["kind"])
        mfc = MFC(
            obs["mfc"],
            obs.get("role") if kind is not MFCKind.COMPUTE else None,
            kind,
            (),
            () if kind is MFCKind.TRAIN else ("out",),
            epochs=int(obs.get("epochs", 1)),
            minibatches=int(obs.get("minibatches", 1)),
        )
        return model.time_terms(mfc, Allocation.parse(obs["allocation"]))

    return predict
