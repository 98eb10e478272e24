"""loomrl.planner: what a plan costs, in seconds and bytes per device.

- :class:`HardwareProfile`, :data:`PROFILES`, :func:`profile_for`: datasheet figures of A100-80G, H100-80G,
  H200, H20 and a nominal CPU slot; :func:`calibrate_local` measures the current machine instead;
- :class:`ModelShape`, :class:`Workload`: the models (from HF ``config.json`` fields, mixtures of experts
  included) and one iteration's data (a response-length *distribution*, not one length);
- :class:`EngineSettings` (:mod:`loomrl.planner.settings`): how a system runs the calls beside the plan (a
  serving engine's memory share and slots, FP8, optimizer offload, ...); :class:`RunDescription`
  (:mod:`loomrl.planner.describe`): a whole run as ``loomrl plan`` and the published-runs benchmark describe it;
- :class:`CostModel`: time and memory of each MFC under an allocation, reallocation time from the real
  transfer planner (:mod:`loomrl.planner.cost`, :mod:`loomrl.planner.terms`, :mod:`loomrl.planner.decode`,
  :mod:`loomrl.planner.realloc_cost`);
- :func:`simulate` (:mod:`loomrl.planner.simulator`): list scheduling of a plan over 2–3 unrolled iterations,
  reallocation nodes, memory per device over time; :func:`render_timeline` draws it (PNG, HTML);
- :func:`search`, :func:`best_heuristic_plans` (:mod:`loomrl.planner.search`): Metropolis search over one
  allocation per MFC, always next to each heuristic strategy with its best layouts;
- :class:`Corrections`, :func:`fit_corrections`: per-kind factors fitted by least squares from run traces
  (:mod:`loomrl.planner.traces` turns ``metrics.jsonl`` records into observations).

Imports neither Ray nor torch.distributed; torch only inside :func:`calibrate_local`.
"""

from loomrl.planner.calibrate import calibrate_local
from loomrl.planner.corrections import Corrections, fit_corrections
from loomrl.planner.cost import CostModel
from loomrl.planner.profiles import PROFILES, HardwareProfile, profile_for
from loomrl.planner.search import best_heuristic_plans, candidate_allocations, search
from loomrl.planner.settings import EngineSettings
from loomrl.planner.simulator import CostEstimator, SimResult, simulate
from loomrl.planner.timeline import render_timeline
from loomrl.planner.traces import lengths_from_summary, observations_from_metrics, trace_predictor
from loomrl.planner.workload import ModelShape, Workload

__all__ = [
    "PROFILES",
    "CostEstimator",
    "CostModel",
    "Corrections",
    "EngineSettings",
    "HardwareProfile",
    "ModelShape",
    "SimResult",
    "Workload",
    "best_heuristic_plans",
    "candidate_allocations",
    "calibrate_local",
    "fit_corrections",
    "lengths_from_summary",
    "observations_from_metrics",
    "profile_for",
    "render_timeline",
    "search",
    "simulate",
    "trace_predictor",
]
