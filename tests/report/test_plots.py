"""lowband/report/plots.py: the loss plots' zoomed axis."""

from __future__ import annotations

import pytest


def test_loss_plots_leave_curves_that_end_far_above_the_others_off_the_zoomed_axis() -> None:
    from matplotlib.figure import Figure

    from lowband.report.plots import _outliers, _zoom

    assert _outliers([6.75, 6.85, 6.90, 6.78, 6.97, 6.94, 7.69, 7.99]) == {6, 7}
    assert _outliers([6.8, 6.9, 7.0]) == set()  # too few curves to call one an outlier
    curve = [(float(i), 9.0 - i * 0.3, 9.0 - i * 0.3, 9.0 - i * 0.3) for i in range(10)]
    far = [(x, m + 1.5, lo + 1.5, hi + 1.5) for x, m, lo, hi in curve]
    ax = Figure().add_subplot()
    zoomed, high = _zoom(ax, [curve, curve, curve, far], target=6.5)
    assert zoomed and high == {3}
    bottom, top = ax.get_ylim()
    assert top < far[2][3] and top == pytest.approx(curve[2][3] + 0.05 * (curve[2][3] - 6.3))
    assert bottom == pytest.approx(6.3 - 0.05 * (curve[2][3] - 6.3))
