"""GSPO (``importance_sampling_level="sequence"``) and CISPO (``loss_type="cispo"``).

Three kinds of proof:

- the paper's formula, written here as a naive Python reference (loops and ``math``), equals
  grimoire's loss value AND its gradient with respect to the log-probs (the reference gradient
  is worked by hand from the formula, not taken from autograd);
- ``GRPOMethod.compute_loss`` equals TRL's ``GRPOTrainer._compute_loss`` (the ``trl`` of the dev
  extra) on the same tensors: loss, gradient and the clip / KL metrics, for every loss type at
  both ratio levels, with and without the KL term and the vLLM sampler's truncated IS weight.
  As in test_trl_parity.py no TRL trainer is built: the method is called unbound with a
  ``SimpleNamespace`` holding the attributes it reads, and its log-prob forward returns the
  test's tensors;
- a tiny GRPO run from YAML with each option trains (parameters move, the ratio moves on the
  rollout's second update), and a bad value is rejected before anything loads, naming the key.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from tests.helpers.train_utils import params_of
from trl import GRPOTrainer

from grimoire.cli.run import build_run
from grimoire.cli.schema import validate_config
from grimoire.errors import ConfigError
from grimoire.losses.grpo import CISPO_EPSILON_MAX, GRPOMethod
from grimoire.losses.online_functional import (
    cispo_surrogate,
    clipped_surrogate,
    importance_ratio,
    reduce_token_loss,
)
from grimoire.model.tiny import reverse_rows

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _inputs(seed: int, n: int = 6, width: int = 7, spread: float = 0.5):
    """Per-token log-probs (a leaf), old log-probs ``spread`` away, ragged masks, advantages
    of both signs. Padding positions hold garbage, so a missing mask shows up."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(n, width, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + spread * torch.randn(n, width, generator=g)
    lengths = torch.randint(2, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    adv = torch.randn(n, generator=g)
    return logps, old, mask, adv


def _rows(t: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [[x for x, m in zip(r, mr) if m] for r, mr in zip(t.tolist(), mask.tolist())]


# ------------------------------------------------------------------ the papers' formulas


def test_gspo_sequence_ratio_is_the_length_normalised_geometric_mean():
    """GSPO eq. 7: s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|), over real tokens only."""
    logps, old, mask, _ = _inputs(0)
    got = importance_ratio(logps, old, mask, "sequence")
    assert got.shape == (6, 1)
    for i, (lp, lo) in enumerate(zip(_rows(logps, mask), _rows(old, mask))):
        seq_ratio = math.exp(sum(lp) - sum(lo))  # pi(y_i|x) / pi_old(y_i|x)
        assert got[i, 0].item() == pytest.approx(seq_ratio ** (1 / len(lp)), rel=1e-5)


def test_gspo_loss_and_gradient_equal_the_papers_formula():
    """GSPO eq. 5 with loss_type="grpo": loss = -1/G sum_i min(s_i A_i, clip(s_i) A_i); its
    gradient is -s_i A_i / (G |y_i|) on each token of y_i, and 0 for a sequence clipped in the
    direction its advantage pushes."""
    eps_lo, eps_hi = 0.03, 0.04
    logps, old, mask, adv = _inputs(1, n=8, spread=0.1)
    per_token, info = clipped_surrogate(logps, old, adv, eps_lo, eps_hi, mask, "sequence")
    loss = reduce_token_loss(per_token, mask, "grpo")
    (grad,) = torch.autograd.grad(loss, logps)

    lps, olds, n = _rows(logps, mask), _rows(old, mask), len(adv)
    objective, clipped_seqs = 0.0, 0
    expected_grad = torch.zeros_like(grad)
    for i, a in enumerate(adv.tolist()):
        s = math.exp(sum(x - y for x, y in zip(lps[i], olds[i])) / len(lps[i]))
        objective += min(s * a, min(max(s, 1 - eps_lo), 1 + eps_hi) * a) / n
        no_grad = (s > 1 + eps_hi and a > 0) or (s < 1 - eps_lo and a < 0)
        clipped_seqs += no_grad
        assert bool(info["clipped_high"][i, 0] | info["clipped_low"][i, 0]) == no_grad
        if not no_grad:
            expected_grad[i, : len(lps[i])] = -s * a / (n * len(lps[i]))
    assert 0 < clipped_seqs < n  # both branches are exercised
    assert loss.item() == pytest.approx(-objective, rel=1e-5)
    torch.testing.assert_close(grad, expected_grad, **TOL)


def test_gspo_on_policy_gradient_equals_grpo():
    """On the rollout's first update (old = logps in value) s_i = 1 and GSPO's gradient is
    GRPO's with the per-sequence mean: A_i / |y_i| on every token."""
    logps, _, mask, adv = _inputs(2)
    old = logps.detach()
    grads = []
    for level in ("sequence", "token"):
        per_token, _ = clipped_surrogate(logps, old, adv, 3e-4, 4e-4, mask, level)
        grads.append(torch.autograd.grad(reduce_token_loss(per_token, mask, "grpo"), logps)[0])
    torch.testing.assert_close(grads[0], grads[1], **TOL)
    assert grads[0].abs().sum() > 0


def test_cispo_loss_and_gradient_equal_the_papers_formula():
    """MiniMax-M1's CISPO: loss = -1/sum|o_i| sum_i sum_t sg(min(r_it, eps_max)) A_i logp_it;
    the gradient is -min(r_it, eps_max) A_i / sum|o_i|, never 0 (no token is dropped, unlike
    PPO's clip), even where the weight is capped."""
    eps_max = 1.5
    logps, old, mask, adv = _inputs(3, spread=0.8)
    per_token, info = cispo_surrogate(logps, old, adv, eps_max)
    loss = reduce_token_loss(per_token, mask, "cispo")
    (grad,) = torch.autograd.grad(loss, logps)

    lps, olds = _rows(logps, mask), _rows(old, mask)
    total = sum(len(r) for r in lps)
    value, capped = 0.0, 0
    expected_grad = torch.zeros_like(grad)
    for i, a in enumerate(adv.tolist()):
        for t, (lp, lo) in enumerate(zip(lps[i], olds[i])):
            r = math.exp(lp - lo)
            w = min(r, eps_max)
            capped += r > eps_max
            value += -w * a * lp / total
            expected_grad[i, t] = -w * a / total
            assert bool(info["clipped_high"][i, t]) == (r > eps_max and a > 0)
    assert capped > 0
    assert loss.item() == pytest.approx(value, rel=1e-5)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    assert (grad[mask.bool()] != 0).all()


def test_cispo_on_policy_gradient_equals_dapo():
    """On the rollout's first update r = 1 < eps_max, so CISPO's weight is 1 and its gradient
    is the clipped surrogate's with the same token mean: -A_i / sum|o_i| on every token."""
    logps, _, mask, adv = _inputs(6)
    old = logps.detach()
    cispo, _ = cispo_surrogate(logps, old, adv, CISPO_EPSILON_MAX)
    ppo, _ = clipped_surrogate(logps, old, adv, 0.2, 0.28)
    grads = [
        torch.autograd.grad(reduce_token_loss(pt, mask, lt), logps)[0]
        for pt, lt in ((cispo, "cispo"), (ppo, "dapo"))
    ]
    torch.testing.assert_close(grads[0], grads[1], **TOL)
    expected = -adv[:, None].expand_as(mask) * mask / mask.sum()
    torch.testing.assert_close(grads[0], expected, **TOL)


def test_cispo_sequence_level_weights_every_token_by_the_capped_sequence_ratio():
    """TRL's combination: the weight is sg(min(s_i, eps_max)) of GSPO's sequence ratio."""
    eps_max = 1.1
    logps, old, mask, adv = _inputs(4, spread=0.4)
    per_token, _ = cispo_surrogate(logps, old, adv, eps_max, mask, "sequence")
    (grad,) = torch.autograd.grad((per_token * mask).sum(), logps)
    for i, (lp, lo) in enumerate(zip(_rows(logps, mask), _rows(old, mask))):
        w = min(math.exp(sum(x - y for x, y in zip(lp, lo)) / len(lp)), eps_max)
        for t in range(len(lp)):
            assert float(grad[i, t]) == pytest.approx(-w * float(adv[i]), rel=1e-5)


# ------------------------------------------------------------------ TRL's GRPOTrainer


def _trl_loss(logps, old, mask, adv, *, level, loss_type, eps, eps_high, beta, ref, bias_kl, isw):
    """``GRPOTrainer._compute_loss`` on the test's tensors: (loss, logged metrics)."""
    n, width = mask.shape
    identity = lambda t, **kw: t  # noqa: E731 - one process: gather / reduce are the identity
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(num_processes=1, gather=identity, reduce=identity),
        args=SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros(n, width), None),
        _metrics=defaultdict(lambda: defaultdict(list)),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        current_gradient_accumulation_steps=1,
        importance_sampling_level=level,
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        beta=beta,
        max_completion_length=width,
        use_vllm=isw is not None,
        vllm_importance_sampling_correction=isw is not None,
    )
    inputs = {
        "prompt_ids": torch.ones(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.ones(n, width, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
        "importance_sampling_ratio": isw,
    }
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


PARITY = [
    (level, loss_type, extras)
    for level in ("token", "sequence")
    for loss_type in ("grpo", "dapo", "bnpo", "dr_grpo", "cispo")
    for extras in ("plain", "kl+is")
]


@pytest.mark.parametrize(("level", "loss_type", "extras"), PARITY)
def test_gspo_cispo_match_trl_grpo_trainer(level, loss_type, extras):
    """GRPOMethod's loss, gradient and clip / KL metrics == TRL's, on the same tensors."""
    logps, old, mask, adv = _inputs(5, n=8, spread=0.3 if level == "token" else 0.05)
    width = mask.shape[1]
    eps, eps_high = (0.2, 0.28) if level == "token" else (0.02, 0.03)
    if loss_type == "cispo":
        eps_high = 1.2
    beta, bias_kl, cap = (0.04, True, 2.0) if extras == "kl+is" else (0.0, False, None)
    g = torch.Generator().manual_seed(9)
    ref = logps.detach() + 0.2 * torch.randn(mask.shape, generator=g)
    sampler = old + 0.3 * torch.randn(mask.shape, generator=g)
    isw = None if cap is None else torch.clamp(torch.exp(old - sampler), max=cap)

    method = GRPOMethod(
        [lambda prompts, completions, **kw: [0.0] * len(completions)],
        num_generations=2,
        max_new_tokens=width,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon=eps,
        epsilon_high=eps_high,
        beta=beta,
        use_bias_correction_kl=bias_kl,
        ref_model="copy" if beta else None,
    )
    method.policy_logps = lambda model, batch: (logps, None)
    method.engine = SimpleNamespace(sampler=SimpleNamespace(importance_sampling_cap=cap))
    batch = {"completion_mask": mask, "advantages": adv, "old_logps": old, "ref_logps": ref}
    if cap is not None:
        batch["sampler_logps"] = sampler
    ours, metrics = method.compute_loss(None, batch)
    theirs, logged = _trl_loss(
        logps,
        old,
        mask,
        adv,
        level=level,
        loss_type=loss_type,
        eps=eps,
        eps_high=eps_high,
        beta=beta,
        ref=ref,
        bias_kl=bias_kl,
        isw=isw,
    )

    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)
    g_ours, g_theirs = (torch.autograd.grad(x, logps, retain_graph=True)[0] for x in (ours, theirs))
    torch.testing.assert_close(g_ours, g_theirs, **TOL)
    if loss_type == "cispo":
        names = {"clip_ratio/high_mean": "cispo_clip_ratio"}
    else:
        names = {k: k for k in ("clip_ratio/low_mean", "clip_ratio/high_mean")}
        names["clip_ratio/region_mean"] = "clip_ratio/region_mean"
    if beta:
        names["kl"] = "kl"
    for mine, trl_name in names.items():
        assert float(metrics[mine]) == pytest.approx(logged[trl_name], abs=1e-6), mine
    if level == "sequence" and loss_type != "cispo":
        assert 0 < logged["clip_ratio/region_mean"] < 1  # sequence clipping is exercised


# ------------------------------------------------------------------ options and YAML


def test_gspo_cispo_bad_values_name_the_key():
    def method(**kw):
        return GRPOMethod(["char_match"], num_generations=2, **kw)

    with pytest.raises(ValueError, match=r"importance_sampling_level must be one of \['token'"):
        method(importance_sampling_level="seq")
    with pytest.raises(ValueError, match="loss_type must be one of .*'cispo'"):
        method(loss_type="cispo_token")
    with pytest.raises(ValueError, match="epsilon_high must be >= 1 with loss_type='cispo'"):
        method(loss_type="cispo", epsilon_high=0.28)
    assert method(loss_type="cispo").epsilon_high == CISPO_EPSILON_MAX == 5.0
    assert method(loss_type="cispo", epsilon_high=2.0).epsilon_high == 2.0
    assert method(loss_type="dapo").epsilon_high == 0.2  # other types: epsilon, as before
    assert method().importance_sampling_level == "token"


def test_gspo_with_a_token_summing_loss_type_warns(caplog):
    with caplog.at_level("WARNING", logger="grimoire.losses.grpo"):
        GRPOMethod(["char_match"], num_generations=2, importance_sampling_level="sequence")
    assert "each sequence weighs by its length" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grimoire.losses.grpo"):
        GRPOMethod(
            ["char_match"],
            num_generations=2,
            importance_sampling_level="sequence",
            loss_type="grpo",
        )
    assert caplog.text == ""


def length_reward(prompts, completions, **kwargs):
    """Varies on an untrained model's samples (char_match is 0 on all of them)."""
    return [len(c) / 8 for c in completions]


def _raw(tmp_path, args):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in reverse_rows(8, seed=0)))
    reward = f"{__name__}:length_reward"  # a package.module:function spec, as from YAML
    loss_args = {"reward_funcs": [reward], "num_generations": 4, "max_new_tokens": 6}
    return {
        "model": {"pretrained": "tiny:llama", "model_kwargs": {"dtype": "float32"}},
        "dataset": {"jsonl": str(data)},
        "loss": {"type": "grpo", "args": {**loss_args, "num_iterations": 2, **args}},
        "training": {
            "output_dir": str(tmp_path / "out"),
            "max_steps": 4,
            "batch_size": 2,
            "learning_rate": 0.05,
            "progress_bar": False,
            "gradient_checkpointing": False,
            "mixed_precision": "no",
            "save_on_epoch_end": False,
            "logging_steps": 1,
            "disable_dropout": True,
            "seed": 0,
        },
    }


YAML_OPTIONS = {
    "gspo": {
        "importance_sampling_level": "sequence",
        "loss_type": "grpo",
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
    },
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.02},
}


@pytest.mark.parametrize("name", sorted(YAML_OPTIONS))
def test_gspo_cispo_train_from_yaml(tmp_path, name):
    """The YAML keys pass the schema; 4 steps (2 rollouts x num_iterations=2) run and move the
    parameters, and the first rollout's second update sees a moved ratio that gets clipped
    (GSPO: sequences past 1 +- 4e-4; CISPO: weights capped at 1.02)."""
    raw = _raw(tmp_path, YAML_OPTIONS[name])
    assert validate_config(raw) == []
    run = build_run(raw)
    before = params_of(run.trainer.model)
    run.trainer.train()
    after = params_of(run.trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if r["split"] == "train"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in recs)
    first, second = recs[0], recs[1]  # one rollout, two updates
    assert first["reward_std"] > 0 and second["rewards/mean"] == first["rewards/mean"]
    # first update: old log-probs are the rollout's own forward, equal up to float noise
    assert first["ratio/abs_dev"] < 1e-5 and first["clip_ratio/region_mean"] == 0.0
    assert second["ratio/abs_dev"] > 1e-2 and second["clip_ratio/region_mean"] > 0


def test_gspo_bad_yaml_value_is_rejected_before_loading(tmp_path):
    raw = _raw(tmp_path, {"importance_sampling_level": "sentence"})
    assert validate_config(raw) == []  # the key is known; its value is the loss's to check
    with pytest.raises(ConfigError, match="importance_sampling_level must be one of"):
        build_run(raw)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
