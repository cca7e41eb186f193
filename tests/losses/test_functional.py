"""Tests for grimoire.losses.functional against independent references.

Two kinds of reference, both written here and sharing no code with the module under test:

- NAIVE: a per-example Python loop over floats using only the ``math`` module (in double
  precision), written straight from each paper's formula. The log-sigmoid is the usual stable
  two-branch form so large-magnitude logits are checked too.
- TORCH: vectorised torch re-implementations of the same formulas, written here in the way
  TRL's trainers turn log-probs into losses (not TRL's code), used for loss AND gradient
  agreement within 1e-6.

Parity with TRL's own code (TRL called on the same tensors) is in test_trl_parity.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from grimoire.losses import functional, kto_functional
from grimoire.losses.functional import (
    ORPO_MAX_AVG_LOGP,
    bradley_terry_loss,
    cpo_loss,
    cpo_total_loss,
    dpo_loss,
    ipo_loss,
    kto_kl_estimate,
    kto_loss,
    log1mexp,
    orpo_loss,
    simpo_loss,
)

SEEDS = (0, 1, 2)
B = 8
PAIR_KEYS = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}


# ------------------------------------------------------------------------------------------------
# naive math-module references
# ------------------------------------------------------------------------------------------------


def m_log_sigmoid(x: float) -> float:
    """log(1 / (1 + e^-x)), without overflow for |x| large."""
    if x >= 0:
        return -math.log1p(math.exp(-x))
    return x - math.log1p(math.exp(x))


def m_sigmoid(x: float) -> float:
    if x >= 0:
        return 1 / (1 + math.exp(-x))
    e = math.exp(x)
    return e / (1 + e)


def naive_dpo(pc, pr, rc, rr, beta, eps, loss_type):
    out = []
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        z = beta * h
        if loss_type == "sigmoid":
            out.append(-(1 - eps) * m_log_sigmoid(z) - eps * m_log_sigmoid(-z))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - z))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        elif loss_type == "robust":
            out.append((-(1 - eps) * m_log_sigmoid(z) + eps * m_log_sigmoid(-z)) / (1 - 2 * eps))
    return out


def naive_cpo(c, r, beta, eps, loss_type):
    # CPO is DPO with a zero (uniform) reference.
    zeros = [0.0] * len(c)
    return naive_dpo(c, r, zeros, zeros, beta, eps, loss_type)


def naive_simpo(c, r, beta, gamma, eps):
    out = []
    for a, b in zip(c, r):
        z = beta * (a - b) - gamma
        out.append(-(1 - eps) * m_log_sigmoid(z) - eps * m_log_sigmoid(-z))
    return out


def naive_orpo(c, r, beta):
    out_loss, out_lor = [], []
    for a, b in zip(c, r):
        pa, pb = math.exp(a), math.exp(b)
        lor = (math.log(pa) - math.log(1 - pa)) - (math.log(pb) - math.log(1 - pb))
        out_loss.append(-beta * m_log_sigmoid(lor))
        out_lor.append(lor)
    return out_loss, out_lor


def naive_kto(p, ref, desirable, kl, beta, wd, wu):
    out = []
    for a, b, d in zip(p, ref, desirable):
        r = a - b
        if d:
            out.append(wd * (1 - m_sigmoid(beta * (r - kl))))
        else:
            out.append(wu * (1 - m_sigmoid(beta * (kl - r))))
    return out


def naive_bt(rc, rr, margins):
    return [-m_log_sigmoid(a - b - m) for a, b, m in zip(rc, rr, margins)]


# ------------------------------------------------------------------------------------------------
# torch references (the formulas as TRL-style tensor code, written here; not TRL's code)
# ------------------------------------------------------------------------------------------------


def ref_dpo(pc, pr, rc, rr, beta, label_smoothing, loss_type):
    logratios = pc - pr
    ref_logratios = rc - rr
    logits = logratios - ref_logratios
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "robust":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            + F.logsigmoid(-beta * logits) * label_smoothing
        ) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (pc - rc).detach()
    rejected_rewards = beta * (pr - rr).detach()
    return losses, chosen_rewards, rejected_rewards


def ref_cpo(c, r, beta, label_smoothing, loss_type, simpo_gamma=0.5):
    logits = c - r
    if loss_type == "simpo":
        logits = logits - simpo_gamma / beta
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    return losses, beta * c.detach(), beta * r.detach()


def simpo_repo_loss(c, r, beta, gamma_beta_ratio, label_smoothing):
    """princeton-nlp/SimPO's trainer: margin given as gamma / beta."""
    logits = (c - r) - gamma_beta_ratio
    return (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        - F.logsigmoid(-beta * logits) * label_smoothing
    )


def ref_orpo(c, r, beta):
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = F.logsigmoid(log_odds)
    losses = beta * ratio  # TRL: loss = nll - losses.mean()
    return losses, beta * c.detach(), beta * r.detach(), ratio, log_odds


def ref_kto(pc, pr, rc, rr, kl, beta, desirable_weight, undesirable_weight):
    chosen_logratios = pc - rc
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_logratios = pr - rr
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    rejected_rewards = beta * rejected_logratios.detach()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses, chosen_rewards, rejected_rewards


def ref_kto_kl(policy_kl_logps, ref_kl_logps, other_rank_kls=()):
    kl = (policy_kl_logps - ref_kl_logps).mean().detach()
    gathered = torch.stack([kl, *other_rank_kls])  # accelerator.gather_for_metrics
    return gathered.mean().clamp(min=0)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def rand(seed: int, n: int = B, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """float32 ``shift + scale * N(0, 1)`` on a 1/1024 grid.

    The naive refs use these exact float32 values. The grid makes float32 differences of
    magnitudes < 8192 exact, so the comparison measures the loss math, not input cancellation.
    """
    g = torch.Generator().manual_seed(seed)
    x = shift + scale * torch.randn(n, generator=g, dtype=torch.float64)
    return (torch.round(x * 1024) / 1024).float()


def rand_uniform(seed: int, lo: float, hi: float, n: int = B) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).float()


def seq_logps(seed: int, scale: float = 1.0):
    """Summed-log-prob-like inputs (pc, pr, rc, rr); ``scale`` widens them for large logits."""
    pc = rand(4 * seed, shift=-60 * scale, scale=15 * scale)
    pr = rand(4 * seed + 1, shift=-70 * scale, scale=15 * scale)
    # The reference stays close to the policy, as in training.
    rc = pc + rand(4 * seed + 2, scale=3 * scale)
    rr = pr + rand(4 * seed + 3, scale=3 * scale)
    return pc, pr, rc, rr


def close(actual: torch.Tensor, expected, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected_t, rtol=rtol, atol=atol)


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Agreement with the torch references: within 1e-6."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def grads(loss: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # retain_graph: some tests differentiate the same loss against two references.
    return torch.autograd.grad(loss, inputs, retain_graph=True)


def check_pair_metrics(metrics, chosen_rewards, rejected_rewards) -> None:
    assert metrics.keys() >= PAIR_KEYS
    for v in metrics.values():
        assert not v.requires_grad
        assert v.dtype == torch.float32
    close(metrics["rewards/chosen"], chosen_rewards)
    close(metrics["rewards/rejected"], rejected_rewards)
    close(metrics["rewards/margins"], [a - b for a, b in zip(chosen_rewards, rejected_rewards)])
    acc = [1.0 if a > b else 0.0 for a, b in zip(chosen_rewards, rejected_rewards)]
    assert metrics["rewards/accuracies"].tolist() == acc


# ------------------------------------------------------------------------------------------------
# log1mexp
# ------------------------------------------------------------------------------------------------


def test_log1mexp_matches_math():
    xs = [-1e-7, -1e-4, -0.01, -0.3, -math.log(2), -0.7, -1.0, -5.0, -30.0, -100.0]
    expected = [math.log(1 - math.exp(x)) for x in xs]
    close(log1mexp(torch.tensor(xs, dtype=torch.float64)), expected, rtol=1e-9, atol=1e-12)
    x32 = torch.tensor(xs, dtype=torch.float32)
    expected32 = [math.log(1 - math.exp(x)) for x in x32.tolist()]
    close(log1mexp(x32), expected32, rtol=2e-6, atol=1e-7)


def test_log1mexp_gradient_finite_and_correct():
    # d/dx log(1 - e^x) = -e^x / (1 - e^x); the branch not taken must not leak NaN/inf.
    xs = [-1e-6, -1e-3, -0.5, -50.0, -200.0]
    x = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(log1mexp(x).sum(), x)
    assert torch.isfinite(g).all()
    close(g, [-math.exp(v) / (1 - math.exp(v)) for v in xs], rtol=1e-6, atol=1e-12)
    assert log1mexp(torch.tensor(0.0)).item() == -math.inf
    # float32 next to 0: exp(x) rounds to 1, so an unguarded log1p(-exp(x)) branch would be -inf
    # there and leak NaN through torch.where's backward.
    x32 = torch.tensor([-1e-8, -1e-3, -40.0], requires_grad=True)
    (g32,) = torch.autograd.grad(log1mexp(x32).sum(), x32)
    assert torch.isfinite(g32).all()
    close(g32, [-1 / -math.expm1(v) * math.exp(v) for v in x32.tolist()], rtol=1e-5, atol=1e-12)
    assert log1mexp(torch.tensor(-1.0, dtype=torch.bfloat16)).dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# DPO / IPO
# ------------------------------------------------------------------------------------------------


DPO_CASES = [
    ("sigmoid", 0.0),
    ("sigmoid", 0.1),
    ("sigmoid", 0.3),
    ("hinge", 0.0),
    ("ipo", 0.0),
    ("robust", 0.0),
    ("robust", 0.1),
    ("robust", 0.3),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "eps"), DPO_CASES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_naive(seed, loss_type, eps, beta):
    pc, pr, rc, rr = seq_logps(seed)
    losses, metrics = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps, loss_type=loss_type)
    lists = [t.tolist() for t in (pc, pr, rc, rr)]
    assert losses.shape == (B,) and losses.dtype == torch.float32
    close(losses, naive_dpo(*lists, beta, eps, loss_type))
    check_pair_metrics(
        metrics,
        [beta * (a - c) for a, c in zip(lists[0], lists[2])],
        [beta * (b - d) for b, d in zip(lists[1], lists[3])],
    )
    assert metrics["logps/chosen"].tolist() == lists[0]
    assert metrics["logps/rejected"].tolist() == lists[1]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("loss_type", "eps"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.2)]
)
def test_dpo_large_logits_stable(seed, loss_type, eps):
    # |beta * h| in the hundreds to thousands: naive exp() would overflow, F.logsigmoid must not.
    pc, pr, rc, rr = seq_logps(seed, scale=40.0)
    p = leaves(pc, pr)
    losses, _ = dpo_loss(*p, rc, rr, beta=10.0, label_smoothing=eps, loss_type=loss_type)
    lists = [t.tolist() for t in (pc, pr, rc, rr)]
    assert max(abs(10.0 * ((a - c) - (b - d))) for a, b, c, d in zip(*lists)) > 800
    close(losses, naive_dpo(*lists, 10.0, eps, loss_type), rtol=1e-5, atol=1e-4)
    assert all(torch.isfinite(g).all() for g in grads(losses.sum(), p))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [0.0, 0.25])
def test_dpo_sigmoid_gradient_matches_analytic(seed, eps):
    # d loss / d pc = -beta * [(1 - eps) sigma(-z) - eps sigma(z)]; pr, ref get the opposite signs.
    beta = 0.2
    pc, pr, rc, rr = seq_logps(seed)
    p = leaves(pc, pr, rc, rr)
    losses, _ = dpo_loss(*p, beta=beta, label_smoothing=eps)
    g = grads(losses.sum(), p)
    dz = []
    for a, b, c, d in zip(*(t.tolist() for t in (pc, pr, rc, rr))):
        z = beta * ((a - c) - (b - d))
        dz.append(-beta * ((1 - eps) * m_sigmoid(-z) - eps * m_sigmoid(z)))
    for grad, sign in zip(g, (1, -1, -1, 1)):
        close(grad, [sign * v for v in dz], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "eps"), DPO_CASES)
def test_dpo_matches_torch_reference_losses_and_grads(seed, loss_type, eps):
    beta = 0.1
    inputs = leaves(*seq_logps(seed))
    ours, metrics = dpo_loss(*inputs, beta=beta, label_smoothing=eps, loss_type=loss_type)
    theirs, chosen_r, rejected_r = ref_dpo(*inputs, beta, eps, loss_type)
    exact(ours, theirs)
    exact(metrics["rewards/chosen"], chosen_r)
    exact(metrics["rewards/rejected"], rejected_r)
    for a, b in zip(grads(ours.mean(), inputs), grads(theirs.mean(), inputs)):
        exact(a, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_ipo_matches_torch_reference_with_length_averaged_logps(seed):
    # TRL's loss_type="ipo" averages token log-probs over the completion; given those averages,
    # losses and gradients w.r.t. the per-token log-probs must match the torch reference.
    beta, T = 0.1, 12
    g = torch.Generator().manual_seed(100 + seed)
    tokens = [-torch.rand(B, T, generator=g) * 3 for _ in range(4)]
    masks = [torch.rand(B, T, generator=g) < 0.8 for _ in range(4)]
    for m in masks:
        m[:, 0] = True  # every row has at least one target
    tok = leaves(*tokens)

    def averaged(i):
        return (tok[i] * masks[i]).sum(-1) / masks[i].sum(-1)

    ours, metrics = ipo_loss(*(averaged(i) for i in range(4)), beta=beta)
    theirs, chosen_r, _ = ref_dpo(*(averaged(i) for i in range(4)), beta, 0.0, "ipo")
    exact(ours, theirs)
    exact(metrics["rewards/chosen"], chosen_r)
    for i, (a, b) in enumerate(zip(grads(ours.mean(), tok), grads(theirs.mean(), tok))):
        exact(a, b)
        assert (a[~masks[i]] == 0).all()  # positions without a target get no gradient


def test_accuracy_counts_ties_as_misses():
    # At step 0 policy == reference: all implicit rewards are 0 and no pair is "won" (TRL's '>').
    x = rand(3)
    _, metrics = dpo_loss(x, x - 1, x, x - 1)
    assert metrics["rewards/accuracies"].tolist() == [0.0] * B
    _, metrics = bradley_terry_loss(x, x.clone())
    assert metrics["rewards/accuracies"].tolist() == [0.0] * B


@pytest.mark.parametrize("seed", SEEDS)
def test_ipo_matches_naive_and_dpo_ipo(seed):
    pc, pr, rc, rr = (t / 20 for t in seq_logps(seed))  # averaged-scale inputs
    losses, metrics = ipo_loss(pc, pr, rc, rr, beta=0.3)
    lists = [t.tolist() for t in (pc, pr, rc, rr)]
    close(losses, naive_dpo(*lists, 0.3, 0.0, "ipo"))
    same, _ = dpo_loss(pc, pr, rc, rr, beta=0.3, loss_type="ipo")
    assert torch.equal(losses, same)
    assert metrics.keys() >= PAIR_KEYS
    # CPO's "ipo" is the same function of h = c - r (a reference of 0).
    zero = torch.zeros_like(pc)
    cpo_ipo, _ = cpo_loss(pc - rc, pr - rr, beta=0.3, loss_type="ipo")
    close(cpo_ipo, ipo_loss(pc - rc, pr - rr, zero, zero, beta=0.3)[0])


def test_default_logp_reduction_averages_for_ipo_only():
    assert functional.default_logp_reduction("ipo") == "mean"
    for loss_type in functional.DPO_LOSS_TYPES + functional.CPO_LOSS_TYPES:
        if loss_type != "ipo":
            assert functional.default_logp_reduction(loss_type) == "sum"


def test_kto_math_is_reexported_from_functional():
    assert functional.kto_loss is kto_functional.kto_loss
    assert functional.kto_kl_estimate is kto_functional.kto_kl_estimate


# ------------------------------------------------------------------------------------------------
# SimPO
# ------------------------------------------------------------------------------------------------


def avg_logps(seed: int):
    return rand_uniform(10 * seed, -3.0, -0.2), rand_uniform(10 * seed + 1, -3.5, -0.3)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (2.0, 0.5, 0.2)]
)
def test_simpo_matches_naive(seed, beta, gamma, eps):
    c, r = avg_logps(seed)
    losses, metrics = simpo_loss(c, r, beta=beta, gamma=gamma, label_smoothing=eps)
    cl, rl = c.tolist(), r.tolist()
    close(losses, naive_simpo(cl, rl, beta, gamma, eps))
    check_pair_metrics(metrics, [beta * v for v in cl], [beta * v for v in rl])


def test_simpo_large_logits_stable():
    c, r = rand(7, scale=300.0), rand(8, scale=300.0)
    losses, _ = simpo_loss(c, r, beta=2.0, gamma=0.5)
    close(losses, naive_simpo(c.tolist(), r.tolist(), 2.0, 0.5, 0.0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_simpo_matches_torch_references_losses_and_grads(seed, eps):
    beta, gamma = 2.0, 0.8
    inputs = leaves(*avg_logps(seed))
    ours, metrics = simpo_loss(*inputs, beta=beta, gamma=gamma, label_smoothing=eps)
    # TRL CPOTrainer(loss_type="simpo") takes the absolute gamma as simpo_gamma ...
    theirs, chosen_r, rejected_r = ref_cpo(*inputs, beta, eps, "simpo", simpo_gamma=gamma)
    exact(ours, theirs)
    exact(metrics["rewards/chosen"], chosen_r)
    exact(metrics["rewards/rejected"], rejected_r)
    for a, b in zip(grads(ours.mean(), inputs), grads(theirs.mean(), inputs)):
        exact(a, b)
    # ... the SimPO repo's gamma_beta_ratio is gamma / beta.
    repo = simpo_repo_loss(*inputs, beta, gamma / beta, eps)
    exact(ours, repo)
    for a, b in zip(grads(ours.mean(), inputs), grads(repo.mean(), inputs)):
        exact(a, b)


# ------------------------------------------------------------------------------------------------
# CPO
# ------------------------------------------------------------------------------------------------


CPO_CASES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "eps"), CPO_CASES)
def test_cpo_matches_naive(seed, loss_type, eps):
    beta = 0.1
    c, r = seq_logps(seed)[:2]
    losses, metrics = cpo_loss(c, r, beta=beta, label_smoothing=eps, loss_type=loss_type)
    cl, rl = c.tolist(), r.tolist()
    close(losses, naive_cpo(cl, rl, beta, eps, loss_type))
    check_pair_metrics(metrics, [beta * v for v in cl], [beta * v for v in rl])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "eps"), CPO_CASES)
def test_cpo_matches_torch_reference_losses_and_grads(seed, loss_type, eps):
    beta, alpha = 0.1, 1.0
    inputs = leaves(*seq_logps(seed)[:2])
    nll = leaves(torch.tensor(2.3))[0]  # token-mean NLL of the chosen tokens (scalar, as TRL)
    pref, metrics = cpo_loss(*inputs, beta=beta, label_smoothing=eps, loss_type=loss_type)
    ours = cpo_total_loss(pref, nll, alpha)
    assert ours.shape == (B,)
    theirs, chosen_r, rejected_r = ref_cpo(*inputs, beta, eps, loss_type)
    exact(pref, theirs)
    exact(metrics["rewards/chosen"], chosen_r)
    exact(metrics["rewards/rejected"], rejected_r)
    ref_total = theirs.mean() + alpha * nll  # as TRL: loss = losses.mean() + cpo_alpha * nll
    exact(ours.mean(), ref_total)
    for a, b in zip(grads(ours.mean(), [*inputs, nll]), grads(ref_total, [*inputs, nll])):
        exact(a, b)


def test_cpo_total_loss_per_example_nll():
    pref = torch.tensor([0.5, 1.0, 2.0])
    nll = torch.tensor([1.0, 2.0, 3.0])
    close(cpo_total_loss(pref, nll, alpha=0.5), [1.0, 2.0, 3.5])
    with pytest.raises(ValueError, match="chosen_nll"):
        cpo_total_loss(pref, torch.ones(2))
    with pytest.raises(ValueError, match="alpha"):
        cpo_total_loss(pref, nll, alpha=-1.0)


# ------------------------------------------------------------------------------------------------
# ORPO
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.25])
def test_orpo_matches_naive(seed, beta):
    c = rand_uniform(20 * seed, -4.0, -0.01)
    r = rand_uniform(20 * seed + 1, -4.0, -0.01)
    losses, metrics = orpo_loss(c, r, beta=beta)
    naive_losses, naive_lor = naive_orpo(c.tolist(), r.tolist(), beta)
    close(losses, naive_losses)
    close(metrics["log_odds_chosen"], naive_lor, rtol=1e-5, atol=1e-4)
    close(metrics["log_odds_ratio"], [m_log_sigmoid(v) for v in naive_lor], rtol=1e-5, atol=1e-5)
    check_pair_metrics(metrics, [beta * v for v in c.tolist()], [beta * v for v in r.tolist()])


@pytest.mark.parametrize("seed", SEEDS)
def test_orpo_matches_torch_reference_losses_and_grads(seed):
    # Averages <= -ln 2 take the same log1p(-exp(x)) branch as the reference: identical math.
    beta = 0.1
    inputs = leaves(rand_uniform(30 * seed, -4.0, -0.7), rand_uniform(30 * seed + 1, -4.0, -0.7))
    ours, metrics = orpo_loss(*inputs, beta=beta)
    theirs, chosen_r, rejected_r, ratio, log_odds = ref_orpo(*inputs, beta)
    exact(ours, -theirs)
    exact(metrics["rewards/chosen"], chosen_r)
    exact(metrics["rewards/rejected"], rejected_r)
    exact(metrics["log_odds_ratio"], ratio.detach())
    exact(metrics["log_odds_chosen"], log_odds.detach())
    nll = torch.tensor(1.7)
    ours_total, ref_total = nll + ours.mean(), nll - theirs.mean()
    for a, b in zip(grads(ours_total, inputs), grads(ref_total, inputs)):
        exact(a, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_orpo_near_zero_branch_matches_float64_reference(seed):
    # For -ln 2 < avg < 0 we use log(-expm1(x)) (more accurate than the reference's
    # log1p(-exp(x)) in float32); against that formula evaluated in float64 both agree within 1e-6.
    beta = 0.1
    c = rand_uniform(40 * seed, -0.69, -0.02)
    r = rand_uniform(40 * seed + 1, -0.69, -0.02)
    inputs = leaves(c, r)
    ours, _ = orpo_loss(*inputs, beta=beta)
    ref_inputs = leaves(c.double(), r.double())
    theirs = ref_orpo(*ref_inputs, beta)[0]
    exact(ours, -theirs.float())
    for a, b in zip(grads(ours.sum(), inputs), grads(-theirs.sum(), ref_inputs)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_orpo_gradient_matches_analytic():
    # d loss / d c = -beta * sigma(-lor) * d log odds / d c = -beta * sigma(-lor) / (1 - e^c).
    beta = 0.1
    c, r = leaves(rand_uniform(5, -3.0, -0.05), rand_uniform(6, -3.0, -0.05))
    losses, _ = orpo_loss(c, r, beta=beta)
    gc, gr = grads(losses.sum(), [c, r])
    exp_c, exp_r = [], []
    for a, b in zip(c.tolist(), r.tolist()):
        lor = (a - math.log(1 - math.exp(a))) - (b - math.log(1 - math.exp(b)))
        s = m_sigmoid(-lor)
        exp_c.append(-beta * s / (1 - math.exp(a)))
        exp_r.append(beta * s / (1 - math.exp(b)))
    close(gc, exp_c, rtol=1e-5, atol=1e-7)
    close(gr, exp_r, rtol=1e-5, atol=1e-7)


def test_orpo_stable_near_zero_and_far():
    values = [-1e-8, -1e-3, -50.0, 0.0]
    pairs = list(itertools.product(values, repeat=2))
    c, r = leaves(torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs]))
    losses, metrics = orpo_loss(c, r, beta=0.1)
    assert torch.isfinite(losses).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    gc, gr = grads(losses.sum(), [c, r])
    assert torch.isfinite(gc).all() and torch.isfinite(gr).all()
    # The clamp only enters log(1 - p): a near-certain rejected response is still pushed down.
    assert (gr > 0).all()
    # A chosen avg at/above the clamp behaves like one exactly at the clamp.
    at_clamp, _ = orpo_loss(torch.tensor([ORPO_MAX_AVG_LOGP]), torch.tensor([-1.0]))
    i = pairs.index((-1e-8, -50.0))
    close(losses[i : i + 1], [0.0], atol=1e-6)
    assert torch.isfinite(at_clamp).all()
    # bf16 inputs are computed in float32.
    l16, _ = orpo_loss(torch.tensor([-1e-3], dtype=torch.bfloat16), torch.tensor([-2.0]).bfloat16())
    assert l16.dtype == torch.float32 and torch.isfinite(l16).all()


# ------------------------------------------------------------------------------------------------
# KTO
# ------------------------------------------------------------------------------------------------


def kto_inputs(seed: int, kind: str):
    p, _, ref, _ = seq_logps(seed)
    if kind == "mixed":
        g = torch.Generator().manual_seed(50 + seed)
        desirable = torch.rand(B, generator=g) < 0.5
        desirable[0], desirable[1] = True, False  # both kinds present
    else:
        desirable = torch.full((B,), kind == "desirable")
    return p, ref, desirable


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["mixed", "desirable", "undesirable"])
@pytest.mark.parametrize(("wd", "wu"), [(1.0, 1.0), (1.33, 0.7)])
@pytest.mark.parametrize("kl", [0.0, 0.8, 4.0])
def test_kto_matches_naive(seed, kind, wd, wu, kl):
    beta = 0.1
    p, ref, desirable = kto_inputs(seed, kind)
    losses, metrics = kto_loss(
        p, ref, desirable, torch.tensor(kl), beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    pl, rl, dl = p.tolist(), ref.tolist(), desirable.tolist()
    close(losses, naive_kto(pl, rl, dl, kl, beta, wd, wu))
    rewards = [beta * (a - b) for a, b in zip(pl, rl)]
    close(metrics["rewards/chosen_sum"], sum(v for v, d in zip(rewards, dl) if d))
    close(metrics["rewards/rejected_sum"], sum(v for v, d in zip(rewards, dl) if not d))
    close(metrics["logps/chosen_sum"], sum(v for v, d in zip(pl, dl) if d), rtol=1e-6)
    close(metrics["logps/rejected_sum"], sum(v for v, d in zip(pl, dl) if not d), rtol=1e-6)
    assert metrics["count/chosen"].item() == sum(dl)
    assert metrics["count/rejected"].item() == B - sum(dl)
    close(metrics["kl"], torch.tensor(kl, dtype=torch.float32))
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("wd", "wu"), [(1.0, 1.0), (1.33, 0.7)])
def test_kto_matches_torch_reference_losses_and_grads(seed, wd, wu):
    beta = 0.1
    p, ref, desirable = kto_inputs(seed, "mixed")
    g = torch.Generator().manual_seed(60 + seed)
    pol_kl = p.roll(1) + torch.randn(B, generator=g)  # mismatched pairs
    ref_kl = pol_kl - 0.5 + torch.randn(B, generator=g)
    p, ref, pol_kl = leaves(p, ref, pol_kl)
    kl = kto_kl_estimate(pol_kl, ref_kl)
    expected_kl = ref_kto_kl(pol_kl, ref_kl)
    exact(kl, expected_kl)
    assert not kl.requires_grad and kl.dim() == 0
    ours, metrics = kto_loss(
        p, ref, desirable, kl, beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    d = desirable
    theirs, chosen_r, rejected_r = ref_kto(p[d], p[~d], ref[d], ref[~d], expected_kl, beta, wd, wu)
    exact(torch.cat((ours[d], ours[~d])), theirs)
    exact(metrics["rewards/chosen_sum"], chosen_r.sum())
    exact(metrics["rewards/rejected_sum"], rejected_r.sum())
    ours_g = torch.autograd.grad(ours.mean(), [p, ref, pol_kl], allow_unused=True)
    theirs_g = torch.autograd.grad(theirs.mean(), [p, ref, pol_kl], allow_unused=True)
    exact(ours_g[0], theirs_g[0])
    exact(ours_g[1], theirs_g[1])
    # The reference point is detached: no gradient reaches the mismatched log-probs.
    assert ours_g[2] is None and theirs_g[2] is None


def test_kto_kl_estimate_clamp_and_reduce_order():
    pol = torch.tensor([-10.0, -12.0])
    ref = torch.tensor([-11.0, -11.0])  # local mean 0.0 ... +1 and -1
    close(kto_kl_estimate(pol, ref), 0.0)
    close(kto_kl_estimate(pol + 1, ref), 1.0)
    # Negative local estimate is clamped to 0 ...
    assert kto_kl_estimate(pol - 1, ref).item() == 0.0
    # ... but only AFTER the cross-rank mean: (-1 + 3) / 2 = 1, not (0 + 3) / 2.
    other_rank = torch.tensor(3.0)
    est = kto_kl_estimate(pol - 1, ref, reduce_fn=lambda t: torch.stack([t, other_rank]).mean())
    close(est, 1.0)
    close(est, ref_kto_kl(pol - 1, ref, [other_rank]))
    with pytest.raises(ValueError, match="at least one"):
        kto_kl_estimate(torch.zeros(0), torch.zeros(0))


def test_kto_rejects_bad_inputs():
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="bool"):
        kto_loss(p, p, torch.ones(3), 0.0)
    with pytest.raises(ValueError, match="scalar"):
        kto_loss(p, p, torch.ones(3, dtype=torch.bool), torch.zeros(2))
    with pytest.raises(ValueError, match="desirable_weight"):
        kto_loss(p, p, torch.ones(3, dtype=torch.bool), 0.0, desirable_weight=-1.0)
    # A 1-element kl (TRL's torch.zeros(1) when the KL term is off) and a float are accepted.
    a, _ = kto_loss(p, p, torch.ones(3, dtype=torch.bool), torch.zeros(1))
    b, _ = kto_loss(p, p, torch.ones(3, dtype=torch.bool), 0.0)
    close(a, [0.5, 0.5, 0.5])
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Bradley-Terry
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("margin_kind", ["none", "scalar", "per_example"])
def test_bradley_terry_matches_naive(seed, margin_kind):
    rc, rr = rand(70 + seed, scale=3.0), rand(80 + seed, scale=3.0)
    if margin_kind == "none":
        margin, margins = None, [0.0] * B
    elif margin_kind == "scalar":
        margin, margins = 0.5, [0.5] * B
    else:
        margin = rand_uniform(90 + seed, 0.0, 2.0)
        margins = margin.tolist()
    losses, metrics = bradley_terry_loss(rc, rr, margin=margin)
    close(losses, naive_bt(rc.tolist(), rr.tolist(), margins))
    check_pair_metrics(metrics, rc.tolist(), rr.tolist())
    # Large rewards stay finite and exact.
    big, _ = bradley_terry_loss(rc * 500, rr * 500, margin=margin)
    close(big, naive_bt((rc * 500).tolist(), (rr * 500).tolist(), margins), atol=1e-4)


def test_bradley_terry_matches_torch_reference_losses_and_grads():
    # The formula of TRL's RewardTrainer: loss = -logsigmoid(r_c - r_r - margin).mean()
    rc, rr = leaves(rand(1, scale=2.0), rand(2, scale=2.0))
    margin = rand_uniform(3, 0.0, 1.0)
    ours, _ = bradley_terry_loss(rc, rr, margin)
    theirs = -F.logsigmoid(rc - rr - margin)
    exact(ours, theirs)
    for a, b in zip(grads(ours.mean(), [rc, rr]), grads(theirs.mean(), [rc, rr])):
        exact(a, b)


# ------------------------------------------------------------------------------------------------
# shapes, dtypes, validation (all functions)
# ------------------------------------------------------------------------------------------------


def _all_calls(n: int, dtype: torch.dtype):
    """(name, fn(inputs) -> (losses, metrics), inputs) for every loss with batch size n."""

    def t(seed, shift):
        return rand(seed, n, shift=shift).clamp(max=-0.01).to(dtype)

    seq = [t(i, -30.0) for i in range(4)]
    avg = [rand_uniform(i, -3.0, -0.1, n).to(dtype) for i in range(2)]
    desirable = torch.arange(n) % 2 == 0
    return [
        ("dpo", lambda x: dpo_loss(*x), seq),
        ("ipo", lambda x: ipo_loss(*x), seq),
        ("simpo", lambda x: simpo_loss(*x), avg),
        ("cpo", lambda x: cpo_loss(*x), seq[:2]),
        ("orpo", lambda x: orpo_loss(*x), avg),
        ("kto", lambda x: kto_loss(x[0], x[1], desirable, torch.tensor(0.3)), seq[:2]),
        ("bt", lambda x: bradley_terry_loss(*x), seq[:2]),
    ]


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_shapes_dtypes_and_grad_flow(n, dtype):
    for name, fn, inputs in _all_calls(n, dtype):
        x = leaves(*inputs)
        losses, metrics = fn(x)
        assert losses.shape == (n,), name
        assert losses.dtype == torch.float32, name
        for key, v in metrics.items():
            assert v.dtype == torch.float32, (name, key)
            assert not v.requires_grad, (name, key)
            assert v.shape in ((n,), ()), (name, key, v.shape)
        if name != "kto":
            assert all(metrics[k].shape == (n,) for k in PAIR_KEYS), name
        gs = grads(losses.mean(), x)
        for g, inp in zip(gs, x):
            assert g.dtype == dtype and g.shape == inp.shape and torch.isfinite(g).all(), name


def test_validation_errors():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="same shape"):
        dpo_loss(x, x, x, torch.zeros(4, 1))
    with pytest.raises(ValueError, match="same shape"):
        simpo_loss(x, torch.zeros(3))
    with pytest.raises(ValueError, match=r"did you mean \"hinge\""):
        dpo_loss(x, x, x, x, loss_type="hnge")
    with pytest.raises(ValueError, match="unknown loss_type"):
        cpo_loss(x, x, loss_type="robust")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, label_smoothing=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        cpo_loss(x, x, label_smoothing=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, label_smoothing=0.5, loss_type="robust")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        orpo_loss(x - 1, x - 1, beta=-0.1)
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(x, x, gamma=math.nan)
    with pytest.raises(ValueError, match="margin"):
        bradley_terry_loss(x, x, margin=torch.zeros(3))
