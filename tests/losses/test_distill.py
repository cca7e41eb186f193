"""On-policy distillation (``DistillMethod``): the formulas against naive references and TRL's
``GKDTrainer.generalized_jsd_loss``, the method on the tiny model (teacher log-probs of the
sampled tokens, loss = the reverse-KL estimate), bad teachers rejected before training, the
YAML schema, and a short run whose reverse KL to the teacher falls."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, method_context, quiet_config

from grimoire import GrimoireTrainer
from grimoire.cli.run import build_run
from grimoire.cli.schema import check_config, load_config
from grimoire.collate.prompts import GRPOCollator
from grimoire.config import registry
from grimoire.errors import ConfigError
from grimoire.losses import DistillMethod
from grimoire.losses.distill_functional import (
    chunked_generalized_jsd,
    generalized_jsd,
    sampled_reverse_kl_loss,
)
from grimoire.model.tiny import reverse_rows, save_tiny
from grimoire.rollout.batches import pack_rollout_batch
from grimoire.rows.prompts import tokenize_grpo
from grimoire.training.setup import build_rollouts

BETAS = [0.0, 0.3, 0.5, 0.9, 1.0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ formulas


def test_distill_sampled_reverse_kl_value_and_gradient_match_naive_reference():
    torch.manual_seed(0)
    n, c = 3, 5
    logps = (-torch.rand(n, c) * 3).requires_grad_()
    teacher = -torch.rand(n, c) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    weights = torch.rand(n, c) + 0.5
    loss, k = sampled_reverse_kl_loss(logps, teacher, mask, weights)
    loss.backward()
    # Naive: value sum_t w_t (lp_t - lt_t); REINFORCE gradient w_t (lp_t - lt_t) on each lp_t.
    value, grad = 0.0, torch.zeros(n, c)
    for i in range(n):
        for t in range(c):
            if mask[i, t]:
                d = float(logps[i, t].detach() - teacher[i, t])
                value += float(weights[i, t]) * d
                grad[i, t] = float(weights[i, t]) * d
                assert float(k[i, t]) == pytest.approx(d, abs=1e-6)
            else:
                assert float(k[i, t]) == 0.0
    assert float(loss.detach()) == pytest.approx(value, abs=1e-5)
    torch.testing.assert_close(logps.grad, grad, rtol=1e-5, atol=1e-6)


def _naive_jsd(s_logits, t_logits, beta):
    """Per-row generalised JSD from the definition, with explicit probabilities in float64."""
    out = []
    for s_row, t_row in zip(s_logits.double(), t_logits.double()):
        p_s, p_t = torch.softmax(s_row, -1), torch.softmax(t_row, -1)
        m = beta * p_t + (1 - beta) * p_s
        kl = lambda p, q: sum(  # noqa: E731
            float(p[v]) * (math.log(float(p[v])) - math.log(float(q[v]))) for v in range(len(p))
        )
        out.append(beta * kl(p_t, m) + (1 - beta) * kl(p_s, m))
    return out


@pytest.mark.parametrize("beta", BETAS)
def test_distill_jsd_value_and_gradient_match_naive_formula(beta):
    torch.manual_seed(1)
    s = (torch.randn(7, 11) * 2).requires_grad_()
    t = torch.randn(7, 11) * 2
    jsd = chunked_generalized_jsd(s, t, beta, chunk_size=3)  # chunks of 3, 3, 1 rows
    if 0.0 < beta < 1.0:  # the definition; at the end points it is 0, GKD uses the KL limits
        assert jsd.tolist() == pytest.approx(_naive_jsd(s.detach(), t, beta), abs=1e-5)
    if beta == 0.0:
        assert jsd.tolist() == pytest.approx(_naive_kl(t, s.detach()), abs=1e-5)  # forward KL
    if beta == 1.0:
        assert jsd.tolist() == pytest.approx(_naive_kl(s.detach(), t), abs=1e-5)  # reverse KL
    jsd.sum().backward()
    s64 = s.detach().double().requires_grad_()
    ref = generalized_jsd(s64, t.double(), beta).sum()  # unchunked, float64 autograd
    (g,) = torch.autograd.grad(ref, s64)
    torch.testing.assert_close(s.grad.double(), g, rtol=1e-4, atol=1e-6)


def _naive_kl(a_logits, b_logits):
    p, q = torch.softmax(a_logits.double(), -1), torch.softmax(b_logits.double(), -1)
    return (p * (p.log() - q.log())).sum(-1).tolist()


@pytest.mark.parametrize("beta", BETAS)
def test_distill_jsd_matches_trl_gkd_generalized_jsd_loss(beta):
    from trl.import_utils import suppress_experimental_warning

    with suppress_experimental_warning():
        from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(2)
    b, seq, v, temperature = 2, 6, 13, 2.0
    s = (torch.randn(b, seq, v) * 3).requires_grad_()
    t = torch.randn(b, seq, v) * 3
    labels = torch.randint(0, v, (b, seq))
    labels[0, 4:] = -100
    labels[1, :2] = -100
    trl_loss = GKDTrainer.generalized_jsd_loss(
        s, t, labels=labels, beta=beta, temperature=temperature
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, s)
    keep = labels != -100
    ours = chunked_generalized_jsd(s[keep] / temperature, t[keep] / temperature, beta, 4)
    loss = ours.sum() / keep.sum()
    (grad,) = torch.autograd.grad(loss, s)
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-4, atol=1e-7)


def test_distill_jsd_rejects_beta_outside_unit_interval():
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(torch.zeros(1, 3), torch.zeros(1, 3), 1.5)
    with pytest.raises(ValueError, match="beta"):
        DistillMethod(torch.nn.Linear(1, 1), loss_type="jsd", beta=-0.1)


# ------------------------------------------------------------------ the method on the tiny model


@pytest.fixture(scope="module")
def prompt_rows(tokenizer):
    return [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(16, seed=11)]


def _teacher(tiny_dir, seed=1, sharpen=4.0):
    """Another tiny model of the same shape and tokenizer, made peaked (a clear target)."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
        teacher.model.norm.weight.mul_(sharpen)
    return teacher


def _step(method, ctx, rows, tokenizer, n=3):
    mb = GRPOCollator(tokenizer.pad_token_id)(rows[:n])
    batches, metrics, _ = build_rollouts(method, ctx).step(ctx, [(mb, 1.0)])
    return batches[0][0], metrics


def _naive_logps(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(completion)]


def _rows_of(batch):
    width = batch["completion_mask"].shape[1]
    out = []
    for ids, am, cm in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"]):
        out.append((ids[:-width][am[:-width].bool()].tolist(), ids[-width:][cm.bool()].tolist()))
    return out


@pytest.mark.parametrize("loss_type", ["reverse_kl", "jsd"])
def test_distill_method_loss_is_per_token_reverse_kl_to_the_teacher(
    loss_type, tiny_dir, tiny_model, tokenizer, prompt_rows
):
    torch.manual_seed(0)
    teacher = _teacher(tiny_dir)
    method = DistillMethod(
        teacher, loss_type=loss_type, beta=1.0, num_generations=2, max_new_tokens=6
    )
    ctx = method_context(method, tiny_model, tokenizer, prompt_rows)
    assert method.reward_funcs == []  # none needed
    assert all(not p.requires_grad for p in teacher.parameters()) and not teacher.training
    batch, _ = _step(method, ctx, prompt_rows, tokenizer)
    loss, metrics = method(tiny_model.eval(), batch)
    rows = _rows_of(batch)
    diffs = [
        s - t
        for p, c in rows
        for s, t in zip(_naive_logps(tiny_model, p, c), _naive_logps(teacher, p, c))
    ]
    assert float(metrics["distill/reverse_kl"]) == pytest.approx(sum(diffs) / len(diffs), rel=1e-4)
    assert method.loss_weight(batch) == len(diffs)
    if loss_type == "reverse_kl":
        assert float(loss.detach()) == pytest.approx(sum(diffs) / len(diffs), rel=1e-4)
    else:  # beta = 1: the exact reverse KL over the vocabulary at every sampled position
        exact = []
        for p, c in rows:
            ids = torch.tensor([p + c])
            with torch.no_grad():
                s_lp = torch.log_softmax(tiny_model(ids).logits[0].double(), -1)
                t_lp = torch.log_softmax(teacher(ids).logits[0].double(), -1)
            for t in range(len(c)):
                pos = len(p) - 1 + t
                exact.append(float((s_lp[pos].exp() * (s_lp[pos] - t_lp[pos])).sum()))
        assert float(loss.detach()) == pytest.approx(sum(exact) / len(exact), rel=1e-4)
    # The packed layout of the same rows (padding-free runs) gives the same loss and metrics.
    packed = pack_rollout_batch(batch)
    p_loss, p_metrics = method(tiny_model, packed)
    assert float(p_loss.detach()) == pytest.approx(float(loss.detach()), rel=1e-4)
    assert float(p_metrics["distill/reverse_kl"]) == pytest.approx(
        float(metrics["distill/reverse_kl"]), rel=1e-4
    )
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_model.parameters())
    assert all(p.grad is None for p in teacher.parameters())


def test_distill_teacher_with_another_vocabulary_is_a_config_error(
    tiny_model, tokenizer, prompt_rows, tmp_path
):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "big", vocab_size=96))
    method = DistillMethod(other)
    with pytest.raises(ConfigError, match=r"loss\.args\.teacher.*output layer has 96"):
        method_context(method, tiny_model, tokenizer, prompt_rows)


def test_distill_teacher_path_that_does_not_load_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"loss\.args\.teacher.*no such folder"):
        DistillMethod(str(tmp_path / "missing"))


# ------------------------------------------------------------------ YAML


def _raw(teacher, out):
    raw = load_config("examples/distill_toy.yaml")
    raw["loss"]["args"]["teacher"] = teacher
    raw["training"].update(output_dir=str(out), max_steps=2, eval_steps=None, progress_bar=False)
    raw["eval_dataset"]["max_samples"] = 4
    raw["save_to"] = False
    return raw


def test_distill_yaml_schema_accepts_the_example_and_registers_the_name(tmp_path):
    assert registry.resolve("distill", registry.LOSSES, "loss.type") is DistillMethod
    check_config(_raw("grimoire://assets/reverse_warm", tmp_path))  # no error
    bad = _raw("grimoire://assets/reverse_warm", tmp_path)
    bad["loss"]["args"]["temprature"] = 1.0
    with pytest.raises(ConfigError, match="temprature"):
        check_config(bad)


def test_distill_yaml_bad_teacher_path_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"loss\.args\.teacher.*nowhere"):
        build_run(_raw(str(tmp_path / "nowhere"), tmp_path / "out"))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ------------------------------------------------------------------ end to end


@pytest.mark.parametrize("loss_type", ["reverse_kl", "jsd"])
def test_distill_short_run_lowers_the_reverse_kl_to_the_teacher(
    loss_type, tiny_dir, tiny_model, tokenizer, tmp_path
):
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(96, seed=5)]
    method = DistillMethod(
        _teacher(tiny_dir), loss_type=loss_type, num_generations=2, max_new_tokens=6
    )
    record = RecordLosses()
    config = quiet_config(tmp_path, max_steps=30, batch_size=8, learning_rate=1e-2, seed=0)
    trainer = GrimoireTrainer(
        model=tiny_model,
        tokenizer=tokenizer,
        config=config,
        loss_fn=method,
        train_dataset=rows,
        callbacks=[record],
    )
    trainer.train()
    kl = [r["distill/reverse_kl"] for r in record.records]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert first > 0.3  # the peaked teacher is far from the student at the start
    assert last < 0.6 * first, kl
