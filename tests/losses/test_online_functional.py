"""Online RL math vs naive Python references (loops and ``math``), incl. autograd on clipping."""

from __future__ import annotations

import math
import random

import pytest
import torch

from grimoire.losses.online_functional import (
    LOSS_TYPES,
    best_of_n,
    best_worst_pairs,
    clipped_surrogate,
    equal_reward_groups,
    group_advantages,
    k3_kl,
    reduce_token_loss,
    reduction_units,
    rloo_advantages,
)


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    mu = _mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def _rewards(n_groups=3, g=4, seed=0):
    rng = random.Random(seed)
    return [round(rng.uniform(-1, 2), 3) for _ in range(n_groups * g)]


# ------------------------------------------------------------------ advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_naive(scale):
    g, eps = 4, 1e-4
    r = _rewards(3, g)
    r[4:8] = [0.5] * 4  # an all-equal group -> zero advantage in every mode
    expected = []
    for start in range(0, len(r), g):
        grp = r[start : start + g]
        mu = _mean(grp)
        for x in grp:
            if scale == "group":
                expected.append((x - mu) / (_std_unbiased(grp) + eps))
            elif scale == "batch":
                expected.append((x - mu) / (_std_unbiased(r) + eps))
            else:
                expected.append(x - mu)
    got = group_advantages(torch.tensor(r), g, scale, eps=eps)
    assert got.tolist() == pytest.approx(expected, abs=1e-5)
    assert got[4:8].abs().max() == 0


def test_group_advantages_batch_std_override_and_errors():
    r = torch.tensor([0.0, 1.0, 2.0, 5.0])
    got = group_advantages(r, 2, "batch", eps=0.0, batch_std=2.0)
    assert got.tolist() == pytest.approx([-0.25, 0.25, -0.75, 0.75])
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(r, 2, "global")


def test_rloo_baseline_is_leave_one_out():
    g = 4
    r = _rewards(2, g, seed=1)
    expected = []
    for start in range(0, len(r), g):
        grp = r[start : start + g]
        for i, x in enumerate(grp):
            others = [y for j, y in enumerate(grp) if j != i]
            expected.append(x - _mean(others))
    assert rloo_advantages(torch.tensor(r), g).tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match=">= 2"):
        rloo_advantages(torch.ones(3), 1)


def test_equal_reward_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3])
    assert equal_reward_groups(r, 2).tolist() == [True, False, True]


# ------------------------------------------------------------------ clipping and KL


def test_clipped_surrogate_values_match_naive():
    torch.manual_seed(0)
    logps, old = torch.randn(3, 5) * 0.3, torch.randn(3, 5) * 0.3
    adv = torch.tensor([1.5, -0.7, 0.0])
    eps_lo, eps_hi = 0.2, 0.28
    loss, info = clipped_surrogate(logps, old, adv, eps_lo, eps_hi)
    for b in range(3):
        for t in range(5):
            ratio = math.exp(float(logps[b, t]) - float(old[b, t]))
            a = float(adv[b])
            clipped = min(max(ratio, 1 - eps_lo), 1 + eps_hi)
            assert float(loss[b, t]) == pytest.approx(-min(ratio * a, clipped * a), abs=1e-5)
            assert bool(info["clipped_high"][b, t]) == (ratio > 1 + eps_hi and a > 0)
            assert bool(info["clipped_low"][b, t]) == (ratio < 1 - eps_lo and a < 0)


def test_clipping_removes_gradient_outside_trust_region():
    """Autograd: a ratio past the clip edge in the advantage's direction gets no gradient;
    inside the region (or on the other side) the gradient is d(-ratio * A)/dlogp = -ratio * A."""
    eps_lo, eps_hi = 0.2, 0.28
    # ratios: 1.5 (above 1+eps_hi), 0.5 (below 1-eps_lo), 1.1 (inside); for A > 0 and A < 0.
    log_ratios = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    for a in (1.0, -1.0):
        logps = log_ratios.clone().unsqueeze(0).requires_grad_(True)
        old = torch.zeros(1, 3)
        loss, info = clipped_surrogate(logps, old, torch.tensor([a]), eps_lo, eps_hi)
        loss.sum().backward()
        grad = logps.grad[0].tolist()
        ratios = [1.5, 0.5, 1.1]
        for i, ratio in enumerate(ratios):
            no_grad = (ratio > 1 + eps_hi and a > 0) or (ratio < 1 - eps_lo and a < 0)
            assert grad[i] == pytest.approx(0.0 if no_grad else -ratio * a, abs=1e-6)
            zero_grad_flag = bool(info["clipped_high"][0, i] | info["clipped_low"][0, i])
            assert zero_grad_flag == no_grad
    # Symmetric default: epsilon_high=None means eps_high = eps_low.
    _, info = clipped_surrogate(torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1), torch.ones(1))
    assert bool(info["clipped_high"][0, 0])


def test_k3_kl_matches_formula_and_is_nonnegative():
    torch.manual_seed(1)
    lp, ref = torch.randn(4, 6), torch.randn(4, 6)
    got = k3_kl(lp, ref)
    for b in range(4):
        for t in range(6):
            d = float(ref[b, t]) - float(lp[b, t])
            assert float(got[b, t]) == pytest.approx(math.exp(d) - d - 1, rel=1e-5, abs=1e-6)
    assert (got >= 0).all()
    assert k3_kl(lp, lp).abs().max() == 0


# ------------------------------------------------------------------ loss normalisations


def _naive_global(loss_type, per_token, masks, max_len):
    """The objective each loss_type defines, over the whole global batch, with Python loops."""
    rows = [
        (row, m) for pt, mk in zip(per_token, masks) for row, m in zip(pt.tolist(), mk.tolist())
    ]
    live = [(row, m) for row, m in rows if sum(m) > 0]
    if loss_type in ("dapo", "cispo"):  # CISPO: all tokens of the batch (MiniMax-M1, TRL)
        num = sum(x * k for row, m in live for x, k in zip(row, m))
        return num / sum(sum(m) for _, m in live)
    if loss_type == "grpo":
        return _mean([sum(x * k for x, k in zip(row, m)) / sum(m) for row, m in live])
    if loss_type == "dr_grpo":
        num = sum(x * k for row, m in live for x, k in zip(row, m))
        return num / (len(live) * max_len)
    if loss_type == "bnpo":  # mean over micro-batches of each micro-batch's token mean
        means = []
        for pt, mk in zip(per_token, masks):
            tot = sum(x * k for row, m in zip(pt.tolist(), mk.tolist()) for x, k in zip(row, m))
            n = sum(sum(m) for m in mk.tolist())
            if n:
                means.append(tot / n)
        return _mean(means)
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_normalisations_through_trainer_weighting(loss_type):
    """sum_mb loss_mb * units_mb / sum(units) (what the trainer does) == the naive objective."""
    gen = torch.Generator().manual_seed(3)
    max_len = 7
    per_token, masks = [], []
    for n_rows, width in ((3, 5), (2, 7), (4, 3)):  # micro-batches of different shapes
        per_token.append(torch.randn(n_rows, width, generator=gen))
        lengths = torch.randint(1, width + 1, (n_rows,), generator=gen)
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        masks.append(mask)
    masks[0][1] = 0  # a dropped row (dynamic sampling / placeholder) counts nowhere
    losses = [reduce_token_loss(p, m, loss_type, max_len) for p, m in zip(per_token, masks)]
    units = [reduction_units(m, loss_type) for m in masks]
    trainer_objective = sum(float(lv) * u for lv, u in zip(losses, units)) / sum(units)
    expected = _naive_global(loss_type, per_token, masks, max_len)
    assert trainer_objective == pytest.approx(expected, rel=1e-5)


def test_reduction_units_of_empty_micro_batch_are_zero():
    empty = torch.zeros(2, 4, dtype=torch.long)
    for loss_type in LOSS_TYPES:
        assert reduction_units(empty, loss_type) == 0.0
        assert float(reduce_token_loss(torch.ones(2, 4), empty, loss_type, 4)) == 0.0
    with pytest.raises(ValueError, match="loss_type"):
        reduce_token_loss(torch.ones(1, 1), torch.ones(1, 1), "token")


# ------------------------------------------------------------------ selections


def test_best_worst_pairs_skip_ties():
    g = 4
    r = [0.1, 0.9, 0.9, 0.0, 0.5, 0.5, 0.5, 0.5, 1.0, 0.2, 0.2, 0.7]
    expected = []
    for gi in range(3):
        grp = r[gi * g : gi * g + g]
        best = max(range(g), key=lambda i: (grp[i], -i))  # first maximum
        worst = min(range(g), key=lambda i: (grp[i], i))  # first minimum
        if grp[best] > grp[worst]:
            expected.append((gi * g + best, gi * g + worst))
    got = best_worst_pairs(torch.tensor(r), g)
    assert got == expected == [(1, 3), (8, 9)]  # the all-0.5 group is a tie: skipped


def test_best_of_n_with_threshold():
    g = 3
    r = [0.2, 0.8, 0.1, 0.3, 0.3, 0.0, 1.0, 0.9, 1.0]
    for thr in (None, 0.5, 0.95, 2.0):
        expected = []
        for gi in range(3):
            grp = r[gi * g : gi * g + g]
            best = max(range(g), key=lambda i: (grp[i], -i))
            if thr is None or grp[best] >= thr:
                expected.append(gi * g + best)
        assert best_of_n(torch.tensor(r), g, thr) == expected
    assert best_of_n(torch.tensor(r), g, 0.5) == [1, 6]
