"""Pure helpers used by the benchmark scripts (the scripts themselves are run by hand)."""

from __future__ import annotations

import pytest
from benchmarks.osft_continual import ALL_LETTERS, B_LETTERS, frontier, interpolate, task_rows


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


def _words(rows):
    return [r["prompt"].split(" ", 1)[1].rstrip("=") for r in rows]


@pytest.mark.parametrize("tasks", ["unseen-letters", "known-letters", "shared-letters"])
def test_task_rows_letters_and_answers(tasks):
    a_train, a_tests, b_train, b_test = task_rows(tasks, seed=1)
    b_letters = set(ALL_LETTERS if tasks == "shared-letters" else B_LETTERS)
    assert {c for w in _words(b_train + b_test) for c in w} == b_letters
    assert all(r["answer"] == w[0] for r, w in zip(b_test, _words(b_test)))
    # task A sees task B's letters except in the unseen-letters design
    a_letters = {c for w in _words(a_train) for c in w}
    assert b_letters <= a_letters or tasks == "unseen-letters"
    assert not (a_letters & set(B_LETTERS)) or tasks != "unseen-letters"
    for r, w in zip(a_train, _words(a_train)):
        expected = w if r["prompt"].startswith("copy") else w[::-1]
        assert r["answer"] == r["response"] == expected
    expected_tests = {
        "unseen-letters": ["reverse a-l"],
        "known-letters": ["copy m-x", "reverse a-l"],
        "shared-letters": ["copy a-x", "reverse a-x"],
    }[tasks]
    assert sorted(a_tests) == expected_tests
    # held-out tests are not the training rows
    train_prompts = {r["prompt"] for r in a_train}
    for rows in a_tests.values():
        assert sum(r["prompt"] in train_prompts for r in rows) < len(rows) // 2
