"""Turn a results/<experiment>/ folder into a report: figures, tables, report.md and report.html.

    python -m analysis results/<experiment> [results/<other> ...] [--out DIR] [--smooth N] [--formats png,pdf]
                       [--paper] [--baseline NAME] [--latex]

For other tools (a leaderboard over many experiments): ``load_experiment(dir)`` gives the runs (one row each, with
their cell, axis values, ``counted``, ``ended`` and collapse columns), the metrics and the cells
(``load_experiments([dir, ...])``: several folders as one, a run held by two counted once); ``eval_table(runs,
cells.axes)`` the per-(cell, objective) numbers (accuracies with intervals, collapse k/n and rate); and
analysis.paired's ``per_cell``, ``aggregate`` and ``iqm`` the paired comparisons and the IQM across cells.
"""

from analysis.combine import load_experiments
from analysis.load import AnalysisError, AnalysisWarning, load_experiment
from analysis.paired import aggregate, iqm, per_cell
from analysis.report import build_report, eval_table

__all__ = ["AnalysisError", "AnalysisWarning", "aggregate", "build_report", "eval_table", "iqm", "load_experiment",
           "load_experiments", "per_cell"]
