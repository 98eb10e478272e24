"""loomrl.planner: what a plan costs, and which plan to run.

Sub-packages, each importing only those before it:

- :mod:`loomrl.planner.pipeline_fusion`: the solver of pipeline fusion's task orders (search, bound, CP-SAT);
- :mod:`loomrl.planner.cost`: the cost model (:class:`~loomrl.planner.cost.estimator.CostEstimator`, its
  analytic terms, workloads, system settings, fitted corrections);
- :mod:`loomrl.planner.simulation`: the simulator (list scheduling of a plan's schedule, memory over time);
- :mod:`loomrl.planner.search`: plan search, the heuristic baselines and the lower bound;
- :mod:`loomrl.planner.calibration`: measuring this machine and fitting corrections from finished runs;
- :mod:`loomrl.planner.replanning`: re-planning a run in progress (dynamic placement) and its switch rule.

Then :mod:`loomrl.planner.inputs` (what the planner is given, built once) and the run descriptions and plan
comparisons of ``loomrl plan``. Imports neither Ray nor torch.distributed.
"""
