"""Online method classes on the tiny model: losses vs naive per-row references, bad input,
reference policies, dynamic sampling, rollout reuse over num_iterations, and the trainer path."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import weakref

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, method_context, quiet_config

from grimoire import GrimoireTrainer
from grimoire.collate.prompts import GRPOCollator
from grimoire.errors import ConfigError, DataError
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.online_dpo import OnlineDPOMethod
from grimoire.losses.raft import RAFTMethod
from grimoire.losses.rloo import RLOOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rollout.assembly import RolloutSettings
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rows.prompts import tokenize_grpo
from grimoire.training.setup import build_rollouts


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) / 8 for c in completions]


@pytest.fixture(scope="module")
def prompt_rows(tokenizer):
    return [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(16, seed=11)]


def _perturb(model, scale=0.02):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def _naive_token_logps(model, prompt, completion, temperature=1.0):
    """Unpadded single-row forward: log softmax(logits / T) of each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(completion)]


def _rows_of(batch):
    """(prompt ids, completion ids) of every training row, padding removed."""
    out = []
    width = batch["completion_mask"].shape[1]
    for ids, am, cm in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"]):
        p_ids, p_mask = ids[:-width], am[:-width]
        c = ids[-width:][cm.bool()].tolist()
        out.append((p_ids[p_mask.bool()].tolist(), c))
    return out


_STAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step(method, ctx, rows, tokenizer, n=4):
    """The rollout stage on one prompt micro-batch: ``(training batch, rollout metrics)``."""
    mb = GRPOCollator(tokenizer.pad_token_id)(rows[:n])
    if method not in _STAGES:  # one stage per method, as the trainer holds it (it caches rollouts)
        _STAGES[method] = build_rollouts(method, ctx)
    batches, metrics, _ = _STAGES[method].step(ctx, [(mb, 1.0)])
    return batches[0][0], metrics


# ------------------------------------------------------------------ losses vs naive references


def test_grpo_loss_matches_naive_reference(tiny_model, tokenizer, prompt_rows):
    torch.manual_seed(0)
    method = GRPOMethod(
        [length_reward],
        num_generations=4,
        max_new_tokens=5,
        temperature=0.8,
        beta=0.1,
        epsilon=0.2,
        epsilon_high=0.3,
        num_iterations=2,
        loss_type="dapo",
        ref_model="copy",
    )
    trainer = method_context(method, tiny_model, tokenizer, prompt_rows)
    batch, rollout_metrics = _step(method, trainer, prompt_rows, tokenizer, n=2)
    # Move the policy so ratio != 1 and the KL is non-zero (the reference is a frozen copy).
    _perturb(tiny_model)
    tiny_model.eval()
    loss, metrics = method(tiny_model, batch)
    rows = _rows_of(batch)
    rewards = [len(tokenizer.decode(c, skip_special_tokens=True)) / 8 for _, c in rows]
    num, den, clipped = 0.0, 0, 0
    for g in range(2):
        grp = rewards[4 * g : 4 * g + 4]
        mu = sum(grp) / 4
        std = math.sqrt(sum((x - mu) ** 2 for x in grp) / 3)
        for i in range(4 * g, 4 * g + 4):
            adv = (rewards[i] - mu) / (std + 1e-4)
            prompt, comp = rows[i]
            new = _naive_token_logps(tiny_model, prompt, comp, 0.8)
            cm = batch["completion_mask"][i].bool()
            old = batch["old_logps"][i][cm].tolist()
            ref = batch["ref_logps"][i][cm].tolist()
            for lp, lo, lr in zip(new, old, ref):
                ratio = math.exp(lp - lo)
                surrogate = min(ratio * adv, min(max(ratio, 0.8), 1.3) * adv)
                kl = math.exp(lr - lp) - (lr - lp) - 1
                # use_bias_correction_kl's default (True, as TRL): the KL times the ratio.
                num += -surrogate + 0.1 * kl * ratio
                den += 1
                clipped += (ratio > 1.3 and adv > 0) or (ratio < 0.8 and adv < 0)
    assert float(loss.detach()) == pytest.approx(num / den, rel=1e-4, abs=1e-6)
    assert float(metrics["clip_ratio/region_mean"]) == pytest.approx(clipped / den)
    assert method.loss_weight(batch) == den
    assert rollout_metrics["rewards/mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-5)


def test_rloo_loss_matches_naive_reference(tiny_model, tokenizer, prompt_rows):
    torch.manual_seed(1)
    method = RLOOMethod(
        [length_reward], num_generations=3, max_new_tokens=5, beta=0.2, ref_model="copy"
    )
    trainer = method_context(method, tiny_model, tokenizer, prompt_rows)  # reference = this copy
    _perturb(tiny_model)
    sampler = copy.deepcopy(tiny_model)  # the policy that samples (KL is sampler vs reference)
    batch, rollout_metrics = _step(method, trainer, prompt_rows, tokenizer, n=2)
    _perturb(tiny_model)  # ...and the policy being trained has moved on
    loss, _metrics = method(tiny_model.eval(), batch)
    rows = _rows_of(batch)
    ref_model = method.reference.ref_model
    shaped, kls = [], []
    for prompt, comp in rows:
        r = len(tokenizer.decode(comp, skip_special_tokens=True)) / 8
        old = _naive_token_logps(sampler, prompt, comp)
        ref = _naive_token_logps(ref_model, prompt, comp)
        kls.append(sum(a - b for a, b in zip(old, ref)))
        shaped.append(r - 0.2 * kls[-1])
    total = 0.0
    for i, (prompt, comp) in enumerate(rows):
        g0 = (i // 3) * 3
        others = [shaped[j] for j in range(g0, g0 + 3) if j != i]
        adv = shaped[i] - sum(others) / 2
        total += -adv * sum(_naive_token_logps(tiny_model, prompt, comp))
    assert float(loss.detach()) == pytest.approx(total / len(rows), rel=1e-4, abs=1e-6)
    assert rollout_metrics["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-6)
    assert abs(rollout_metrics["kl"]) > 1e-4
    assert method.loss_weight(batch) == len(rows)


def test_online_dpo_loss_matches_naive_reference(tiny_model, tokenizer, prompt_rows):
    torch.manual_seed(2)
    method = OnlineDPOMethod(
        [length_reward], num_generations=4, max_new_tokens=6, beta=0.5, ref_model="copy"
    )
    trainer = method_context(method, tiny_model, tokenizer, prompt_rows)
    batch, _rollout_metrics = _step(method, trainer, prompt_rows, tokenizer, n=3)
    k = batch["num_pairs"]
    assert k >= 1  # random completions differ in length
    _perturb(tiny_model)
    loss, metrics = method(tiny_model.eval(), batch)
    rows = _rows_of(batch)
    ref = method.reference.ref_model
    expected = []
    for (pc, cc), (pr, cr) in zip(rows[:k], rows[k:]):
        assert len(tokenizer.decode(cc, skip_special_tokens=True)) > len(
            tokenizer.decode(cr, skip_special_tokens=True)
        )
        h = (
            sum(_naive_token_logps(tiny_model, pc, cc))
            - sum(_naive_token_logps(ref, pc, cc))
            - sum(_naive_token_logps(tiny_model, pr, cr))
            + sum(_naive_token_logps(ref, pr, cr))
        )
        expected.append(-math.log(1 / (1 + math.exp(-0.5 * h))))
    assert float(loss.detach()) == pytest.approx(sum(expected) / k, rel=1e-4)
    assert method.loss_weight(batch) == k
    assert "dpo/rewards/margins" in metrics


def test_raft_trains_on_winners_only(tiny_model, tokenizer, prompt_rows):
    torch.manual_seed(3)
    method = RAFTMethod([length_reward], num_generations=4, max_new_tokens=6)
    trainer = method_context(method, tiny_model, tokenizer, prompt_rows)
    batch, _rollout_metrics = _step(method, trainer, prompt_rows, tokenizer, n=3)
    rows = _rows_of(batch)
    assert len(rows) == 3  # one winner per group, no threshold
    loss, _ = method(tiny_model.eval(), batch)
    lps = [lp for p, c in rows for lp in _naive_token_logps(tiny_model, p, c)]
    assert float(loss.detach()) == pytest.approx(-sum(lps) / len(lps), rel=1e-4)
    assert method.loss_weight(batch) == len(lps)
    # A threshold nobody reaches: a placeholder row with zero loss and zero weight.
    strict = RAFTMethod([length_reward], num_generations=2, max_new_tokens=4, reward_threshold=9)
    trainer = method_context(strict, tiny_model, tokenizer, prompt_rows)
    empty, empty_metrics = _step(strict, trainer, prompt_rows, tokenizer, n=2)
    assert empty["completion_mask"].sum() == 0 and empty_metrics["raft/kept_frac"] == 0
    assert float(strict(tiny_model, empty)[0].detach()) == 0.0
    assert strict.loss_weight(empty) == 0.0


# ------------------------------------------------------------------ machinery


def test_dynamic_sampling_drops_flat_groups(tiny_model, tokenizer, prompt_rows):
    def first_prompt_flat(prompts, completions, **kw):
        # group 0 (prompt 0) gets identical rewards, the others the completion length
        first = prompts[0]
        return [1.0 if p == first else len(c) / 8.0 for p, c in zip(prompts, completions)]

    torch.manual_seed(4)
    method = GRPOMethod(
        [first_prompt_flat], num_generations=4, max_new_tokens=6, dynamic_sampling=True
    )
    trainer = method_context(method, tiny_model, tokenizer, prompt_rows)
    batch, rollout_metrics = _step(method, trainer, prompt_rows, tokenizer, n=3)
    m = rollout_metrics
    dropped = m["dynamic_sampling/dropped_frac"]
    assert dropped >= 1 / 3 and batch["input_ids"].shape[0] == round(12 * (1 - dropped))
    assert m["frac_reward_zero_std"] == dropped
    assert batch["advantages"].abs().sum() > 0


def test_num_iterations_reuses_the_rollout(tiny_model, tokenizer, prompt_rows):
    method = GRPOMethod([length_reward], num_generations=2, max_new_tokens=4, num_iterations=2)
    assert method.steps_per_batch == 2 and method.needs_old_logps
    trainer = method_context(method, tiny_model, tokenizer, prompt_rows)
    first, _ = _step(method, trainer, prompt_rows, tokenizer, n=2)
    trainer.step.step_in_epoch = 1  # the planner repeats the same prompts
    second, metrics = _step(method, trainer, prompt_rows, tokenizer, n=2)
    assert second["input_ids"] is first["input_ids"]  # same completions, same old log-probs
    assert second["old_logps"] is first["old_logps"]
    assert metrics["time/generation"] == 0.0
    trainer.step.step_in_epoch = 2  # next rollout batch: fresh samples
    third, _ = _step(method, trainer, prompt_rows, tokenizer, n=2)
    assert third["input_ids"] is not first["input_ids"]


def test_lora_reference_is_the_base_model(tiny_model, tokenizer, prompt_rows):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    policy = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    method = GRPOMethod([length_reward], num_generations=2, max_new_tokens=4, beta=0.1)
    trainer = method_context(method, policy, tokenizer, prompt_rows)
    assert method.reference.source == "adapters"
    batch, _rollout_metrics = _step(method, trainer, prompt_rows, tokenizer, n=2)
    with torch.no_grad():  # make the adapter non-trivial
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    policy.train()
    (ref_again,) = method.reference_logps(policy, batch)
    torch.testing.assert_close(ref_again, batch["ref_logps"])  # adapters off: unchanged
    assert policy.training  # the reference pass restored train mode
    _, metrics = method(policy.eval(), batch)
    assert float(metrics["kl"]) > 0  # ...and re-enabled the adapters


def test_bad_input_is_rejected_before_training(tiny_model, tokenizer, prompt_rows, tmp_path):
    for cls in (GRPOMethod, RLOOMethod, OnlineDPOMethod):
        with pytest.raises(ValueError, match="num_generations must be an int >= 2"):
            cls([length_reward], num_generations=1)
    RAFTMethod([length_reward], num_generations=1)  # best-of-1 is allowed
    with pytest.raises(ConfigError, match="nowhere_pkg"):
        GRPOMethod(["nowhere_pkg.rewards:score"])
    with pytest.raises(ValueError, match="loss_type"):
        GRPOMethod([length_reward], loss_type="token_mean")
    with pytest.raises(ValueError, match="beta must be > 0"):
        OnlineDPOMethod([length_reward], beta=0.0)
    with pytest.raises(ValueError, match="GRPOMethod: beta must be >= 0, got -0.1"):
        GRPOMethod([length_reward], beta=-0.1)
    with pytest.raises(ValueError, match="RLOOMethod: fused_chunk_size must be > 0"):
        RLOOMethod([length_reward], fused_chunk_size=0)

    def train(method, rows, **config):
        return GrimoireTrainer(
            model=tiny_model,
            tokenizer=tokenizer,
            config=quiet_config(tmp_path, **config),
            loss_fn=method,
            train_dataset=rows,
        )

    # prompt + max_new_tokens beyond training.max_length -> named rows
    with pytest.raises(DataError, match=r"train row 0: prompt of \d+ tokens \+ max_new_tokens=60"):
        train(
            GRPOMethod([length_reward], num_generations=2, max_new_tokens=60),
            prompt_rows,
            max_length=64,
        )
    # the reward needs a column the dataset lacks
    no_answer = [{k: v for k, v in r.items() if k != "answer"} for r in prompt_rows]
    with pytest.raises(DataError, match="'exact_match_reward' needs 'answer'"):
        train(GRPOMethod(["exact_match"], num_generations=2, max_new_tokens=4), no_answer)


def test_trainer_runs_grpo_with_clipping_on_second_iteration(tiny_dir, tokenizer, tmp_path):
    """num_iterations=2 through the real loop with a large lr: the first update of each
    rollout has ratio == 1 (no clipping), the second sees the moved policy (ratio != 1, clipped
    tokens). Also: eval generates + scores, and the metric keys are all there."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(8, seed=2)]
    method = GRPOMethod(
        ["char_match", length_reward],
        reward_weights=[1.0, 0.5],
        num_generations=4,
        max_new_tokens=6,
        num_iterations=2,
        beta=0.04,
        epsilon_high=0.28,
        ref_model="copy",
    )
    record = RecordLosses()
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer=tokenizer,
        config=quiet_config(tmp_path, max_steps=4, batch_size=2, learning_rate=0.05),
        loss_fn=method,
        train_dataset=rows,
        eval_dataset=rows[:4],
        callbacks=[record],
    )
    trainer.train()
    recs = record.records
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for first, second in (recs[0], recs[1]), (recs[2], recs[3]):
        assert first["ratio/mean"] == 1.0 and first["clip_ratio/region_mean"] == 0.0
        assert second["ratio/abs_dev"] > 0.05
        assert second["clip_ratio/region_mean"] > 0.0
        assert second["time/generation"] == 0.0 < first["time/generation"]
        assert second["rewards/mean"] == first["rewards/mean"]  # same cached rollout
    assert recs[0]["kl"] == pytest.approx(0.0, abs=1e-6) and recs[1]["kl"] > 0
    for key in (
        "rewards/char_match_reward/mean",
        "rewards/length_reward/mean",
        "entropy",
        "completions/mean_length",
        "frac_reward_zero_std",
        "time/rollout",
    ):
        assert key in recs[0]
    assert "time/step" in recs[1]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r["split"] == "eval"]
    assert evals and "eval/rewards/char_match_reward/mean" in evals[-1]


def test_trainer_lora_bf16_checkpointing(tiny_dir, tokenizer, tmp_path):
    """LoRA (reference = adapters off), bf16 autocast and activation checkpointing around
    generation: runs, restores the training state, logs finite values."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(4, seed=3)]
    record = RecordLosses()
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer=tokenizer,
        config=quiet_config(
            tmp_path,
            max_steps=2,
            batch_size=2,
            learning_rate=1e-2,
            mixed_precision="bf16",
            gradient_checkpointing=True,
        ),
        loss_fn=GRPOMethod([length_reward], num_generations=2, max_new_tokens=4, beta=0.1),
        train_dataset=rows,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        callbacks=[record],
    )
    assert trainer.loss_fn.reference.source == "adapters"
    trainer.train()
    assert trainer.model.training
    for rec in record.records:
        assert math.isfinite(rec["loss"]) and math.isfinite(rec["kl"])
    assert record.records[-1]["kl"] > 0


@pytest.mark.parametrize("corrected", [False, True])
def test_bias_corrected_kl_multiplies_k3_by_the_ratio(
    tiny_model, tokenizer, prompt_rows, corrected
):
    torch.manual_seed(6)
    method = GRPOMethod(
        [length_reward],
        num_generations=2,
        max_new_tokens=4,
        beta=0.3,
        num_iterations=2,
        ref_model="copy",
        use_bias_correction_kl=corrected,
    )
    ctx = method_context(method, tiny_model, tokenizer, prompt_rows)
    batch, _ = _step(method, ctx, prompt_rows, tokenizer, n=2)
    _perturb(tiny_model)
    tiny_model.eval()
    loss, _ = method(tiny_model, batch)
    num, den = 0.0, 0
    for i, (prompt, comp) in enumerate(_rows_of(batch)):
        adv = float(batch["advantages"][i])
        cm = batch["completion_mask"][i].bool()
        olds, refs = batch["old_logps"][i][cm].tolist(), batch["ref_logps"][i][cm].tolist()
        for lp, lo, lr in zip(_naive_token_logps(tiny_model, prompt, comp), olds, refs):
            ratio = math.exp(lp - lo)
            surrogate = min(ratio * adv, min(max(ratio, 0.8), 1.2) * adv)
            kl = math.exp(lr - lp) - (lr - lp) - 1
            num += -surrogate + 0.3 * kl * (ratio if corrected else 1.0)
            den += 1
    assert float(loss.detach()) == pytest.approx(num / den, rel=1e-4, abs=1e-6)


def test_the_rollout_is_assembled_on_the_rollout_side_from_the_methods_settings():
    parts = RolloutSettings(["exact_match"], num_generations=3, temperature=0.5).assemble("X")
    assert isinstance(parts.engine, HFGenerateEngine) and parts.agent is None
    assert parts.sampling.num_generations == 3 and parts.engine.sampler.temperature == 0.5
    assert [f.name for f in parts.reward_funcs] == ["exact_match_reward"]
    # A method hands the same settings over whole and holds the parts it gets back.
    method = GRPOMethod(["exact_match"], num_generations=3, temperature=0.5, max_new_tokens=7)
    assert (method.num_generations, method.temperature, method.max_new_tokens) == (3, 0.5, 7)
    assert method.engine.sampler.temperature == 0.5 and method.max_staleness == 0
    # Its signature lists every setting, so the YAML checks and help() see them.
    settings = {f.name for f in dataclasses.fields(RolloutSettings)}
    assert settings <= set(inspect.signature(GRPOMethod).parameters)
    with pytest.raises(TypeError, match=r"GRPOMethod.__init__\(\) got an unexpected keyword "):
        GRPOMethod(["exact_match"], tempurature=0.5)
