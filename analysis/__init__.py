"""Turn a results/<experiment>/ folder into a report: figures, tables, report.md and report.html.

    python -m analysis results/<experiment> [results/<other> ...] [--out DIR] [--smooth N] [--formats png,pdf]
                       [--paper] [--baseline NAME] [--latex]

For other tools (a leaderboard over many experiments): ``load_experiment(dir)`` gives the runs (one row each, with
their cell, axis values, ``counted``, ``ended`` and collapse columns), the metrics and the cells
(``load_experiments([dir, ...])``: several folders as one, a run held by two counted once); ``eval_table(runs,
cells.axes)`` the per-(cell, objective) numbers (accuracies with intervals, collapse k/n and rate); and
analysis.paired's ``per_cell``, ``aggregate`` and ``iqm`` the paired comparisons and the IQM across cells.
"""

import importlib

# what the package offers, by the module that defines it: imported when first used (PEP 562), so that importing the
# package (`python -m analysis` does, before its __main__) does not import the objectives the report names
EXPORTS = {"load_experiments": "analysis.combine", "AnalysisError": "analysis.load",
           "AnalysisWarning": "analysis.load", "load_experiment": "analysis.load", "aggregate": "analysis.paired",
           "iqm": "analysis.paired", "per_cell": "analysis.paired", "build_report": "analysis.report",
           "eval_table": "analysis.report"}
__all__ = sorted(EXPORTS)


def __getattr__(name: str):
    if name in EXPORTS:
        return getattr(importlib.import_module(EXPORTS[name]), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
