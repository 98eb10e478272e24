"""loomrl.planner.search: plan search, the placement strategies' best layouts, and a lower bound on every plan."""
