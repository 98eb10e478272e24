"""Run reporting: the metrics record of a run (JSONL, copied to the logging backends of
:mod:`loomrl.report.backends`), its plots and summary tables. The HTML run report (:mod:`loomrl.report.html`)
is imported on its own: it draws timelines with the planner. The metrics file's names and format are the run
directory's (:mod:`loomrl.run_dir`)."""

from loomrl.report.metrics import MetricsLogger, supersede_after
from loomrl.report.plots import plot_metrics, plot_reward_curve, summary_table
from loomrl.run_dir import read_metrics

__all__ = ["MetricsLogger", "plot_metrics", "plot_reward_curve", "read_metrics", "summary_table", "supersede_after"]
