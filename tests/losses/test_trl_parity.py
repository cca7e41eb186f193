"""Parity of grimoire.losses.functional with TRL's own loss code (``trl`` from the dev extra).

Each test runs TRL's real implementation on the same tensors as grimoire and compares the
losses, the metrics TRL logs and the gradients with respect to the input log-probs / rewards.
No TRL trainer is built:

- methods that take tensors (``CPOTrainer.cpo_loss``, ``ORPOTrainer.odds_ratio_loss`` and their
  ``get_batch_loss_metrics``) are called unbound, with a ``SimpleNamespace`` standing in for
  ``self`` that holds just the attributes they read;
- where TRL computes the loss inside ``DPOTrainer._compute_loss`` / ``KTOTrainer._compute_loss`` /
  ``RewardTrainer.compute_loss`` from a model call, a stub "model" returns the test's tensors as
  its per-token log-probs (or rewards), with a completion of one token, so TRL's sums over tokens
  are the sequence log-probs themselves and gradients flow back to the test's leaves.

Not compared, because TRL has no equivalent: DPO ``"sigmoid"`` with ``label_smoothing > 0``
(conservative DPO; TRL's DPOTrainer ignores label_smoothing for "sigmoid", pinned by a test
below), and the cross-rank reduction of KTO's KL estimate (needs several processes). The naive
and torch-reference tests in test_functional.py cover those.
"""

from __future__ import annotations

from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch
from tests.losses.test_functional import (
    DPO_CASES,
    SEEDS,
    B,
    kto_inputs,
    rand,
    rand_uniform,
    seq_logps,
)
from trl import DPOTrainer, KTOTrainer, RewardTrainer
from trl.import_utils import suppress_experimental_warning

from grimoire.losses.functional import (
    bradley_terry_loss,
    cpo_loss,
    cpo_total_loss,
    dpo_loss,
    ipo_loss,
    kto_kl_estimate,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

with suppress_experimental_warning():
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

TOL = {"rtol": 1e-6, "atol": 1e-6}


# ------------------------------------------------------------------------------------------------
# stand-ins for what TRL's loss code reads from the trainer and the model
# ------------------------------------------------------------------------------------------------


def single_process_accelerator() -> SimpleNamespace:
    identity = lambda t: t  # noqa: E731 - gather on one process
    return SimpleNamespace(device=torch.device("cpu"), gather=identity, gather_for_metrics=identity)


def trainer_stub(**attrs) -> SimpleNamespace:
    """What every TRL loss method reads: train mode, one process, an empty metrics store."""
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=single_process_accelerator(),
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        **attrs,
    )


def lm_output(token_logps: torch.Tensor) -> SimpleNamespace:
    """A fused-LM-head output: TRL reads log_probs, and entropy / mean_logits / is_top1 for logs."""
    zeros = torch.zeros(token_logps.shape)
    return SimpleNamespace(
        log_probs=token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
    )


def one_token_completions(n: int) -> torch.Tensor:
    """completion_mask for rows of [prompt token, completion token]."""
    return torch.tensor([[0, 1]]).expand(n, 2)


def last_logged(stub: SimpleNamespace) -> dict[str, float]:
    return {k: v[-1] for k, v in stub._metrics["train"].items()}


def assert_grads_equal(ours: torch.Tensor, theirs: torch.Tensor, inputs: list[torch.Tensor]):
    ours_g = torch.autograd.grad(ours, inputs, retain_graph=True)
    theirs_g = torch.autograd.grad(theirs, inputs, retain_graph=True)
    for a, b in zip(ours_g, theirs_g):
        torch.testing.assert_close(a, b, **TOL)


def assert_logged(ours: torch.Tensor, theirs: float) -> None:
    assert ours.item() == pytest.approx(theirs, rel=1e-6, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# calling TRL
# ------------------------------------------------------------------------------------------------


def trl_dpo(token_logps, completion_mask, ref_chosen, ref_rejected, beta, loss_type, eps=0.0):
    """``DPOTrainer._compute_loss`` with precomputed reference log-probs.

    ``token_logps``: ``[2B, T]`` policy per-token log-probs, chosen rows then rejected rows (TRL's
    batch layout), zero off the completion; ``completion_mask``: ``[2B, T + 1]``.
    """
    stub = trainer_stub(
        beta=beta,
        label_smoothing=eps,
        loss_types=[loss_type],
        loss_weights=[1.0],
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        precompute_ref_logps=True,
        use_weighting=False,
    )
    inputs = {
        "input_ids": torch.ones(completion_mask.shape, dtype=torch.long),
        "attention_mask": torch.ones(completion_mask.shape, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }

    def model(**kwargs):
        assert kwargs["fused_lm_head"]
        return lm_output(token_logps)

    loss = DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    return loss, last_logged(stub)


def trl_dpo_seq(pc, pr, rc, rr, beta, loss_type, eps=0.0):
    """DPO from sequence log-probs: one completion token per row carries the whole sum."""
    tokens = torch.cat([pc, pr]).unsqueeze(1)
    return trl_dpo(tokens, one_token_completions(2 * len(pc)), rc, rr, beta, loss_type, eps)


def trl_kto(p, ref, desirable, pol_kl, ref_kl, beta, wd, wu, calculate_kl=True):
    """``KTOTrainer._compute_loss`` with precomputed reference log-probs (incl. the KL pairs)."""
    stub = trainer_stub(
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        loss_type="kto",
        calculate_KL=calculate_kl,
        precompute_ref_logps=True,
    )
    stub._compute_kl_logps = MethodType(KTOTrainer._compute_kl_logps, stub)
    n = len(p)
    # The stub model tells the two forward passes apart by the token id it is given.
    main_ids, kl_ids = torch.full((n, 2), 1), torch.full((n, 2), 2)
    logps = {1: p.unsqueeze(1), 2: pol_kl.unsqueeze(1)}
    inputs = {
        "input_ids": main_ids,
        "attention_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_mask": one_token_completions(n),
        "label": desirable,
        "ref_logps": ref,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones(n, 2, dtype=torch.long),
        "KL_completion_mask": one_token_completions(n),
        "ref_KL_logps": ref_kl,
    }

    def model(input_ids, **kwargs):
        assert kwargs["fused_lm_head"]
        return lm_output(logps[int(input_ids[0, 0])])

    loss = KTOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    return loss, last_logged(stub)


def pair_forward(chosen, rejected, nll):
    """A ``concatenated_forward`` for CPO/ORPO: log-probs, (unused) logits, the chosen NLL."""
    return lambda model, batch: (chosen, rejected, torch.zeros(1), torch.zeros(1), nll)


def trl_cpo(c, r, nll, beta, loss_type, eps=0.0, simpo_gamma=0.5, cpo_alpha=1.0):
    """``CPOTrainer.cpo_loss`` (per pair) and ``get_batch_loss_metrics`` (the total loss)."""
    stub = trainer_stub(
        beta=beta,
        label_smoothing=eps,
        loss_type=loss_type,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
        alpha=0.0,  # AlphaPO off: plain log-prob rewards
        concatenated_forward=pair_forward(c, r, nll),
    )
    stub.cpo_loss = MethodType(CPOTrainer.cpo_loss, stub)
    losses, chosen_rewards, rejected_rewards = stub.cpo_loss(c, r)
    total, metrics = CPOTrainer.get_batch_loss_metrics(stub, None, {}, "train")
    return losses, chosen_rewards, rejected_rewards, total, metrics


def trl_orpo(c, r, nll, beta):
    """``ORPOTrainer.odds_ratio_loss`` (per pair) and ``get_batch_loss_metrics`` (the total)."""
    stub = trainer_stub(beta=beta, concatenated_forward=pair_forward(c, r, nll))
    stub.odds_ratio_loss = MethodType(ORPOTrainer.odds_ratio_loss, stub)
    per_pair = stub.odds_ratio_loss(c, r)
    total, metrics = ORPOTrainer.get_batch_loss_metrics(stub, None, {}, "train")
    return per_pair, total, metrics


def trl_reward(rc, rr, margin):
    """``RewardTrainer.compute_loss`` on a stub reward model returning the given rewards."""
    stub = trainer_stub(args=SimpleNamespace(center_rewards_coefficient=None))
    inputs = {"attention_mask": torch.ones(2 * len(rc), 2, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin

    def model(**kwargs):
        return SimpleNamespace(logits=torch.cat([rc, rr]).unsqueeze(-1))

    loss = RewardTrainer.compute_loss(stub, model, inputs)
    return loss, last_logged(stub)


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


# ------------------------------------------------------------------------------------------------
# DPO / IPO
# ------------------------------------------------------------------------------------------------

# Every case of the naive-reference tests except cDPO smoothing, which TRL 1.16 drops for sigmoid.
TRL_DPO_CASES = [(t, eps) for t, eps in DPO_CASES if not (t == "sigmoid" and eps > 0)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "eps"), TRL_DPO_CASES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl(seed, loss_type, eps, beta):
    # "ipo" here: one completion token per row, so TRL's length normalisation divides by 1.
    inputs = leaves(*seq_logps(seed))
    ours, metrics = dpo_loss(*inputs, beta=beta, label_smoothing=eps, loss_type=loss_type)
    theirs, logged = trl_dpo_seq(*inputs, beta, loss_type, eps)
    torch.testing.assert_close(ours.mean(), theirs, **TOL)
    assert_grads_equal(ours.mean(), theirs, inputs)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert_logged(metrics[key].mean(), logged[key])
    assert_logged(metrics["logps/chosen"].mean(), logged["logps/chosen"])
    assert_logged(metrics["logps/rejected"].mean(), logged["logps/rejected"])


def test_trl_dpo_sigmoid_ignores_label_smoothing():
    # Why cDPO (sigmoid with label_smoothing > 0) has no TRL parity test: TRL's DPOTrainer computes
    # plain sigmoid DPO whatever label_smoothing is. If this fails, TRL implements it again: add
    # ("sigmoid", eps) cases to TRL_DPO_CASES.
    inputs = seq_logps(0)
    plain, _ = trl_dpo_seq(*inputs, 0.1, "sigmoid", 0.0)
    smoothed, _ = trl_dpo_seq(*inputs, 0.1, "sigmoid", 0.2)
    assert torch.equal(plain, smoothed)
    ours_smoothed, _ = dpo_loss(*inputs, beta=0.1, label_smoothing=0.2)
    assert not torch.allclose(ours_smoothed.mean(), smoothed)


@pytest.mark.parametrize("seed", SEEDS)
def test_ipo_with_length_averaged_logps_matches_trl(seed):
    # TRL's loss_type="ipo" divides each completion's log-ratio by its token count. grimoire's
    # ipo_loss takes the per-token averages; gradients w.r.t. the per-token log-probs must match.
    beta, T = 0.1, 12
    g = torch.Generator().manual_seed(100 + seed)
    tokens = [-torch.rand(B, T, generator=g) * 3 for _ in range(4)]  # pc, pr, rc, rr per token
    masks = [torch.rand(B, T, generator=g) < 0.8 for _ in range(2)]  # chosen, rejected
    for m in masks:
        m[:, 0] = True  # every row has at least one target
    pc, pr, rc, rr = tok = leaves(*tokens)
    mc, mr = masks

    def average(t, m):
        return (t * m).sum(-1) / m.sum(-1)

    ours, metrics = ipo_loss(
        average(pc, mc), average(pr, mr), average(rc, mc), average(rr, mr), beta
    )
    token_logps = torch.cat([pc * mc, pr * mr])
    completion_mask = torch.cat([torch.zeros(2 * B, 1), torch.cat(masks)], dim=1).long()
    ref_c, ref_r = (rc * mc).sum(-1), (rr * mr).sum(-1)
    theirs, logged = trl_dpo(token_logps, completion_mask, ref_c, ref_r, beta, "ipo")
    torch.testing.assert_close(ours.mean(), theirs, **TOL)
    assert_grads_equal(ours.mean(), theirs, tok)
    # TRL logs rewards of the summed log-ratios; grimoire's of the averaged ones it was given.
    assert_logged((metrics["rewards/chosen"] * mc.sum(-1)).mean(), logged["rewards/chosen"])


# ------------------------------------------------------------------------------------------------
# CPO / SimPO
# ------------------------------------------------------------------------------------------------

TRL_CPO_CASES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "eps"), TRL_CPO_CASES)
def test_cpo_matches_trl(seed, loss_type, eps):
    beta, alpha = 0.1, 1.0
    c, r = inputs = leaves(*seq_logps(seed)[:2])
    (nll,) = leaves(torch.tensor(2.3))  # token-mean NLL of the chosen tokens (scalar, as TRL)
    pref, metrics = cpo_loss(c, r, beta=beta, label_smoothing=eps, loss_type=loss_type)
    ours = cpo_total_loss(pref, nll, alpha)
    losses, chosen_r, rejected_r, total, logged = trl_cpo(
        c, r, nll, beta, loss_type, eps, cpo_alpha=alpha
    )
    torch.testing.assert_close(pref, losses, **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], chosen_r, **TOL)
    torch.testing.assert_close(metrics["rewards/rejected"], rejected_r, **TOL)
    torch.testing.assert_close(ours.mean(), total, **TOL)
    assert_grads_equal(ours.mean(), total, [*inputs, nll])
    for key in ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert_logged(metrics[key].mean(), logged[key])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("beta", "gamma", "eps"), [(2.0, 0.8, 0.0), (2.0, 0.8, 0.15), (2.5, 1.4, 0.0)]
)
def test_simpo_matches_trl_cpo_simpo(seed, beta, gamma, eps):
    # TRL: CPOTrainer(loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0), on averaged log-probs.
    inputs = leaves(rand_uniform(10 * seed, -3.0, -0.2), rand_uniform(10 * seed + 1, -3.5, -0.3))
    ours, metrics = simpo_loss(*inputs, beta=beta, gamma=gamma, label_smoothing=eps)
    losses, chosen_r, rejected_r, total, _ = trl_cpo(
        *inputs, torch.tensor(0.0), beta, "simpo", eps, simpo_gamma=gamma, cpo_alpha=0.0
    )
    torch.testing.assert_close(ours, losses, **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], chosen_r, **TOL)
    torch.testing.assert_close(metrics["rewards/rejected"], rejected_r, **TOL)
    torch.testing.assert_close(ours.mean(), total, **TOL)
    assert_grads_equal(ours.mean(), total, inputs)


# ------------------------------------------------------------------------------------------------
# ORPO
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("lo", "hi"), [(-4.0, -0.7), (-0.69, -0.02), (-4.0, -1e-4)])
def test_orpo_matches_trl(seed, lo, hi):
    # Both sides of TRL's log1mexp branch at -ln 2, in float32.
    beta = 0.1
    c, r = inputs = leaves(rand_uniform(30 * seed, lo, hi), rand_uniform(30 * seed + 1, lo, hi))
    (nll,) = leaves(torch.tensor(1.7))
    ours, metrics = orpo_loss(c, r, beta=beta)
    (losses, chosen_r, rejected_r, ratio, log_odds), total, logged = trl_orpo(c, r, nll, beta)
    torch.testing.assert_close(ours, -losses, **TOL)  # TRL returns +beta * log sigma(lor)
    torch.testing.assert_close(metrics["rewards/chosen"], chosen_r, **TOL)
    torch.testing.assert_close(metrics["rewards/rejected"], rejected_r, **TOL)
    torch.testing.assert_close(metrics["log_odds_ratio"].mean(), ratio.detach(), **TOL)
    torch.testing.assert_close(metrics["log_odds_chosen"].mean(), log_odds.detach(), **TOL)
    ours_total = nll + ours.mean()  # ORPOLoss: chosen NLL + mean of the odds-ratio term
    torch.testing.assert_close(ours_total, total, **TOL)
    assert_grads_equal(ours_total, total, [*inputs, nll])
    for key in ("rewards/accuracies", "rewards/margins", "log_odds_ratio", "log_odds_chosen"):
        assert_logged(metrics[key].mean(), logged[key])


# ------------------------------------------------------------------------------------------------
# KTO
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["mixed", "desirable", "undesirable"])
@pytest.mark.parametrize(("wd", "wu"), [(1.0, 1.0), (1.33, 0.7)])
@pytest.mark.parametrize("calculate_kl", [True, False])
def test_kto_matches_trl(seed, kind, wd, wu, calculate_kl):
    beta = 0.1
    p, ref, desirable = kto_inputs(seed, kind)
    g = torch.Generator().manual_seed(60 + seed)
    pol_kl = p.roll(1) + torch.randn(B, generator=g)  # mismatched pairs
    ref_kl = pol_kl - 0.5 + torch.randn(B, generator=g)
    p, ref, pol_kl = leaves(p, ref, pol_kl)
    kl = kto_kl_estimate(pol_kl, ref_kl) if calculate_kl else torch.zeros(1)
    ours, metrics = kto_loss(
        p, ref, desirable, kl, beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    theirs, logged = trl_kto(p, ref, desirable, pol_kl, ref_kl, beta, wd, wu, calculate_kl)
    torch.testing.assert_close(ours.mean(), theirs, **TOL)
    assert_grads_equal(ours.mean(), theirs, [p, ref])
    assert_logged(metrics["kl"], logged["kl"])
    n_chosen, n_rejected = metrics["count/chosen"].item(), metrics["count/rejected"].item()
    if n_chosen:
        assert_logged(metrics["rewards/chosen_sum"] / n_chosen, logged["rewards/chosen"])
        assert_logged(metrics["logps/chosen_sum"] / n_chosen, logged["logps/chosen"])
    if n_rejected:
        assert_logged(metrics["rewards/rejected_sum"] / n_rejected, logged["rewards/rejected"])
        assert_logged(metrics["logps/rejected_sum"] / n_rejected, logged["logps/rejected"])
    # The reference point is detached on both sides: no gradient reaches the mismatched pairs.
    assert torch.autograd.grad(ours.mean(), pol_kl, allow_unused=True)[0] is None
    assert torch.autograd.grad(theirs, pol_kl, allow_unused=True)[0] is None


# ------------------------------------------------------------------------------------------------
# Bradley-Terry (reward modelling)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("margin_kind", ["none", "per_example"])
def test_bradley_terry_matches_trl_reward_trainer(seed, margin_kind):
    rc, rr = inputs = leaves(rand(70 + seed, scale=3.0), rand(80 + seed, scale=3.0))
    margin = rand_uniform(90 + seed, 0.0, 2.0) if margin_kind == "per_example" else None
    ours, metrics = bradley_terry_loss(rc, rr, margin=margin)
    theirs, logged = trl_reward(rc, rr, margin)
    torch.testing.assert_close(ours.mean(), theirs, **TOL)
    assert_grads_equal(ours.mean(), theirs, inputs)
    assert_logged(metrics["rewards/accuracies"].mean(), logged["accuracy"])
    assert_logged(metrics["rewards/margins"].mean(), logged["margin"])
