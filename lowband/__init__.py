"""lowband: training across nodes joined by slow links."""

__version__ = "0.1.0"
