"""Intra-stage fusion (RLHFuse): one schedule for an actor and a critic that both train with pipeline parallelism
on the same devices, the actor's stages left to right and the critic's right to left, so that one model's
micro-batches fill the other's pipeline bubbles.

- :mod:`~loomrl.plan.fused_pipeline.problem`: the problem (:class:`FusionProblem`, :class:`PipelineSpec`), its
  tasks and a schedule (each device's tasks in order);
- :mod:`~loomrl.plan.fused_pipeline.simulate`: as-soon-as-possible timing (:func:`simulate`) and the rules an
  executor relies on (:func:`check`, :class:`ScheduleError`);
- :mod:`~loomrl.plan.fused_pipeline.bound`: a lower bound on every valid schedule's makespan;
- :mod:`~loomrl.plan.fused_pipeline.decode`, :mod:`~loomrl.plan.fused_pipeline.search`: list scheduling and the
  search (:func:`separate_schedule`, :func:`merged_schedule`, :func:`fused_schedule`);
- :mod:`~loomrl.plan.fused_pipeline.polish`: local improvement of a schedule (tabu search on critical tasks);
- :mod:`~loomrl.plan.fused_pipeline.exact`: CP-SAT, when OR-Tools is installed: proofs that raise the bound, and
  schedules at it.

Pure Python: the plan layer knows nothing of torch.distributed or Ray.
"""

from loomrl.plan.fused_pipeline.bound import lower_bound
from loomrl.plan.fused_pipeline.problem import ACTOR, CRITIC, FusionProblem, PipelineSpec, Schedule, Task
from loomrl.plan.fused_pipeline.search import FusionResult, fused_schedule, merged_schedule, separate_schedule
from loomrl.plan.fused_pipeline.simulate import ScheduleError, Timing, check, simulate

__all__ = [
    "ACTOR",
    "CRITIC",
    "FusionProblem",
    "FusionResult",
    "PipelineSpec",
    "Schedule",
    "ScheduleError",
    "Task",
    "Timing",
    "check",
    "fused_schedule",
    "lower_bound",
    "merged_schedule",
    "separate_schedule",
    "simulate",
]
