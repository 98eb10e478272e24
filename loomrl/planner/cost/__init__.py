"""loomrl.planner.cost: seconds and bytes per device of every step of a schedule under a plan."""
