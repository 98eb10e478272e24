"""Intra-stage fusion (RLHFuse): one schedule for an actor and a critic that both train with pipeline parallelism
on the same devices, the actor's stages left to right and the critic's right to left, so that one model's
micro-batches fill the other's pipeline bubbles.

- :mod:`~loomrl.plan.pipeline_fusion`: the problem (:class:`PipelineFusionProblem`, :class:`PipelineSpec`), its
  tasks and a schedule (each device's tasks in order);
- :mod:`~loomrl.planner.pipeline_fusion.simulate`: as-soon-as-possible timing (:func:`simulate`) and the rules an
  executor relies on (:func:`check`, :class:`TaskOrderError`);
- :mod:`~loomrl.planner.pipeline_fusion.bound`: a lower bound on every valid schedule's makespan;
- :mod:`~loomrl.planner.pipeline_fusion.priorities`, :mod:`~loomrl.planner.pipeline_fusion.search`: list scheduling and
the
  search (:func:`separate_order`, :func:`merged_order`, :func:`fused_order`);
- :mod:`~loomrl.planner.pipeline_fusion.polish`: local improvement of a schedule (tabu search on critical tasks);
- :mod:`~loomrl.planner.pipeline_fusion.exact`: CP-SAT, when OR-Tools is installed: proofs that raise the bound, and
  schedules at it.

Pure Python: the plan layer knows nothing of torch.distributed or Ray.
"""
