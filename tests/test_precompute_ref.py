"""``precompute_ref_log_probs``: one reference pass before training, then cached columns only.

Parity: in fp32 a run with the precomputed reference takes the same steps as one with the live
reference (same losses and metrics, step by step). KTO's live run uses the same dataset-level KL
pairs as the cache (in-batch pairs depend on the batching, so no cache can hold them). The
reference model must not run once training starts (a forward hook counts its calls), and the
cached values must equal those of ``cache_reference_log_probs``, an independent batching path.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, quiet_config
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.errors import ConfigError
from grimoire.forward.precomputed import cache_reference_log_probs, with_kl_pairs
from grimoire.losses.dpo import DPOLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.ipo import IPOLoss
from grimoire.losses.kto import KTOLoss
from grimoire.losses.sft import SFTLoss
from grimoire.model.tiny import kto_rows, preference_rows, reverse_rows
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import tokenize_preference
from grimoire.rows.prompts import tokenize_grpo

MAX_LEN = 48


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return [tokenize_preference(r, tokenizer, MAX_LEN) for r in preference_rows(12, seed=5)]


@pytest.fixture(scope="module")
def kto(tokenizer):
    return [tokenize_kto(r, tokenizer, MAX_LEN) for r in kto_rows(12, seed=6)]


def _counting(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _run(tiny_dir, tokenizer, tmp_path, make_loss, rows, eval_rows=None, **cfg):
    """Train 3 steps with a fresh policy and a fresh explicit reference; returns the logged
    records, the reference's forward calls during ``train()`` only, and the trainer."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir)
    calls = _counting(ref)
    record = RecordLosses()
    config = quiet_config(tmp_path, max_steps=3, learning_rate=5e-3, disable_dropout=True, **cfg)
    trainer = GrimoireTrainer(
        policy, tokenizer, config, make_loss(ref), rows, eval_dataset=eval_rows, callbacks=[record]
    )
    before = calls[0]
    trainer.train()
    return record.records, calls[0] - before, before, trainer


def _assert_same_steps(live, cached, keys):
    assert len(live) == len(cached) == 3
    for a, b in zip(live, cached):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize(
    "layout",
    [{}, {"max_tokens_per_device": 160}],  # padded; packed within a token budget
    ids=["padded", "packed-budget"],
)
def test_dpo_precompute_matches_live_reference(tiny_dir, tokenizer, pairs, tmp_path, layout):
    loss = lambda ref: DPOLoss(beta=0.5, ref_model=ref)  # noqa: E731
    live, live_calls, _, _ = _run(tiny_dir, tokenizer, tmp_path / "live", loss, pairs, **layout)
    cached, train_calls, setup_calls, trainer = _run(
        tiny_dir, tokenizer, tmp_path / "pre", loss, pairs, precompute_ref_log_probs=True, **layout
    )
    assert live_calls > 0 and setup_calls > 0  # the reference ran: live per step, cached once
    assert train_calls == 0
    assert trainer.loss_fn.reference.ref_model is None  # released
    _assert_same_steps(live, cached, ["loss", "rewards/margins", "rewards/chosen", "grad_norm"])
    # A nonzero margin after step 1 shows the reference values are really in use.
    assert abs(cached[-1]["rewards/margins"]) > 1e-4


def test_kto_precompute_matches_live_reference_with_the_same_kl_pairs(
    tiny_dir, tokenizer, kto, tmp_path
):
    loss = lambda ref: KTOLoss(beta=0.5, ref_model=ref)  # noqa: E731
    fixed = with_kl_pairs(kto, MAX_LEN)  # what precompute trains on; the live run reads it too
    live, live_calls, _, _ = _run(
        tiny_dir, tokenizer, tmp_path / "live", loss, fixed, max_length=MAX_LEN
    )
    cached, train_calls, _, trainer = _run(
        tiny_dir,
        tokenizer,
        tmp_path / "pre",
        loss,
        kto,
        eval_rows=kto[:6],
        max_length=MAX_LEN,
        precompute_ref_log_probs=True,
    )
    assert live_calls > 0 and train_calls == 0
    _assert_same_steps(live, cached, ["loss", "kl", "rewards/chosen", "grad_norm"])
    assert {"ref_logps", "ref_kl_logps"} <= set(trainer.eval_dataset.column_names)
    assert trainer.evaluate()["eval/loss"] > 0  # evaluation reads the eval split's cache


def test_cached_columns_equal_cache_reference_log_probs(tiny_dir, tokenizer, pairs, tmp_path):
    """The trainer's pass (budgeted, packed) against the CLI's helper (padded batches of 8)."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir)
    expected = cache_reference_log_probs(ref, pairs, reduction="mean")
    trainer = GrimoireTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        quiet_config(tmp_path, precompute_ref_log_probs=True, padding_free=True),
        IPOLoss(beta=0.1),  # no ref_model: the untrained policy itself, mean-reduced
        pairs,
    )
    got = trainer.train_dataset
    assert trainer.loss_fn.reference.source == "cached"
    assert got["ref_logps_reduction"][0] == "mean"
    for col in ("ref_chosen_logps", "ref_rejected_logps"):
        assert got[col] == pytest.approx(expected[col], rel=1e-5, abs=1e-5)


def test_online_and_reference_free_methods_are_refused(tiny_dir, tokenizer, tmp_path, sft_rows):
    prompts = [tokenize_grpo(r, tokenizer, max_length=MAX_LEN) for r in reverse_rows(4, seed=1)]
    grpo = GRPOMethod(
        ["char_match"], num_generations=2, max_new_tokens=4, beta=0.04, ref_model="copy"
    )
    config = quiet_config(tmp_path, precompute_ref_log_probs=True, batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ConfigError, match="GRPOMethod is an online method"):
        GrimoireTrainer(model, tokenizer, config, grpo, prompts)
    with pytest.raises(ConfigError, match="SFTLoss uses no reference model"):
        GrimoireTrainer(model, tokenizer, config, SFTLoss(), sft_rows)
