"""Preference loss classes on a tiny model, against log-probs computed independently here.

The reference log-probs are NAIVE: each sequence is run through the model on its own (no
padding, no batching, no concatenation), ``log_softmax`` is taken over the full vocabulary and the
label tokens are picked with Python loops. The formulas are the already-tested pure functions of
``grimoire.losses.functional``, so these tests check the model-facing machinery: the
concatenated chosen+rejected forward, padding, label shifting, reductions, the NLL terms, KTO's
mismatched pairs and KL estimate, the reward pooling, and the three reference sources.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from grimoire.collate.kto import KTOCollator
from grimoire.collate.preference import PreferenceCollator
from grimoire.errors import ConfigError
from grimoire.forward.precomputed import cache_reference_log_probs
from grimoire.losses.cpo import CPOLoss
from grimoire.losses.dpo import DPOLoss
from grimoire.losses.functional import (
    bradley_terry_loss,
    cpo_loss,
    dpo_loss,
    ipo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)
from grimoire.losses.ipo import IPOLoss
from grimoire.losses.kto import KTOLoss
from grimoire.losses.orpo import ORPOLoss
from grimoire.losses.reward import RewardModelLoss
from grimoire.losses.simpo import SimPOLoss
from grimoire.model.tiny import build_model, kto_rows, preference_rows
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import tokenize_preference

ATOL = 2e-5
PAD = 0


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------
# data and naive references
# ------------------------------------------------------------------------------------------------

RAW_PAIRS = [
    *preference_rows(4, seed=5),
    # Responses of different lengths, so chosen and rejected need padding to a common width.
    {"prompt": "reverse abcdefgh=", "chosen": "hgfedcba", "rejected": "hg"},
    {"prompt": "reverse ab=", "chosen": "ba", "rejected": "bbbbbbbbbbb"},
]
RAW_KTO = [
    *kto_rows(4, seed=6),
    {"prompt": "reverse abcdefghij=", "completion": "jihgfedcba", "label": True},
    {"prompt": "reverse ab=", "completion": "aaaaaaa", "label": False},
]


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return [tokenize_preference(r, tokenizer, max_length=64) for r in RAW_PAIRS]


@pytest.fixture(scope="module")
def kto_feats(tokenizer):
    return [tokenize_kto(r, tokenizer, max_length=64) for r in RAW_KTO]


@pytest.fixture
def policy(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir)


@pytest.fixture
def ref(tiny_dir):
    """A reference with different weights, so policy - reference is not zero."""
    vocab = AutoConfig.from_pretrained(tiny_dir).vocab_size
    return build_model(seed=1, vocab_size=vocab).eval()


def naive_seq(model, ids: list[int], labels: list[int]) -> tuple[torch.Tensor, int]:
    """(summed log-prob of the label tokens, their count) from an unpadded single-row forward."""
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    total, n = logp.new_zeros(()), 0
    for t in range(len(ids) - 1):
        if labels[t + 1] != -100:
            total = total + logp[t, labels[t + 1]]
            n += 1
    return total, n


def naive_pairs(model, rows, reduction: str, grad: bool = False):
    """Per-pair chosen/rejected log-probs [B] plus the chosen token-mean NLL."""
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        out = {"chosen": [], "rejected": []}
        nll_sum, nll_n = 0.0, 0
        for r in rows:
            for side in ("chosen", "rejected"):
                s, n = naive_seq(model, r[f"{side}_input_ids"], r[f"{side}_labels"])
                out[side].append(s if reduction == "sum" else s / n)
                if side == "chosen":
                    nll_sum, nll_n = nll_sum - s, nll_n + n
        return torch.stack(out["chosen"]), torch.stack(out["rejected"]), nll_sum / nll_n


def check_metrics(metrics: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert float(metrics[key]) == pytest.approx(float(value.float().mean()), abs=1e-4), key


PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


# ------------------------------------------------------------------------------------------------
# DPO / IPO
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_type", "label_smoothing", "reduction"),
    [
        ("sigmoid", 0.0, "sum"),
        ("sigmoid", 0.2, "sum"),
        ("hinge", 0.0, "sum"),
        ("ipo", 0.0, "sum"),
        ("robust", 0.1, "sum"),
        ("sigmoid", 0.0, "mean"),
    ],
)
def test_dpo_matches_naive(policy, ref, pairs, loss_type, label_smoothing, reduction):
    loss_fn = DPOLoss(
        beta=0.3,
        ref_model=ref,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        logp_reduction=reduction,
    )
    batch = PreferenceCollator(PAD)(pairs)
    loss, metrics = loss_fn(policy, batch)

    pc, pr, _ = naive_pairs(policy, pairs, reduction)
    rc, rr, _ = naive_pairs(ref, pairs, reduction)
    losses, expected = dpo_loss(
        pc, pr, rc, rr, beta=0.3, label_smoothing=label_smoothing, loss_type=loss_type
    )
    assert loss.item() == pytest.approx(float(losses.mean()), abs=ATOL)
    assert set(PAIR_METRICS) <= set(metrics)
    check_metrics(metrics, expected)
    assert all(v.dim() == 0 for v in metrics.values())
    assert loss_fn.loss_weight(batch) == len(pairs)


def test_dpo_gradients_match_naive(policy, ref, pairs):
    batch = PreferenceCollator(PAD)(pairs)
    loss, _ = DPOLoss(beta=0.5, ref_model=ref)(policy, batch)
    grads = torch.autograd.grad(loss, list(policy.parameters()))

    pc, pr, _ = naive_pairs(policy, pairs, "sum", grad=True)
    rc, rr, _ = naive_pairs(ref, pairs, "sum")
    expected_loss = dpo_loss(pc, pr, rc, rr, beta=0.5)[0].mean()
    expected = torch.autograd.grad(expected_loss, list(policy.parameters()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e.float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ipo_matches_naive(policy, ref, pairs, reduction):
    loss_fn = IPOLoss(beta=0.2, ref_model=ref, logp_reduction=reduction)
    assert IPOLoss().logp_reduction == "mean"  # TRL's averaged convention by default
    loss, metrics = loss_fn(policy, PreferenceCollator(PAD)(pairs))
    pc, pr, _ = naive_pairs(policy, pairs, reduction)
    rc, rr, _ = naive_pairs(ref, pairs, reduction)
    losses, expected = ipo_loss(pc, pr, rc, rr, beta=0.2)
    assert loss.item() == pytest.approx(float(losses.mean()), rel=1e-5, abs=ATOL)
    check_metrics(metrics, expected)


def test_ipo_loss_and_dpo_ipo_agree_by_default(policy, ref, pairs):
    # One IPO: the same math and the same default reduction (token averages, TRL's convention),
    # whichever class the user picks.
    ipo, dpo_ipo = (
        IPOLoss(beta=0.2, ref_model=ref),
        DPOLoss(beta=0.2, ref_model=ref, loss_type="ipo"),
    )
    assert ipo.logp_reduction == dpo_ipo.logp_reduction == "mean"
    assert DPOLoss().logp_reduction == "sum"  # every other loss type keeps sums
    batch = PreferenceCollator(PAD)(pairs)
    loss_a, metrics_a = ipo(policy, batch)
    loss_b, metrics_b = dpo_ipo(policy, batch)
    assert loss_a.item() == loss_b.item()
    assert {k: float(v) for k, v in metrics_a.items()} == {
        k: float(v) for k, v in metrics_b.items()
    }


# ------------------------------------------------------------------------------------------------
# reference-free: SimPO, CPO, ORPO
# ------------------------------------------------------------------------------------------------


def test_simpo_matches_naive(policy, pairs):
    loss, metrics = SimPOLoss(beta=2.5, gamma=0.7, label_smoothing=0.1)(
        policy, PreferenceCollator(PAD)(pairs)
    )
    c, r, _ = naive_pairs(policy, pairs, "mean")
    losses, expected = simpo_loss(c, r, beta=2.5, gamma=0.7, label_smoothing=0.1)
    assert loss.item() == pytest.approx(float(losses.mean()), abs=ATOL)
    check_metrics(metrics, expected)


@pytest.mark.parametrize(
    ("loss_type", "reduction"), [("sigmoid", "sum"), ("hinge", "sum"), ("ipo", "mean")]
)
def test_cpo_matches_naive(policy, pairs, loss_type, reduction):
    loss_fn = CPOLoss(beta=0.2, cpo_alpha=0.7, loss_type=loss_type)
    assert loss_fn.logp_reduction == reduction  # TRL: sums, except averages for "ipo"
    loss, metrics = loss_fn(policy, PreferenceCollator(PAD)(pairs))
    c, r, nll = naive_pairs(policy, pairs, reduction)
    pref, expected = cpo_loss(c, r, beta=0.2, loss_type=loss_type)
    assert loss.item() == pytest.approx(float(pref.mean() + 0.7 * nll), abs=ATOL)
    assert float(metrics["nll_loss"]) == pytest.approx(float(nll), abs=ATOL)
    check_metrics(metrics, expected)


def test_orpo_matches_naive_with_gradients(policy, pairs):
    batch = PreferenceCollator(PAD)(pairs)
    loss, metrics = ORPOLoss(beta=0.25)(policy, batch)
    grads = torch.autograd.grad(loss, list(policy.parameters()))

    c, r, nll = naive_pairs(policy, pairs, "mean", grad=True)
    odds, expected = orpo_loss(c, r, beta=0.25)
    # ORPO = token-mean NLL over the batch's chosen tokens - beta * mean log sigma(LOR).
    expected_loss = nll + odds.mean()
    assert loss.item() == pytest.approx(float(expected_loss), abs=ATOL)
    check_metrics(metrics, {k: expected[k] for k in (*PAIR_METRICS, "log_odds_ratio")})
    assert float(metrics["nll_loss"]) == pytest.approx(float(nll), abs=ATOL)
    for g, e in zip(grads, torch.autograd.grad(expected_loss, list(policy.parameters()))):
        torch.testing.assert_close(g, e.float(), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# KTO
# ------------------------------------------------------------------------------------------------


def naive_kto_terms(model, raw_rows, tokenizer):
    """Own and mismatched (prompt i + completion i+1) summed log-probs, tokenized from text."""
    own, mism = [], []
    with torch.no_grad():
        for i, row in enumerate(raw_rows):
            feat = tokenize_kto(row, tokenizer, max_length=64)
            own.append(naive_seq(model, feat["input_ids"], feat["labels"])[0])
            nxt = raw_rows[(i + 1) % len(raw_rows)]
            pair = tokenize_kto(
                {"prompt": row["prompt"], "completion": nxt["completion"], "label": True},
                tokenizer,
                max_length=64,
            )
            mism.append(naive_seq(model, pair["input_ids"], pair["labels"])[0])
    return torch.stack(own), torch.stack(mism)


def sharpened(model):
    """A reference whose logits are the policy's times 3: sharper, so the log-probs of the
    (arbitrary) mismatched completions are lower and the KL estimate is clearly positive (a
    clamped-to-zero z0 would hide which pairs were used)."""
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref.model.norm.weight.mul_(3.0)
    return ref


def test_kto_matches_naive_with_class_weights(policy, kto_feats, tokenizer):
    ref = sharpened(policy)
    loss_fn = KTOLoss(beta=0.4, ref_model=ref, desirable_weight=1.3, undesirable_weight=0.6)
    batch = KTOCollator(PAD)(kto_feats)
    loss, metrics = loss_fn(policy, batch)

    p_own, p_kl = naive_kto_terms(policy, RAW_KTO, tokenizer)
    r_own, r_kl = naive_kto_terms(ref, RAW_KTO, tokenizer)
    kl = (p_kl - r_kl).mean().clamp(min=0)  # the paper's z0 from mismatched pairs
    assert kl > 0.05
    desirable = torch.tensor([r["label"] for r in RAW_KTO])
    losses, sums = kto_loss(
        p_own, r_own, desirable, kl, beta=0.4, desirable_weight=1.3, undesirable_weight=0.6
    )
    assert loss.item() == pytest.approx(float(losses.mean()), abs=ATOL)
    assert float(metrics["kl"]) == pytest.approx(float(kl), abs=1e-4)
    rewards = 0.4 * (p_own - r_own)
    assert float(metrics["rewards/chosen"]) == pytest.approx(
        float(rewards[desirable].mean()), abs=1e-4
    )
    assert float(metrics["rewards/rejected"]) == pytest.approx(
        float(rewards[~desirable].mean()), abs=1e-4
    )
    assert float(metrics["logps/chosen"]) == pytest.approx(float(p_own[desirable].mean()), abs=1e-3)
    assert float(metrics["count/chosen"]) == float(desirable.sum())
    assert float(sums["count/rejected"]) == float(metrics["count/rejected"])
    assert loss_fn.loss_weight(batch) == len(RAW_KTO)


def test_kto_kl_is_detached_and_clamped(policy, kto_feats):
    """Policy == reference: rewards and KL are exactly 0, and no gradient reaches z0."""
    ref = copy.deepcopy(policy).eval()
    policy.eval()
    loss, metrics = KTOLoss(beta=0.1, ref_model=ref)(policy, KTOCollator(PAD)(kto_feats))
    assert float(metrics["kl"]) == 0.0
    assert loss.item() == pytest.approx(0.5, abs=1e-6)  # 1 - sigmoid(0) for every row
    loss.backward()  # gradient flows through the own-completion log-probs only
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


# ------------------------------------------------------------------------------------------------
# reward model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_margin", [False, True])
def test_reward_model_matches_per_sequence_scores(tiny_dir, pairs, use_margin):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    rows = [dict(r, margin=0.25 * i) for i, r in enumerate(pairs)]
    loss_fn = RewardModelLoss(margin_field="margin" if use_margin else None)
    loss, metrics = loss_fn(model, PreferenceCollator(PAD)(rows))

    with torch.no_grad():  # each sequence alone: its score is at its own last token
        score = {
            side: torch.stack(
                [model(input_ids=torch.tensor([r[f"{side}_input_ids"]])).logits[0, 0] for r in rows]
            )
            for side in ("chosen", "rejected")
        }
    margin = torch.tensor([r["margin"] for r in rows]) if use_margin else None
    losses, expected = bradley_terry_loss(score["chosen"], score["rejected"], margin)
    assert loss.item() == pytest.approx(float(losses.mean()), abs=ATOL)
    check_metrics(metrics, expected)


def test_reward_model_refuses_pad_equal_to_last_token(tiny_dir, pairs):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    model.config.pad_token_id = 2  # == EOS, which ends every response
    with pytest.raises(ValueError, match="distinct pad token"):
        RewardModelLoss()(model, PreferenceCollator(2)(pairs))


# ------------------------------------------------------------------------------------------------
# reference sources: cached columns, adapters disabled
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [DPOLoss, IPOLoss])
def test_cached_reference_equals_live_reference(policy, ref, pairs, cls):
    reduction = cls().logp_reduction
    cached = cache_reference_log_probs(ref, pairs, batch_size=4, reduction=reduction)
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(cached.column_names)
    rows = [cached[i] for i in range(len(cached))]

    live_loss, live_m = cls(beta=0.3, ref_model=ref)(policy, PreferenceCollator(PAD)(pairs))
    live_g = torch.autograd.grad(live_loss, list(policy.parameters()))
    cache_loss, cache_m = cls(beta=0.3)(policy, PreferenceCollator(PAD)(rows))
    cache_g = torch.autograd.grad(cache_loss, list(policy.parameters()))
    assert cache_loss.item() == pytest.approx(live_loss.item(), abs=1e-6)
    for k in live_m:
        assert float(cache_m[k]) == pytest.approx(float(live_m[k]), abs=1e-5), k
    for a, b in zip(live_g, cache_g):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cached_reference_with_wrong_reduction_is_refused(policy, ref, pairs):
    cached = cache_reference_log_probs(ref, pairs, reduction="sum")
    rows = [cached[i] for i in range(len(cached))]
    with pytest.raises(ValueError, match="'sum'-reduced"):
        IPOLoss()(policy, PreferenceCollator(PAD)(rows))  # IPO averages by default


def test_kto_cached_reference_equals_live_reference(policy, kto_feats):
    ref = sharpened(policy)
    cached = cache_reference_log_probs(ref, kto_feats, batch_size=3)
    assert {"ref_logps", "ref_kl_logps", "kl_input_ids"} <= set(cached.column_names)
    rows = [cached[i] for i in range(len(cached))]
    # The whole dataset in order as one batch: in-batch pairs (i, i+1 mod B) are then exactly
    # the dataset-level pairs the cache fixed, so both paths compute the same loss.
    live_loss, live_m = KTOLoss(ref_model=ref)(policy, KTOCollator(PAD)(kto_feats))
    live_g = torch.autograd.grad(live_loss, list(policy.parameters()))
    cache_loss, cache_m = KTOLoss()(policy, KTOCollator(PAD)(rows))
    cache_g = torch.autograd.grad(cache_loss, list(policy.parameters()))
    assert cache_loss.item() == pytest.approx(live_loss.item(), abs=1e-6)
    assert float(live_m["kl"]) > 0.05
    assert float(cache_m["kl"]) == pytest.approx(float(live_m["kl"]), abs=1e-5)
    for a, b in zip(live_g, cache_g):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def lora_policy(tiny_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    # init_lora_weights=False: non-zero B, so the adapted policy differs from the base model.
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return get_peft_model(base, config)


@pytest.mark.parametrize("cls", [DPOLoss, KTOLoss])
def test_disabled_adapters_equal_a_separate_base_model(tiny_dir, pairs, kto_feats, cls):
    peft_model = lora_policy(tiny_dir)
    peft_model.train()
    base_copy = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    batch = PreferenceCollator(PAD)(pairs) if cls is DPOLoss else KTOCollator(PAD)(kto_feats)
    adapter_loss, adapter_m = cls(beta=0.3)(peft_model, batch)
    copy_loss, copy_m = cls(beta=0.3, ref_model=base_copy)(peft_model, batch)
    assert adapter_loss.item() == pytest.approx(copy_loss.item(), abs=1e-6)
    for k in copy_m:
        assert float(adapter_m[k]) == pytest.approx(float(copy_m[k]), abs=1e-5), k
    # The adapters are back on and the policy is still training after the reference forward.
    assert peft_model.training
    assert float(copy_m["rewards/chosen"]) != 0.0


def test_dpo_without_any_reference_fails_at_setup(tiny_dir, tokenizer, pairs, tmp_path):
    from grimoire import GrimoireTrainer, TrainingConfig

    config = TrainingConfig(
        output_dir=str(tmp_path),
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        batch_size=2,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ConfigError, match="needs reference log-probs"):
        GrimoireTrainer(model, tokenizer, config, DPOLoss(), pairs)


# ------------------------------------------------------------------------------------------------
# set-up through GrimoireTrainer
# ------------------------------------------------------------------------------------------------


def trainer_config(tmp_path, **overrides):
    from grimoire import TrainingConfig

    settings = dict(
        output_dir=str(tmp_path),
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
    )
    settings.update(overrides)
    return TrainingConfig(**settings)


def test_trainer_lora_dpo_uses_the_base_model_as_reference(tiny_dir, tokenizer, pairs, tmp_path):
    from peft import LoraConfig

    from grimoire import GrimoireTrainer

    loss_fn = DPOLoss(beta=0.5)
    trainer = GrimoireTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        trainer_config(tmp_path),
        loss_fn,
        pairs,
        pairs,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert loss_fn.reference._peft_model is trainer.unwrapped_model
    before = trainer.evaluate()
    # Fresh LoRA (B = 0): the adapted policy IS the base model, so every reward is exactly 0.
    assert before["eval/rewards/chosen"] == 0.0 and before["eval/rewards/margins"] == 0.0
    trainer.train()
    after = trainer.evaluate()
    assert after["eval/rewards/chosen"] != 0.0  # the adapters moved away from the reference


def test_trainer_with_cached_reference_needs_no_ref_model(tiny_dir, tokenizer, pairs, tmp_path):
    from grimoire import GrimoireTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cached = cache_reference_log_probs(model, pairs, batch_size=3)
    trainer = GrimoireTrainer(model, tokenizer, trainer_config(tmp_path), DPOLoss(), cached, cached)
    before = trainer.evaluate()
    assert before["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # cached from itself
    trainer.train()
    assert trainer.evaluate()["eval/rewards/margins"] != pytest.approx(0.0, abs=1e-5)

    ipo_cached = cache_reference_log_probs(model, pairs, reduction="sum")
    with pytest.raises(ConfigError, match="re-run cache_reference_log_probs"):
        GrimoireTrainer(model, tokenizer, trainer_config(tmp_path), IPOLoss(), ipo_cached)


def test_trainer_freezes_and_casts_the_ref_model(tiny_dir, tokenizer, pairs, tmp_path):
    from grimoire import GrimoireTrainer

    ref = AutoModelForCausalLM.from_pretrained(tiny_dir).to(torch.bfloat16).train()
    loss_fn = DPOLoss(ref_model=ref)
    GrimoireTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        trainer_config(tmp_path),
        loss_fn,
        pairs,
    )
    ref = loss_fn.ref_model
    assert not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert {p.dtype for p in ref.parameters()} == {torch.float32}  # the policy's dtype


def test_trainer_rejects_kto_batch_size_one_and_bad_reward_heads(
    tiny_dir, tokenizer, pairs, kto_feats, tmp_path
):
    from grimoire import GrimoireTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ConfigError, match="batch_size >= 2"):
        GrimoireTrainer(
            model,
            tokenizer,
            trainer_config(tmp_path, batch_size=1),
            KTOLoss(ref_model=copy.deepcopy(model)),
            kto_feats,
        )
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=1"):
        GrimoireTrainer(classifier, tokenizer, trainer_config(tmp_path), RewardModelLoss(), pairs)
