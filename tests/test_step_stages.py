"""The step's stages, observed: one collective per optimizer step on 2 processes; the rollout
stage never samples for rank-sync dummies and keeps them out of step statistics; one reference
component with explicit sources and no silent copy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port, quiet_config
from tests.test_distributed import LAUNCH, _env
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.errors import ConfigError
from grimoire.losses import DPOLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.online_dpo import OnlineDPOMethod
from grimoire.losses.rloo import RLOOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rows.prompts import tokenize_grpo

SCRIPT = Path(__file__).parent / "scripts" / "count_collectives.py"


def test_one_collective_per_optimizer_step(tiny_dir, tmp_path):
    cmd = [*LAUNCH, "--main_process_port", str(free_port()), str(SCRIPT), str(tiny_dir)]
    subprocess.run([*cmd, str(tmp_path)], check=True, env=_env(), timeout=300)
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(steps) == 4
        # The first step also agrees on the metric keys (one gather, one more reduce).
        assert steps[0].get("all_reduce", 0) <= 2
        for counts in steps[1:]:
            assert counts == {"all_reduce": 1}, counts


def _rewards(prompts, completions, **kw):
    return [len(c) + (sum(map(ord, c)) % 7) / 7 for c in completions]


def test_dummies_are_not_sampled_nor_counted(tiny_dir, tokenizer, tmp_path):
    """5 prompts, 2 per micro-batch, 2 micro-batches per step: step 2 holds one real prompt
    and one dummy. The dummy is never sampled, and the batch std of step 2 is that of the
    real group's rewards alone."""
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(5, seed=3)]
    method = GRPOMethod([_rewards], num_generations=3, max_new_tokens=4, scale_rewards="batch")
    sampled, steps = [], []
    generate, build = method.engine.generate, method.build_batches

    def counting_generate(prompts, n, **kw):
        sampled.append(len(prompts))
        return generate(prompts, n, **kw)

    def recording_build(ctx, groups):
        out, metrics = build(ctx, groups)
        steps.append(([g.rewards.clone() for g in groups], [b["advantages"] for b in out]))
        return out, metrics

    method.engine.generate = counting_generate
    method.build_batches = recording_build
    config = quiet_config(tmp_path, batch_size=2, gradient_accumulation_steps=2, num_epochs=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    GrimoireTrainer(model, tokenizer, config, method, rows).train()
    assert sampled == [2, 2, 1]  # 5 prompts sampled once each; the dummy never
    rewards, advantages = steps[1]
    assert len(rewards) == 1  # step 2's statistics see the one real group only
    r = rewards[0].double()
    expected = (r - r.mean()) / (r.std() + 1e-4)
    torch.testing.assert_close(advantages[0].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: GRPOMethod([_rewards], num_generations=2, max_new_tokens=3, beta=0.1),
        lambda: RLOOMethod([_rewards], num_generations=2, max_new_tokens=3),
        lambda: OnlineDPOMethod([_rewards], num_generations=2, max_new_tokens=3),
        lambda: DPOLoss(),
    ],
    ids=["grpo", "rloo", "online_dpo", "dpo"],
)
def test_a_missing_reference_is_named_not_copied(make, tiny_model, tokenizer, tmp_path):
    from grimoire.data import tokenize_preference
    from grimoire.model.tiny import preference_rows

    method = make()
    if isinstance(method, DPOLoss):
        rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(4, 1)]
    else:
        rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(4, seed=1)]
    with pytest.raises(ConfigError) as err:
        GrimoireTrainer(tiny_model, tokenizer, quiet_config(tmp_path), method, rows)
    msg = str(err.value)
    assert "has no source" in msg and "ref_model='copy'" in msg and "LoraConfig" in msg


def test_ref_model_copy_is_frozen_and_starts_equal(tiny_model, tokenizer, tmp_path):
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(4, seed=1)]
    method = GRPOMethod([_rewards], num_generations=2, max_new_tokens=3, beta=0.1, ref_model="copy")
    trainer = GrimoireTrainer(tiny_model, tokenizer, quiet_config(tmp_path), method, rows)
    ref = method.reference.ref_model
    assert method.reference.source == "copy" and ref is not trainer.unwrapped_model
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    for (name, a), b in zip(trainer.unwrapped_model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="ref_model must be a model, 'copy' or None"):
        GRPOMethod([_rewards], ref_model="base")
