"""Padding-free training: packed rows, token budgets and pretrain blocks give the padded result."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.train_utils import quiet_config, train
from transformers import AutoModelForCausalLM

from grimoire.collate.packing import pack_samples, segment_sum
from grimoire.contract.layout import layout_of
from grimoire.data import SFTCollator
from grimoire.errors import DataError
from grimoire.forward.logprobs import compute_token_logps
from grimoire.losses import SFTLoss
from grimoire.model.tiny import build_model
from grimoire.rows.pretokenized import pretrain_blocks, tokenize_pretokenized

SGD = dict(optimizer="sgd", learning_rate=0.5, weight_decay=0.0, max_grad_norm=None, max_steps=1)


def _one_step(tiny_dir, tokenizer, rows, tmp_path, **cfg):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    return train(model, tokenizer, rows, SFTLoss(), quiet_config(tmp_path, **{**SGD, **cfg}))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_packed_logps_equal_padded(arch, sft_rows):
    """No cross-sample attention and no cross-sample label: per-sequence sums match padding."""
    model = build_model(arch, vocab_size=64)
    rows = sft_rows[:6]
    padded = SFTCollator(0)(rows)
    want = compute_token_logps(
        model, padded["input_ids"], padded["labels"], padded["attention_mask"], fused=False
    ).sum()
    packed = pack_samples(rows, 0)
    out = compute_token_logps(
        model,
        packed["input_ids"],
        packed["labels"],
        position_ids=packed["position_ids"],
        fused=False,
    )
    got = segment_sum(out.logps, packed["sample_index"], len(rows))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Every sample's first token is never a target (it would be predicted from the previous one).
    starts = torch.tensor(packed["layout"].cu_seqlens[1:-1])
    assert not out.mask[0, starts - 1].any()


def test_padding_free_step_equals_padded_step(tiny_dir, tokenizer, sft_rows, tmp_path):
    rows = sft_rows[:8]
    padded = _one_step(tiny_dir, tokenizer, rows, tmp_path / "pad", batch_size=8)
    packed = _one_step(
        tiny_dir, tokenizer, rows, tmp_path / "pack", batch_size=8, padding_free=True
    )
    budget = _one_step(
        tiny_dir, tokenizer, rows, tmp_path / "budget", batch_size=8, max_tokens_per_device=48
    )
    assert budget.planner.plan(0, 0).__len__() > 1, "the budget must split the step"
    for name, p in padded.unwrapped_model.named_parameters():
        torch.testing.assert_close(packed.unwrapped_model.get_parameter(name), p, atol=2e-6, rtol=0)
        torch.testing.assert_close(budget.unwrapped_model.get_parameter(name), p, atol=2e-6, rtol=0)


def test_opt_in_truncation_to_budget(tiny_dir, tokenizer, sft_rows, tmp_path):
    budget = 22
    rows = sft_rows[:8]
    assert max(len(r["input_ids"]) for r in rows) > budget, "some rows must need cutting"
    trainer = _one_step(
        tiny_dir,
        tokenizer,
        rows,
        tmp_path,
        batch_size=8,
        max_tokens_per_device=budget,
        truncate_long_samples=True,
    )
    assert trainer.global_step == 1
    micro = [trainer.loader.collate(m, True)[0] for m in trainer.planner.plan(0, 0)]
    assert max(b["input_ids"].shape[1] for b in micro) <= budget
    kept = sum(layout_of(b).num_tokens for b in micro)
    assert kept < sum(len(r["input_ids"]) for r in rows)


def test_truncation_that_would_train_nothing_is_an_error(tiny_dir, tokenizer, sft_rows, tmp_path):
    with pytest.raises(DataError) as err:
        _one_step(
            tiny_dir,
            tokenizer,
            sft_rows[:8],
            tmp_path,
            max_tokens_per_device=12,
            truncate_long_samples=True,
        )
    msg = str(err.value)
    assert "train row 1: cut to max_tokens_per_device=12" in msg
    assert "input_ids would have no trained token left" in msg


def test_pretokenized_rows_checked():
    row = tokenize_pretokenized({"input_ids": [1, 5, 6], "labels": [-100, 5, 6], "len": 3})
    assert row["labels"] == [-100, 5, 6] and row["attention_mask"] == [1, 1, 1]
    assert tokenize_pretokenized({"input_ids": [1, 5]})["labels"] == [1, 5]
    with pytest.raises(DataError, match="'len' is 4"):
        tokenize_pretokenized({"input_ids": [1, 5, 6], "len": 4})
    with pytest.raises(DataError, match="'labels' has 2 entries"):
        tokenize_pretokenized({"input_ids": [1, 5, 6], "labels": [1, 2]})
    with pytest.raises(DataError, match="max_length=2"):
        tokenize_pretokenized({"input_ids": [1, 5, 6]}, max_length=2)


def test_pretrain_blocks_respect_document_boundaries():
    docs = [{"input_ids": [10, 11, 12]}, {"input_ids": [20, 21, 22, 23, 24]}, {"input_ids": [30]}]
    blocks = pretrain_blocks(docs, block_size=4)
    assert [b["input_ids"] for b in blocks] == [[10, 11, 12, 20], [21, 22, 23, 24], [30]]
    assert [b["position_ids"] for b in blocks] == [[0, 1, 2, 0], [0, 1, 2, 3], [0]]
    assert pretrain_blocks(docs, block_size=4, drop_last=True)[-1]["input_ids"] == [21, 22, 23, 24]


def test_pretrain_blocks_isolate_documents_in_padded_batches(sft_rows):
    """A block holding two documents gives each document the log-probs it has alone."""
    model = build_model("llama", vocab_size=64)
    a, b = sft_rows[0]["input_ids"], sft_rows[1]["input_ids"]
    (block,) = pretrain_blocks([{"input_ids": a}, {"input_ids": b}], block_size=len(a) + len(b))
    batch = SFTCollator(0)([block])
    assert "attention_mask" not in batch
    out = compute_token_logps(
        model, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"], fused=False
    )
    alone = compute_token_logps(model, torch.tensor([b]), torch.tensor([b]), fused=False)
    torch.testing.assert_close(out.logps[0, len(a) :], alone.logps[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss_name", ["dpo", "orpo", "simpo", "cpo"])
def test_packed_pairs_match_padded_pairs(loss_name, tokenizer):
    """Chosen and rejected as separate packed samples: same loss and gradients as padded."""
    from grimoire.collate.preference import PackedPairCollator
    from grimoire.data import PreferenceCollator, tokenize_preference
    from grimoire.losses import CPOLoss, DPOLoss, ORPOLoss, SimPOLoss
    from grimoire.model.tiny import preference_rows

    torch.manual_seed(0)
    policy = build_model("llama", vocab_size=64, seed=1)
    ref = build_model("llama", vocab_size=64, seed=2)
    make = {
        "dpo": lambda: DPOLoss(ref_model=ref),
        "orpo": ORPOLoss,
        "simpo": SimPOLoss,
        "cpo": CPOLoss,
    }[loss_name]
    rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(4, seed=7)]
    results = []
    for collator in (PreferenceCollator(0), PackedPairCollator(0)):
        policy.zero_grad()
        loss, metrics = make()(policy, collator(rows))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
        results.append((loss.detach(), metrics, grads))
    (l0, m0, g0), (l1, m1, g1) = results
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=0)
    torch.testing.assert_close(m1["logps/chosen"], m0["logps/chosen"], atol=1e-5, rtol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4)


def test_dpo_trains_padding_free_with_token_budget(tiny_dir, tokenizer, tmp_path):
    from grimoire.data import tokenize_preference
    from grimoire.losses import DPOLoss
    from grimoire.model.tiny import preference_rows

    rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(16, seed=3)]
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir)
    trainer = train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        DPOLoss(ref_model=ref),
        quiet_config(tmp_path, max_steps=2, batch_size=8, max_tokens_per_device=128),
    )
    assert trainer.global_step == 2
    assert len(trainer.planner.plan(0, 0)) > 1


def test_max_tokens_stops_after_that_many_input_tokens(tiny_model, tokenizer, sft_rows, tmp_path):
    per_step = []
    from grimoire import TrainerCallback

    class Count(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics):
            per_step.append(trainer.state.tokens_seen)

    trainer = train(
        tiny_model,
        tokenizer,
        sft_rows,
        SFTLoss(),
        quiet_config(tmp_path, max_steps=100, batch_size=4, max_tokens=200),
        callbacks=[Count()],
    )
    # Stops at the first step that reaches the budget, never later.
    assert per_step[-1] >= 200 and per_step[-2] < 200
    assert 2 <= trainer.global_step == len(per_step) < 100


def test_max_steps_runs_past_one_epoch_with_reshuffles(tiny_model, tokenizer, sft_rows, tmp_path):
    trainer = train(
        tiny_model,
        tokenizer,
        sft_rows[:8],
        SFTLoss(),
        quiet_config(tmp_path, max_steps=5, batch_size=4, num_epochs=1),
    )
    assert trainer.global_step == 5 and trainer.state.epoch == 2
    p = trainer.planner
    assert sorted(p.permutation(0)) == sorted(p.permutation(1)) == list(range(8))
    assert list(p.permutation(0)) != list(p.permutation(1))
