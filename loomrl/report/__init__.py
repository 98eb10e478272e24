"""Run reporting: the metrics record of a run (JSONL + TensorBoard), its plots, and summary tables."""

from loomrl.report.metrics import MetricsLogger, read_metrics, supersede_after
from loomrl.report.plots import plot_metrics, plot_reward_curve, summary_table

__all__ = ["MetricsLogger", "plot_metrics", "plot_reward_curve", "read_metrics", "summary_table", "supersede_after"]
