"""A ``PeftModel`` passed as ``model=`` (no ``peft_config``) uses its base with adapters disabled
as the reference, exactly as ``base + peft_config`` does (issue #14).

Both runs start from the same LoRA weights (the trainer builds its adapter right after
``set_seed(config.seed)``; the direct one is built after the same call) and must log the same
losses step by step. The reference itself is checked against the base model's log-probs from a
plain full-logits ``log_softmax`` on an independent copy of the base weights, after the adapters
were made non-trivial (so a reference that kept them on would differ).
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.utils import set_seed
from peft import LoraConfig, PeftModel, get_peft_model
from tests.helpers.train_utils import RecordLosses, quiet_config
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.collate.preference import PreferenceCollator
from grimoire.losses.dpo import DPOLoss
from grimoire.losses.ipo import IPOLoss
from grimoire.losses.kto import KTOLoss
from grimoire.model.tiny import kto_rows, preference_rows
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import tokenize_preference

MAX_LEN = 48
SEED = 7


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return [tokenize_preference(r, tokenizer, MAX_LEN) for r in preference_rows(8, seed=5)]


def _train(tiny_dir, tokenizer, tmp_path, loss, rows, direct: bool, **cfg):
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    config = quiet_config(
        tmp_path, max_steps=3, seed=SEED, learning_rate=2e-2, disable_dropout=True, **cfg
    )
    record = RecordLosses()
    if direct:
        set_seed(SEED)
        model, peft_config = get_peft_model(base, lora()), None
    else:
        model, peft_config = base, lora()
    trainer = GrimoireTrainer(
        model, tokenizer, config, loss, rows, peft_config=peft_config, callbacks=[record]
    )
    assert trainer.loss_fn.reference.source == "adapters"
    start = {k: v.detach().clone() for k, v in trainer.unwrapped_model.named_parameters()}
    trainer.train()
    return record.records, start


@pytest.mark.parametrize("make_loss", [lambda: DPOLoss(beta=0.5), lambda: IPOLoss(beta=0.5)])
def test_peft_model_as_model_trains_like_peft_config(
    tiny_dir, tokenizer, pairs, tmp_path, make_loss
):
    direct, start_d = _train(tiny_dir, tokenizer, tmp_path / "d", make_loss(), pairs, True)
    wrapped, start_w = _train(tiny_dir, tokenizer, tmp_path / "w", make_loss(), pairs, False)
    assert start_d.keys() == start_w.keys()
    for name in start_d:  # the same LoRA init, so the runs must agree step by step
        torch.testing.assert_close(start_d[name], start_w[name])
    for a, b in zip(direct, wrapped, strict=True):
        for key in ("loss", "rewards/margins", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert abs(direct[-1]["rewards/margins"]) > 1e-4  # the adapters moved away from the base


def _naive_logps(model, ids, mask, labels) -> torch.Tensor:
    """Summed log-probs of ``labels`` from the full logits (no fused head, no chunking)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    logps = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return (logps * keep).sum(-1)


@pytest.mark.parametrize("with_precompute", [False, True])
def test_reference_of_a_peft_model_is_its_base(
    tiny_dir, tokenizer, pairs, tmp_path, with_precompute
):
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    independent = copy.deepcopy(base).eval()
    set_seed(SEED)
    policy = get_peft_model(base, lora())
    with torch.no_grad():  # adapters that change the output: a reference using them would differ
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.3)
    assert isinstance(policy, PeftModel)
    loss = DPOLoss(beta=0.5)
    config = quiet_config(tmp_path, precompute_ref_log_probs=with_precompute)
    trainer = GrimoireTrainer(policy, tokenizer, config, loss, pairs)
    batch = PreferenceCollator(tokenizer.pad_token_id)(list(trainer.train_dataset))
    with torch.no_grad():
        rc, rr = loss.reference_logps(trainer.model, batch)
        base_c = _naive_logps(
            independent,
            batch["chosen_input_ids"],
            batch["chosen_attention_mask"],
            batch["chosen_labels"],
        )
        base_r = _naive_logps(
            independent,
            batch["rejected_input_ids"],
            batch["rejected_attention_mask"],
            batch["rejected_labels"],
        )
        with_adapters = _naive_logps(
            policy,
            batch["chosen_input_ids"],
            batch["chosen_attention_mask"],
            batch["chosen_labels"],
        )
    torch.testing.assert_close(rc.float(), base_c, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rr.float(), base_r, rtol=1e-5, atol=1e-4)
    assert (with_adapters - base_c).abs().max() > 1e-2  # the check can tell them apart


def test_peft_model_as_model_for_kto(tiny_dir, tokenizer, tmp_path):
    rows = [tokenize_kto(r, tokenizer, MAX_LEN) for r in kto_rows(8, seed=6)]
    direct, _ = _train(tiny_dir, tokenizer, tmp_path / "d", KTOLoss(beta=0.5), rows, True)
    wrapped, _ = _train(tiny_dir, tokenizer, tmp_path / "w", KTOLoss(beta=0.5), rows, False)
    for a, b in zip(direct, wrapped, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-6)
