"""loomrl.planner.simulation: a plan's schedule list-scheduled over a few iterations, memory tracked over time."""
