"""Pure helpers used by the benchmark scripts (the scripts themselves are run by hand)."""

from __future__ import annotations

import pytest
from benchmarks.osft_continual import frontier, interpolate


def test_interpolate_matched_accuracy():
    # full-FT sweep as (B accuracy, A accuracy); unsorted on purpose
    sweep = [(0.5, 0.6), (0.1, 0.9), (0.9, 0.0)]
    assert interpolate(sweep, 0.3) == pytest.approx(0.75)  # halfway between 0.9 and 0.6
    assert interpolate(sweep, 0.7) == pytest.approx(0.3)
    assert interpolate(sweep, 0.1) == pytest.approx(0.9)  # an end point
    assert interpolate(sweep, 0.95) is None  # outside the sweep: no extrapolation
    assert interpolate(sweep, 0.05) == pytest.approx(0.9)  # the 0.1 run also reached 0.05


def test_frontier_keeps_the_best_retention_at_each_accuracy():
    # (0.5, 0.2) is dominated by (1.0, 0.6): higher B accuracy and more A kept
    points = [(1.0, 0.0), (1.0, 0.6), (0.5, 0.2), (0.2, 0.9)]
    assert frontier(points) == [(0.2, 0.9), (1.0, 0.6)]
    assert interpolate(points, 1.0) == pytest.approx(0.6)
    assert interpolate(points, 0.6) == pytest.approx(0.75)
