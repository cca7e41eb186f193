"""Padding-free micro-batches for KTO and the online methods' training passes: packed rows give
the padded loss, metrics and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers.train_utils import method_context, quiet_config, train
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.collate.kto import KTOCollator, PackedKTOCollator
from grimoire.collate.prompts import GRPOCollator
from grimoire.contract.layout import Packed, layout_of
from grimoire.data import cache_reference_log_probs, tokenize_kto
from grimoire.losses import KTOLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_model, kto_rows, reverse_rows
from grimoire.rollout.batches import pack_rollout_batch
from grimoire.rows.prompts import tokenize_grpo
from grimoire.training.setup import build_rollouts

PAD = 0


@pytest.fixture(scope="module")
def kto_feats(tokenizer) -> list[dict]:
    rows = [tokenize_kto(r, tokenizer, max_length=64) for r in kto_rows(6, seed=11)]
    assert len({r["label"] for r in rows}) == 2, "both classes, so both loss branches run"
    return rows


def _sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """The policy with 3x logits as reference: the mismatched pairs' KL estimate is clearly
    positive, so z0 (clamped at 0 otherwise) checks that both layouts use the same pairs."""
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref.model.norm.weight.mul_(3.0)
    return ref


def _loss_and_grads(loss_fn, policy, batch):
    policy.zero_grad()
    loss, metrics = loss_fn(policy, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return loss.detach(), metrics, grads


def _assert_same(padded, packed) -> None:
    (l0, m0, g0), (l1, m1, g1) = padded, packed
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=0)
    assert m1.keys() == m0.keys()
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], atol=1e-5, rtol=0, msg=k)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)


def test_packed_kto_layout(kto_feats):
    """Completions first, then their KL pairs (the padded collator's pairs), one packed row."""
    padded = KTOCollator(PAD)(kto_feats)
    packed = PackedKTOCollator(PAD)(kto_feats)
    b = len(kto_feats)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    assert list(layout_of(packed).seq_lens) == (
        padded["attention_mask"].sum(-1).tolist() + padded["kl_attention_mask"].sum(-1).tolist()
    )
    assert torch.equal(packed["label"], padded["label"]) and packed["label"].dtype == torch.bool
    assert KTOLoss().loss_weight(packed) == KTOLoss().loss_weight(padded) == b


def test_packed_kto_matches_padded_live_reference(kto_feats):
    policy = build_model("llama", vocab_size=64, seed=1)
    ref = _sharpened(policy)
    results = [
        _loss_and_grads(KTOLoss(beta=0.1, ref_model=ref), policy, collator(kto_feats))
        for collator in (KTOCollator(PAD), PackedKTOCollator(PAD))
    ]
    assert float(results[0][1]["kl"]) > 0, "a non-trivial KL reference point"
    _assert_same(*results)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_packed_kto_matches_padded_cached_reference(kto_feats, reduction):
    """Dataset-level pairs and cached reference columns travel through the packed collator."""
    policy = build_model("llama", vocab_size=64, seed=1)
    ref = _sharpened(policy)
    cached = cache_reference_log_probs(ref, kto_feats, batch_size=4, reduction=reduction)
    rows = [cached[i] for i in range(len(cached))][::-1]  # not the in-batch pairing order
    packed = PackedKTOCollator(PAD)(rows)
    assert packed["ref_logps"].shape == (len(rows),)
    make = lambda: KTOLoss(beta=0.1, logp_reduction=reduction)  # noqa: E731 - no ref_model
    results = [_loss_and_grads(make(), policy, batch) for batch in (KTOCollator(PAD)(rows), packed)]
    _assert_same(*results)
    # And the cache agrees with the live reference on the packed layout too.
    live = _loss_and_grads(
        KTOLoss(beta=0.1, ref_model=ref, logp_reduction=reduction), policy, packed
    )
    torch.testing.assert_close(live[0], results[1][0], atol=1e-5, rtol=0)


def test_kto_trains_with_token_budget(tiny_dir, tokenizer, kto_feats, tmp_path):
    rows = [tokenize_kto(r, tokenizer, max_length=64) for r in kto_rows(16, seed=3)]
    trainer = train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        KTOLoss(ref_model=AutoModelForCausalLM.from_pretrained(tiny_dir)),
        quiet_config(tmp_path, max_steps=2, batch_size=8, max_tokens_per_device=64),
    )
    assert trainer.global_step == 2
    assert isinstance(trainer.collator, PackedKTOCollator)
    assert trainer.collator.max_length == trainer.config.max_length
    assert len(trainer.planner.plan(0, 0)) > 1, "the budget must split the step"


# ------------------------------------------------------------------ online methods


def _length_reward(prompts, completions, **kwargs):
    return [float(len(c)) / 8 for c in completions]


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_packed_grpo_pass_matches_padded(tiny_model, tokenizer, temperature):
    """One rollout, built once padded and then packed: same reference log-probs, loss, metrics
    and gradients (prompts are left-padded, completions right-padded, of different lengths)."""

    torch.manual_seed(0)
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(4, seed=5)]
    method = GRPOMethod(
        [_length_reward],
        num_generations=4,
        max_new_tokens=6,
        temperature=temperature,
        beta=0.1,
        num_iterations=2,
        loss_type="dapo",
        ref_model="copy",
    )
    ctx = method_context(method, tiny_model, tokenizer, rows)
    assert not ctx.packed  # the stage hands the method padded rows and keeps them padded
    prompts = GRPOCollator(tokenizer.pad_token_id)(rows[:2])
    padded = build_rollouts(method, ctx).step(ctx, [(prompts, 1.0)])[0][0][0]
    # The tiny model rarely samples EOS: end some completions early (as EOS would) so the
    # samples differ in completion length too, then redo the padded reference pass.
    c = padded["completion_mask"].shape[1]
    for i in range(padded["completion_mask"].shape[0]):
        end = c - i % 4
        padded["completion_mask"][i, end:] = 0
        padded["attention_mask"][i, padded["attention_mask"].shape[1] - c + end :] = 0
    (padded["ref_logps"],) = method.reference_logps(tiny_model, padded)
    lens = padded["completion_mask"].sum(-1)
    assert lens.min() < lens.max() and (padded["attention_mask"][:, 0] == 0).any()
    packed = pack_rollout_batch(padded)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    # The reference pass on the packed layout reproduces the padded one's.
    torch.testing.assert_close(
        method.reference_logps(tiny_model, packed)[0], padded["ref_logps"], atol=1e-5, rtol=0
    )
    # Move the policy so ratio != 1 and the KL term is non-zero.
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    tiny_model.eval()
    results = [_loss_and_grads(method, tiny_model, b) for b in (padded, packed)]
    assert method.loss_weight(packed) == method.loss_weight(padded)
    _assert_same(*results)


def test_grpo_trains_padding_free(tiny_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(8, seed=2)]
    method = GRPOMethod(
        [_length_reward],
        num_generations=4,
        max_new_tokens=6,
        beta=0.04,
        num_iterations=2,
        ref_model="copy",
    )
    seen: list[dict] = []
    compute = method.compute_loss

    def recording_loss(model, batch):  # the training batches the loss is given
        seen.append(batch)
        return compute(model, batch)

    method.compute_loss = recording_loss
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer=tokenizer,
        config=quiet_config(tmp_path, max_steps=2, batch_size=2, padding_free=True),
        loss_fn=method,
        train_dataset=rows,
    )
    trainer.train()
    assert trainer.global_step == 2
    assert seen and all(
        isinstance(layout_of(b), Packed) and b["input_ids"].shape[0] == 1 for b in seen
    )
