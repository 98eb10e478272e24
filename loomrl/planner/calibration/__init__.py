"""loomrl.planner.calibration: this machine measured as a hardware profile; corrections fitted from finished runs."""
