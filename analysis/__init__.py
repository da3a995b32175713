"""Turn a results/<experiment>/ folder into a report: figures, tables, report.md and report.html.

    python -m analysis results/<experiment> [--out DIR] [--smooth N] [--formats png,pdf] [--paper]
"""

from analysis.load import AnalysisError, AnalysisWarning, load_experiment
from analysis.report import build_report

__all__ = ["AnalysisError", "AnalysisWarning", "build_report", "load_experiment"]
