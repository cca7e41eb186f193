"""The sampler/learner mismatch correction: the four importance-sampling modes, DeepSeek-V3.2's
off-policy sequence mask, the mismatch diagnostics, the settings (TRL's names and ``vllm_``
aliases), and GRPO / RLOO applying them.

Golden values are hand-worked (``math`` on a few numbers) or a naive loop; TRL 1.16's own
``GRPOTrainer.get_off_policy_mask`` (a static method) is called on the same tensors. TRL's
ratio modes are inline in ``_generate_and_score_completions``, which cannot be called without
a model and a vLLM client, so the comparison there is built from TRL's documented formula
(``GRPOConfig.vllm_importance_sampling_mode``: token ratios or the ``exp`` of their sum per
sequence, clipped to ``[C_min, C_max]`` or zeroed outside it) written as a loop here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.online_dpo import OnlineDPOMethod
from grimoire.losses.rloo import RLOOMethod
from grimoire.losses.sampler_functional import (
    IMPORTANCE_SAMPLING_MODES,
    importance_sampling_weights,
    off_policy_sequence_mask,
    sampler_mismatch_metrics,
    truncated_importance_weights,
)
from grimoire.model.tiny import build_model

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 7.0]])
SAMPLER = torch.tensor([[-2.0, -1.0, -0.2], [-0.5, -1.5, 3.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _zero_reward(prompts, completions, **kw):
    return [0.0] * len(completions)


def _trl_formula(old, sampler, mask, mode, lo, hi):
    """TRL's documented modes as a loop: rows of weights over the completion's tokens."""
    out = []
    for o, s, m in zip(old.tolist(), sampler.tolist(), mask.tolist()):
        d = [(a - b) * k for a, b, k in zip(o, s, m)]
        ratios = [math.exp(sum(d))] * len(d) if mode.startswith("sequence") else map(math.exp, d)
        row = []
        for r in ratios:
            if mode.endswith("truncate"):
                row.append(min(max(r, lo if lo is not None else -math.inf), hi))
            else:
                row.append(0.0 if (lo is not None and r < lo) or r > hi else r)
        out.append(row)
    return torch.tensor(out)


# ------------------------------------------------------------------ the pure functions


def test_importance_sampling_modes_hand_worked():
    e = math.exp
    # d = old - sampler on real tokens: [1, -1, -0.3], [-0.5, 0.5, (pad)]
    expected = {
        "token_truncate": [[2.0, 0.5, e(-0.3)], [e(-0.5), e(0.5), 1.0]],
        "token_mask": [[0.0, 0.0, e(-0.3)], [e(-0.5), e(0.5), 1.0]],
        # sequence ratios exp(-0.3) and exp(0): inside [0.5, 2]
        "sequence_truncate": [[e(-0.3)] * 3, [1.0] * 3],
        "sequence_mask": [[e(-0.3)] * 3, [1.0] * 3],
    }
    for mode, want in expected.items():
        got = importance_sampling_weights(OLD, SAMPLER, MASK, mode, clip_max=2.0, clip_min=0.5)
        torch.testing.assert_close(got, torch.tensor(want), msg=mode)
    # A tighter upper bound bites on the sequence ratio: truncated to it, or masked.
    trunc = importance_sampling_weights(OLD, SAMPLER, MASK, "sequence_truncate", 0.9, None)
    masked = importance_sampling_weights(OLD, SAMPLER, MASK, "sequence_mask", 0.9, None)
    torch.testing.assert_close(trunc, torch.tensor([[e(-0.3)] * 3, [0.9] * 3]))
    torch.testing.assert_close(masked, torch.tensor([[e(-0.3)] * 3, [0.0] * 3]))
    # A NaN sampler log-prob counts as agreement (ratio 1), as TRL.
    nan = SAMPLER.clone()
    nan[0, 0] = float("nan")
    got = importance_sampling_weights(OLD, nan, MASK, "token_truncate", 2.0)
    assert float(got[0, 0]) == 1.0 and torch.isfinite(got).all()


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
@pytest.mark.parametrize(("lo", "hi"), [(None, 2.0), (0.5, 1.5), (0.8, 3.0)])
def test_importance_sampling_modes_match_trl_formula(mode, lo, hi):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 5, generator=g) * 3
    sampler = old + 0.4 * torch.randn(6, 5, generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]).long()
    got = importance_sampling_weights(old, sampler, mask, mode, hi, lo)
    want = _trl_formula(old, sampler, mask, mode, lo, hi)
    torch.testing.assert_close(got * mask, want * mask, rtol=1e-5, atol=1e-6)


def test_truncated_importance_weights_is_the_token_truncate_mode():
    g = torch.Generator().manual_seed(1)
    old, sampler = -torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    weights, metrics = truncated_importance_weights(old, sampler, mask, 1.2)
    torch.testing.assert_close(
        weights, importance_sampling_weights(old, sampler, mask, "token_truncate", 1.2)
    )
    assert metrics == sampler_mismatch_metrics(old, sampler, mask, "token_truncate", 1.2)


def test_off_policy_mask_matches_trl_get_off_policy_mask():
    g = torch.Generator().manual_seed(7)
    logps = -torch.rand(8, 6, generator=g) * 2
    sampler = logps + 0.6 * torch.randn(8, 6, generator=g)
    mask = (torch.arange(6)[None] < torch.randint(1, 7, (8,), generator=g)[:, None]).float()
    adv = torch.randn(8, generator=g)
    for delta in (0.0, 0.05, 0.3):
        ours = off_policy_sequence_mask(adv, logps, sampler, mask, delta)
        theirs = GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), logps, sampler, mask, delta)
        torch.testing.assert_close(ours, theirs)
    # Hand-worked: A < 0 and mean KL 0.5 > 0.3 -> drop; the same with A > 0 -> keep.
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sp = torch.tensor([[-0.5, -0.5], [-0.5, -0.5], [-0.9, -1.1]])
    got = off_policy_sequence_mask(torch.tensor([-1.0, 1.0, -1.0]), lp, sp, torch.ones(3, 2), 0.3)
    assert got.flatten().tolist() == [0.0, 1.0, 1.0]


def test_mismatch_metrics_hand_worked():
    m = sampler_mismatch_metrics(OLD, SAMPLER, MASK, "token_mask", clip_max=2.0, clip_min=0.5)
    d = [1.0, -1.0, -0.3, -0.5, 0.5]
    k3 = sum(math.exp(x) - x - 1 for x in d) / 5
    assert float(m["sampling/mismatch_kl"]) == pytest.approx(k3, rel=1e-5)
    assert float(m["sampling/sampling_logp_difference/mean"]) == pytest.approx(3.3 / 5)
    assert float(m["sampling/sampling_logp_difference/max"]) == pytest.approx(1.0)
    weights = [0.0, 0.0, math.exp(-0.3), math.exp(-0.5), math.exp(0.5)]
    assert float(m["sampling/importance_sampling_ratio/mean"]) == pytest.approx(sum(weights) / 5)
    assert float(m["sampling/importance_sampling_ratio/min"]) == 0.0
    assert float(m["sampling/importance_sampling_ratio/max"]) == pytest.approx(math.exp(0.5))
    assert float(m["sampling/importance_sampling_ratio/masked_frac"]) == pytest.approx(2 / 5)
    assert float(m["sampling/importance_sampling_ratio/clipped_frac"]) == 0.0
    t = sampler_mismatch_metrics(OLD, SAMPLER, MASK, "token_truncate", clip_max=2.0, clip_min=0.5)
    assert float(t["sampling/importance_sampling_ratio/clipped_frac"]) == pytest.approx(2 / 5)
    assert float(t["sampling/importance_sampling_ratio/masked_frac"]) == 0.0
    # Sequence mode: stats over the two sequences' weights; an empty batch gives neutral values.
    s = sampler_mismatch_metrics(OLD, SAMPLER, MASK, "sequence_mask", clip_max=0.9)
    assert float(s["sampling/importance_sampling_ratio/mean"]) == pytest.approx(math.exp(-0.3) / 2)
    assert float(s["sampling/importance_sampling_ratio/masked_frac"]) == pytest.approx(2 / 5)
    empty = sampler_mismatch_metrics(OLD, SAMPLER, torch.zeros_like(MASK), "token_mask", 2.0)
    assert float(empty["sampling/importance_sampling_ratio/min"]) == 1.0
    assert float(empty["sampling/mismatch_kl"]) == 0.0


# ------------------------------------------------------------------ settings


def _grpo(**kw):
    return GRPOMethod([_zero_reward], num_generations=2, max_new_tokens=3, **kw)


def test_importance_sampling_settings_defaults_and_aliases():
    c = _grpo().sampler_correction
    assert (c.importance_sampling_mode, c.importance_sampling_correction) == (
        "token_truncate",
        True,
    )
    assert c.clip_max(None) == 2.0 and c.clip_max(3.5) == 3.5  # unset: the engine's cap
    assert _grpo().use_bias_correction_kl is True
    a = _grpo(
        vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=3.0,
        vllm_importance_sampling_clip_min=0.1,
        vllm_importance_sampling_correction=False,
    ).sampler_correction
    assert a.importance_sampling_mode == "sequence_mask" and a.clip_max(2.0) == 3.0
    assert a.importance_sampling_clip_min == 0.1 and a.importance_sampling_correction is False
    r = RLOOMethod([_zero_reward], beta=0, vllm_importance_sampling_mode="token_mask")
    assert r.sampler_correction.importance_sampling_mode == "token_mask"


def test_importance_sampling_settings_are_validated():
    with pytest.raises(ValueError, match=r"one of \['token_truncate', 'token_mask', 'seq"):
        _grpo(importance_sampling_mode="sequence")
    with pytest.raises(ValueError, match=r"clip_min \(3.0\) must be below .*clip_max \(2.0\)"):
        _grpo(importance_sampling_clip_min=3.0, importance_sampling_clip_max=2.0)
    with pytest.raises(ValueError, match="off_policy_mask_threshold must be a number >= 0"):
        _grpo(off_policy_mask_threshold=-0.1)
    with pytest.raises(ValueError, match="give importance_sampling_mode or its alias vllm_"):
        _grpo(importance_sampling_mode="token_mask", vllm_importance_sampling_mode="token_mask")
    with pytest.raises(TypeError, match="unexpected keyword argument 'importance_sampling_modes'"):
        _grpo(importance_sampling_modes="token_mask")
    with pytest.raises(TypeError, match="unexpected keyword argument 'importance_sampling_mode'"):
        OnlineDPOMethod([_zero_reward], importance_sampling_mode="token_mask")


# ------------------------------------------------------------------ GRPO and RLOO apply them


def _batch(seed: int, n: int = 4, width: int = 5, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(n, width, generator=g) * 2).requires_grad_(True)
    sampler = logps.detach() + spread * torch.randn(n, width, generator=g)
    mask = (torch.arange(width)[None] < torch.tensor([5, 2, 4, 3])[:n, None]).long()
    adv = torch.tensor([1.0, -1.0, -0.5, 0.5])[:n]
    return logps, sampler, mask, adv


def _with_engine(method, cap):
    method.engine = SimpleNamespace(sampler=SimpleNamespace(importance_sampling_cap=cap))
    return method


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
def test_importance_sampling_weights_grpo_loss_against_naive(mode):
    logps, sampler, mask, adv = _batch(0)
    method = _with_engine(
        _grpo(importance_sampling_mode=mode, importance_sampling_clip_min=0.6), 1.5
    )
    method.policy_logps = lambda model, batch: (logps, None)
    batch = {"completion_mask": mask, "advantages": adv, "sampler_logps": sampler}
    loss, metrics = method.compute_loss(None, batch)
    w = _trl_formula(logps.detach(), sampler, mask, mode, 0.6, 1.5)
    # On-policy (num_iterations=1): ratio 1, surrogate value -A per token; dapo token mean.
    num = sum(-float(adv[i]) * float(w[i, t]) for i in range(4) for t in range(int(mask[i].sum())))
    assert float(loss.detach()) == pytest.approx(num / int(mask.sum()), rel=1e-5)
    assert "sampling/mismatch_kl" in metrics and float(metrics["sampling/mismatch_kl"]) > 0


def test_off_policy_mask_grpo_and_rloo_drop_negative_stale_sequences():
    logps, sampler, mask, adv = _batch(1, spread=1.0)
    keep = GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), logps, sampler, mask, 0.2).float()
    assert 0 < float(keep.sum()) < 4  # the case exercises both outcomes
    grpo = _with_engine(
        _grpo(off_policy_mask_threshold=0.2, importance_sampling_correction=False), 2.0
    )
    grpo.policy_logps = lambda model, batch: (logps, None)
    batch = {"completion_mask": mask, "advantages": adv, "sampler_logps": sampler}
    loss, metrics = grpo.compute_loss(None, batch)
    num = sum(-float(adv[i]) * float(keep[i]) * int(mask[i].sum()) for i in range(4))
    assert float(loss.detach()) == pytest.approx(num / int(mask.sum()), rel=1e-5)
    dropped = 1 - float(keep.mean())
    assert float(metrics["sampling/off_policy_masked_frac"]) == pytest.approx(dropped)
    assert "sampling/importance_sampling_ratio/mean" not in metrics  # correction off
    assert "sampling/mismatch_kl" in metrics  # ... the mismatch is still measured

    rloo = _with_engine(RLOOMethod([_zero_reward], beta=0, off_policy_mask_threshold=0.2), 2.0)
    rloo.policy_logps = lambda model, batch: (logps * mask, None)
    loss, _ = rloo.compute_loss(None, dict(batch))
    w = torch.clamp(torch.exp(logps.detach() - sampler), max=2.0) * keep  # token_truncate
    naive = (
        -sum(
            float(adv[i]) * sum(float(w[i, t] * logps[i, t]) for t in range(int(mask[i].sum())))
            for i in range(4)
        )
        / 4
    )
    assert float(loss.detach()) == pytest.approx(naive, rel=1e-5)


def test_importance_sampling_rloo_weights_tokens_against_naive():
    logps, sampler, mask, adv = _batch(2)
    rloo = _with_engine(
        RLOOMethod([_zero_reward], beta=0, importance_sampling_mode="sequence_truncate"), 1.3
    )
    rloo.policy_logps = lambda model, batch: (logps * mask, None)
    batch = {"completion_mask": mask, "advantages": adv, "sampler_logps": sampler}
    loss, metrics = rloo.compute_loss(None, batch)
    total = 0.0
    for i in range(4):
        n = int(mask[i].sum())
        rho = math.exp(sum(float(logps[i, t] - sampler[i, t]) for t in range(n)))
        seq = sum(float(logps[i, t]) for t in range(n))
        total += -float(adv[i]) * min(rho, 1.3) * seq
    assert float(loss.detach()) == pytest.approx(total / 4, rel=1e-5)
    assert set(metrics) >= {
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/max",
        "sampling/importance_sampling_ratio/clipped_frac",
        "sampling/importance_sampling_ratio/masked_frac",
        "sampling/sampling_logp_difference/mean",
    }
    # A placeholder batch (no sampler log-probs) registers the same keys, with no mismatch.
    placeholder = {"completion_mask": torch.zeros_like(mask), "advantages": adv}
    _, same = rloo.compute_loss(None, placeholder)
    assert set(same) == set(metrics) and float(same["sampling/mismatch_kl"]) == 0.0


def test_importance_sampling_async_hf_sampler_reaches_rloo_as_old_logps():
    """Under asynchronous rollouts the HF sampler's log-probs arrive as ``old_logps``: RLOO (no
    ratio of its own) weights against them, GRPO (whose surrogate's pi_old they are) does not."""
    logps, sampler, mask, _ = _batch(3)
    rloo = _with_engine(RLOOMethod([_zero_reward], beta=0, max_staleness=1), None)
    assert rloo.sampler_differs
    weights, m = rloo.importance_weights({"completion_mask": mask, "old_logps": sampler}, logps)
    want = torch.clamp(torch.exp(logps.detach() - sampler), max=2.0)
    torch.testing.assert_close(weights * mask, want * mask)
    assert float(m["sampling/mismatch_kl"]) > 0
    grpo = _with_engine(_grpo(max_staleness=1), None)
    assert not grpo.sampler_differs
    assert grpo.importance_weights({"completion_mask": mask, "old_logps": sampler}, logps) == (
        None,
        {},
    )
    # Synchronous HF: nothing to correct.
    assert _with_engine(RLOOMethod([_zero_reward], beta=0), None).importance_weights(
        {"completion_mask": mask}, logps
    ) == (None, {})


# ------------------------------------------------------------------ a stale sampler


def test_mismatch_diagnostics_rise_with_sampler_staleness():
    """A tiny model's log-probs before and after k SGD steps: the older the sampler's weights,
    the larger the KL estimate and the share of tokens a token_mask mode drops."""
    torch.manual_seed(0)
    model = build_model(seed=0)
    ids = torch.randint(3, 60, (6, 12))
    mask = torch.ones(6, 11, dtype=torch.long)

    def token_logps() -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    sampler = token_logps()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kls, masked = [], []
    for _ in range(3):
        for _ in range(3):
            logits = model(input_ids=ids).logits[:, :-1]
            loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        m = sampler_mismatch_metrics(token_logps(), sampler, mask, "token_mask", 1.05, 0.95)
        kls.append(float(m["sampling/mismatch_kl"]))
        masked.append(float(m["sampling/importance_sampling_ratio/masked_frac"]))
    assert 0 < kls[0] < kls[1] < kls[2], kls
    assert masked[0] < masked[2] and masked[2] > 0, masked
