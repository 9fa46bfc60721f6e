"""``results.json`` -> report.md, console tables and plots: reads what the bench recorded, runs nothing.

Names are imported when first used: the plots need matplotlib.
"""

from __future__ import annotations

from lowband.util import lazy_exports

_EXPORTS: dict[str, str] = {
    "REPORT_FILE": "lowband.report.render",
    "column_labels": "lowband.report.render",
    "console_summary": "lowband.report.render",
    "error_headline": "lowband.report.render",
    "render_markdown": "lowband.report.render",
    "run_rows": "lowband.report.render",
    "table1": "lowband.report.render",
    "table2": "lowband.report.render",
    "write_report": "lowband.report.render",
    "MISSING": "lowband.report.tables",
    "markdown_table": "lowband.report.tables",
    "mean_range": "lowband.report.tables",
    "number_cell": "lowband.report.tables",
    "text_table": "lowband.report.tables",
    "MODELLED_COMPUTE_S": "lowband.report.quality",
    "frontier_rows": "lowband.report.quality",
    "frontier_section": "lowband.report.quality",
    "hiding_rows": "lowband.report.quality",
    "hiding_section": "lowband.report.quality",
    "modelled_rows": "lowband.report.quality",
    "quality_section": "lowband.report.quality",
    "time_to_target_rows": "lowband.report.quality",
    "why_not_reached_notes": "lowband.report.quality",
    "FAULT_PLOT_FILE": "lowband.report.faults",
    "fault_plot": "lowband.report.faults",
    "ft_section": "lowband.report.faults",
    "NO_WINNER": "lowband.report.recommend",
    "Recommendation": "lowband.report.recommend",
    "recommend": "lowband.report.recommend",
    "recommendation_lines": "lowband.report.recommend",
    "recommendation_section": "lowband.report.recommend",
    "FRONTIER_PLOT_FILE": "lowband.report.plots",
    "PLOT_FILES": "lowband.report.plots",
    "has_frontier": "lowband.report.plots",
    "write_plots": "lowband.report.plots",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
