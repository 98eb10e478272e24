"""loomrl.planner.replanning: re-planning a run in progress (dynamic placement) and the rule that decides a switch."""
