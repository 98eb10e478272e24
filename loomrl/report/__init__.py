"""Run reporting: the metrics record of a run (JSONL, copied to the logging backends of
:mod:`loomrl.report.backends`), its plots and summary tables. The HTML run report (:mod:`loomrl.report.html`)
is imported on its own: it draws timelines with the planner, which itself reads metrics from here."""

from loomrl.report.metrics import MetricsLogger, read_metrics, supersede_after
from loomrl.report.plots import plot_metrics, plot_reward_curve, summary_table

__all__ = ["MetricsLogger", "plot_metrics", "plot_reward_curve", "read_metrics", "summary_table", "supersede_after"]
