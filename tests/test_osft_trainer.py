"""OSFT inside the training loop: frozen subspace kept, dense save, exact resume, LoRA refused."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, quiet_config, train
from tests.test_trainer import _StopAt
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.model.osft import OSFTLinear

OSFT = dict(osft=True, osft_unfreeze_rank_ratio=0.5, learning_rate=5e-3)


def test_trainer_keeps_frozen_subspace_and_saves_dense(tiny_dir, tokenizer, sft_rows, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    original = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ("self_attn" in n or "mlp" in n)
    }
    trainer = train(
        model, tokenizer, sft_rows[:16], SFTLoss(), quiet_config(tmp_path, max_steps=3, **OSFT)
    )
    modules = {
        n: m for n, m in trainer.unwrapped_model.named_modules() if isinstance(m, OSFTLinear)
    }
    assert set(modules) == set(original)
    changed = 0.0
    for name, m in modules.items():
        w = m.merged_weight()
        # The frozen singular triplets are still singular triplets of the trained weight.
        torch.testing.assert_close(m.U_h.T @ w, torch.diag(m.S_h) @ m.V_h.T, atol=1e-5, rtol=0)
        torch.testing.assert_close(w @ m.V_h, m.U_h * m.S_h, atol=1e-5, rtol=0)
        assert m.U_h.shape[1] == min(w.shape) // 2
        changed = max(changed, float((w - original[name]).abs().max()))
    assert changed > 1e-4, "training must change the low subspace"

    out = trainer.save_model(tmp_path / "final")
    dense = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([sft_rows[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(
            dense(input_ids=ids).logits,
            trainer.unwrapped_model(input_ids=ids).logits,
            atol=1e-5,
            rtol=1e-5,
        )


def test_osft_resume_is_exact(tiny_dir, tokenizer, sft_rows, tmp_path):
    def model():
        return AutoModelForCausalLM.from_pretrained(tiny_dir)

    cfg = dict(max_steps=4, **OSFT)
    full = RecordLosses()
    train(
        model(),
        tokenizer,
        sft_rows[:32],
        SFTLoss(),
        quiet_config(tmp_path / "full", **cfg),
        callbacks=[full],
    )
    train(
        model(),
        tokenizer,
        sft_rows[:32],
        SFTLoss(),
        quiet_config(tmp_path / "part", save_steps=2, **cfg),
        callbacks=[_StopAt(2)],
    )
    resumed = RecordLosses()
    train(
        model(),
        tokenizer,
        sft_rows[:32],
        SFTLoss(),
        quiet_config(tmp_path / "part", resume_from_checkpoint="latest", **cfg),
        callbacks=[resumed],
    )
    assert resumed.losses == full.losses[2:]


def test_osft_with_lora_is_refused(tiny_model, tokenizer, sft_rows, tmp_path):
    from peft import LoraConfig

    with pytest.raises(ConfigError, match="OSFT and LoRA cannot be combined"):
        GrimoireTrainer(
            model=tiny_model,
            tokenizer=tokenizer,
            loss_fn=SFTLoss(),
            train_dataset=sft_rows[:4],
            config=quiet_config(tmp_path, **OSFT),
            peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
        )


def test_osft_with_dpo_and_grpo_grad_accum_and_bf16(tiny_dir, tokenizer, tmp_path):
    """OSFT is a step hook: it composes with any method, accumulation and mixed precision."""
    from grimoire.data import tokenize_grpo, tokenize_preference
    from grimoire.losses import DPOLoss, GRPOMethod
    from grimoire.model.tiny import preference_rows, reverse_rows

    pairs = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(8, seed=1)]
    prompts = [tokenize_grpo(r, tokenizer, max_length=32) for r in reverse_rows(8, seed=2)]
    cases = [
        (pairs, DPOLoss(ref_model=AutoModelForCausalLM.from_pretrained(tiny_dir))),
        (prompts, GRPOMethod(reward_funcs=["char_match"], num_generations=4, max_new_tokens=6)),
    ]
    for i, (rows, loss) in enumerate(cases):
        trainer = train(
            AutoModelForCausalLM.from_pretrained(tiny_dir),
            tokenizer,
            rows,
            loss,
            quiet_config(
                tmp_path / str(i),
                max_steps=2,
                batch_size=2,
                gradient_accumulation_steps=2,
                mixed_precision="bf16",
                **OSFT,
            ),
        )
        assert trainer.global_step == 2
        for m in trainer.unwrapped_model.modules():
            if isinstance(m, OSFTLinear):
                torch.testing.assert_close(
                    m.U_h.T @ m.merged_weight(), torch.diag(m.S_h) @ m.V_h.T, atol=1e-5, rtol=0
                )
