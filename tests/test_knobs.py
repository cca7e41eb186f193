"""Knobs peers and TRL users expect: Muon, NEFTune, k-bit preparation switches (issue #14)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, quiet_config, train

from grimoire import TrainingConfig
from grimoire.model.tiny import build_model
from grimoire.optim.optimizers import build_optimizer, build_scheduler, muon_param_groups

# ---------------------------------------------------------------------------------------- Muon


def _naive_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration, in float64 (an independent reference)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _loss(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 2], [1, 30, 31, 32, 33, 34, 35, 2]])
    return model(input_ids=ids, labels=ids).loss


def _config(**kw) -> TrainingConfig:
    return TrainingConfig(
        output_dir="unused",
        optimizer="muon",
        learning_rate=1e-3,
        muon_learning_rate=0.02,
        muon_momentum=0.9,
        weight_decay=0.1,
        **kw,
    )


def test_muon_groups_partition_the_trainable_parameters():
    model = build_model(tie_word_embeddings=False)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # frozen: in no group
    muon, adamw = muon_param_groups(model, 0.1)
    listed = [p for g in muon + adamw for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(listed) == len({id(p) for p in listed})  # nobody twice
    assert {id(p) for p in listed} == {id(p) for p in trainable}
    muon_ids = {id(p) for g in muon for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[i] for i in muon_ids) == sorted(
        n
        for n, p in model.named_parameters()
        if p.requires_grad and "layers." in n and n.endswith("proj.weight")
    )
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert id(dict(model.named_parameters())[name]) not in muon_ids


def test_muon_step_matches_muon_and_adamw_references():
    model = build_model(tie_word_embeddings=True)
    cfg = _config()
    muon_copy, adamw_copy = copy.deepcopy(model), copy.deepcopy(model)
    opt = build_optimizer(model, cfg)
    assert len(opt.param_groups) == 3  # muon, adamw decayed, adamw not decayed
    _loss(model).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()

    muon_ids = {id(p) for p in opt.param_groups[0]["params"]}
    muon_names = [n for n, p in model.named_parameters() if id(p) in muon_ids]
    assert muon_names and "model.embed_tokens.weight" not in muon_names

    # The same step by separately constructed torch optimizers on copies: bit-identical.
    for ref, pick in ((muon_copy, True), (adamw_copy, False)):
        params = dict(ref.named_parameters())
        for n, p in params.items():
            p.grad = grads[n].clone()
        chosen = [n for n in params if (n in muon_names) == pick]
        if pick:
            ref_opt = torch.optim.Muon(
                [params[n] for n in chosen], lr=0.02, momentum=0.9, weight_decay=0.1
            )
        else:
            skip = ("norm", "bias")
            ref_opt = torch.optim.AdamW(
                [
                    {"params": [params[n] for n in chosen if not any(s in n for s in skip)]},
                    {
                        "params": [params[n] for n in chosen if any(s in n for s in skip)],
                        "weight_decay": 0.0,
                    },
                ],
                lr=1e-3,
                weight_decay=0.1,
            )
        ref_opt.step()
        for n in chosen:
            assert torch.equal(dict(model.named_parameters())[n], params[n]), n


def test_muon_update_matches_its_definition():
    # Full-rank gradients: a backprop gradient of a few tokens is low-rank, and NS5 (slope ~480
    # at 0) amplifies the bf16 rounding in its null space, which a reference cannot reproduce.
    model = build_model()
    opt = build_optimizer(model, _config())
    torch.manual_seed(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    muon_ids = {id(p) for p in opt.param_groups[0]["params"]}
    for n, p in model.named_parameters():
        if id(p) not in muon_ids:
            continue
        # Decoupled decay, then -lr * sqrt(max(1, A/B)) * NS5(Nesterov momentum). From an empty
        # buffer the Nesterov update is a multiple of the gradient and NS5 normalises the scale
        # away, so the direction is NS5(grad). torch runs NS in bf16: ~1.5% relative error.
        rows, cols = p.shape
        scale = 0.02 * math.sqrt(max(1, rows / cols))
        expected = -before[n] * 0.02 * 0.1 - scale * _naive_newton_schulz(grads[n]).float()
        step = p.detach() - before[n]
        assert (step - expected).norm() / expected.norm() < 0.05, n


def test_muon_scheduler_scales_each_group_from_its_own_lr():
    model = build_model()
    opt = build_optimizer(model, _config(lr_scheduler="linear", warmup_steps=3))
    sched = build_scheduler(opt, _config(lr_scheduler="linear", warmup_steps=3), total_steps=10)
    factor = 1 / 4  # warmup step 0: (0 + 1) / (3 + 1)
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == pytest.approx([0.02 * factor, 1e-3 * factor, 1e-3 * factor])
    # The inner optimizers read the same group dicts, so the scheduled lr is the one they use.
    assert opt._muon.param_groups[0]["lr"] == pytest.approx(0.02 * factor)
    assert opt._adamw.param_groups[0]["lr"] == pytest.approx(1e-3 * factor)
    _loss(model).backward()
    opt.step()
    sched.step()
    assert opt._muon.param_groups[0]["lr"] == pytest.approx(0.02 * 2 / 4)


def test_muon_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    a = build_model()
    b = copy.deepcopy(a)
    opt_a = build_optimizer(a, _config())
    for _ in range(2):
        opt_a.zero_grad()
        _loss(a).backward()
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, _config())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert (
        opt_b._muon.state is opt_b.state and opt_b._adamw.param_groups[0] is opt_b.param_groups[1]
    )
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), n


def test_muon_checkpoint_resume_reproduces_uninterrupted_run(
    tiny_dir, tokenizer, sft_rows, tmp_path
):
    from transformers import AutoModelForCausalLM

    from grimoire import TrainerCallback
    from grimoire.losses import SFTLoss

    class StopAt(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics):
            if step >= 2:
                trainer.request_stop()

    rows = sft_rows[:24]
    cfg = dict(max_steps=4, optimizer="muon", muon_learning_rate=0.02, learning_rate=3e-3)
    full = RecordLosses()
    train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "full", **cfg),
        callbacks=[full],
    )
    train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "part", save_steps=2, **cfg),
        callbacks=[StopAt()],
    )
    resumed = RecordLosses()
    train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "part", resume_from_checkpoint="latest", **cfg),
        callbacks=[resumed],
    )
    assert len(full.losses) == 4
    assert resumed.losses == full.losses[2:]  # bit-exact: Muon momentum + Adam moments restored


# ------------------------------------------------------------------------------------- NEFTune

ALPHA = 5.0


def _neftune_model(alpha: float | None = ALPHA, peft: bool = False):
    from grimoire.training.setup import prepare_model

    model = build_model()
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8)
    cfg = TrainingConfig(
        output_dir="unused", neftune_noise_alpha=alpha, gradient_checkpointing=False
    )
    model, _ = prepare_model(model, peft_config, cfg, accelerator=None)
    return model


def _embedding_outputs(model, **inputs) -> list[torch.Tensor]:
    """What the decoder receives from the input embeddings (after every embedding hook)."""
    seen: list[torch.Tensor] = []
    handle = model.get_input_embeddings().register_forward_hook(
        lambda _m, _a, out: seen.append(out.detach().clone())
    )
    try:
        model(**inputs)
    finally:
        handle.remove()
    return seen


def _padded_batch():
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 2], [1, 30, 31, 32, 2, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    return ids, mask


def test_neftune_noise_in_train_mode_bounded_by_each_samples_length():
    model = _neftune_model()
    model.train()
    ids, mask = _padded_batch()
    clean = model.get_input_embeddings().weight[ids].detach()
    (a,) = _embedding_outputs(model, input_ids=ids, attention_mask=mask)
    (b,) = _embedding_outputs(model, input_ids=ids, attention_mask=mask)
    assert not torch.equal(a, b) and not torch.equal(a, clean)
    d = clean.shape[-1]
    for row, length in ((0, 8), (1, 5)):
        bound = ALPHA / math.sqrt(length * d)
        noise = (a[row] - clean[row]).abs()
        assert noise.max() <= bound * (1 + 1e-5)
        # 512 uniform draws: the largest is within 2% of the bound unless the bound is wrong
        assert noise.max() >= 0.98 * bound
    # The padded row uses its own 5 real tokens, not the width 8 (TRL's choice).
    assert (a[1] - clean[1]).abs().max() > ALPHA / math.sqrt(8 * d) * 1.05


def test_neftune_packed_row_uses_each_segments_length():
    model = _neftune_model()
    model.train()
    ids = torch.tensor([[1, 5, 9, 13, 2, 1, 30, 2]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    clean = model.get_input_embeddings().weight[ids].detach()
    (out,) = _embedding_outputs(model, input_ids=ids, position_ids=pos)
    d = clean.shape[-1]
    noise = (out - clean).abs()[0]
    for seg, length in ((slice(0, 5), 5), (slice(5, 8), 3)):
        bound = ALPHA / math.sqrt(length * d)
        assert bound * 0.95 <= noise[seg].max() <= bound * (1 + 1e-5)


def test_neftune_off_in_eval_no_grad_and_generation():
    model = _neftune_model()
    clean_model = _neftune_model(alpha=None)
    clean_model.load_state_dict(model.state_dict())
    ids, mask = _padded_batch()
    clean = model.get_input_embeddings().weight[ids].detach()
    model.eval()
    (out,) = _embedding_outputs(model, input_ids=ids, attention_mask=mask)
    assert torch.equal(out, clean)
    model.train()
    with torch.no_grad():  # reference / old-logp forwards in training mode score the clean policy
        (out,) = _embedding_outputs(model, input_ids=ids, attention_mask=mask)
    assert torch.equal(out, clean)

    from grimoire.rollout.engines.generation import generation_mode

    prompt = torch.tensor([[1, 5, 9, 13]])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with generation_mode(model):
        got = model.generate(prompt, **kwargs)
    with generation_mode(clean_model):
        want = clean_model.generate(prompt, **kwargs)
    assert torch.equal(got, want)
    assert model.training  # generation_mode restored training mode


def test_neftune_reaches_a_lora_model():
    model = _neftune_model(peft=True)
    model.train()
    ids, mask = _padded_batch()
    clean = model.get_input_embeddings().weight[ids].detach()
    (a,) = _embedding_outputs(model, input_ids=ids, attention_mask=mask)
    assert not torch.equal(a, clean)
    bound = ALPHA / math.sqrt(5 * clean.shape[-1])
    assert (a - clean).abs().max() <= bound * (1 + 1e-5)
    # The loss of a training forward moves with the noise; an eval forward's does not.
    losses = [
        float(model(input_ids=ids, attention_mask=mask, labels=ids).loss.detach()) for _ in "ab"
    ]
    assert losses[0] != losses[1]
    model.eval()
    losses = [
        float(model(input_ids=ids, attention_mask=mask, labels=ids).loss.detach()) for _ in "ab"
    ]
    assert losses[0] == losses[1]


# ------------------------------------------------------------------------ k-bit preparation


def _bf16_model():
    return build_model().to(torch.bfloat16)


def _fp32_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.dtype == torch.float32}


def test_upcast_all_matches_peft_and_norms_casts_only_norms():
    from peft import prepare_model_for_kbit_training

    from grimoire.model.prepare import upcast_for_kbit

    names = {n for n, _ in _bf16_model().named_parameters()}
    ours = _bf16_model()
    cast = upcast_for_kbit(ours, "all")
    assert _fp32_names(ours) == set(cast) == names
    # peft's own upcast (it runs on a non-quantized model too) ends in the same dtypes
    peft_model = prepare_model_for_kbit_training(_bf16_model(), use_gradient_checkpointing=False)
    assert _fp32_names(peft_model) == names

    norms = _bf16_model()
    upcast_for_kbit(norms, "norms")
    expected = {n for n in names if "norm" in n}
    assert expected and _fp32_names(norms) == expected
    assert "model.layers.0.self_attn.q_proj.weight" not in expected

    none = _bf16_model()
    assert upcast_for_kbit(none, "none") == [] and _fp32_names(none) == set()


@pytest.mark.parametrize(
    ("upcast", "gc", "kbit_gc", "want_gc"),
    [
        ("all", True, None, True),
        ("all", True, False, False),
        ("all", False, True, True),
        ("norms", True, None, True),
        ("norms", True, False, False),
        ("none", False, True, True),
    ],
)
def test_prepare_model_passes_kbit_switches(monkeypatch, upcast, gc, kbit_gc, want_gc):
    import peft
    from peft import LoraConfig

    import grimoire.training.setup as modeling

    calls: list[dict] = []
    real = peft.prepare_model_for_kbit_training

    def spy(model, **kwargs):
        calls.append(kwargs)
        return real(model, **kwargs)

    # A bf16 model flagged as quantized: bitsandbytes needs CUDA, so the k-bit layers
    # themselves are not exercised here; the switches and the upcast are.
    monkeypatch.setattr(peft, "prepare_model_for_kbit_training", spy)
    monkeypatch.setattr(modeling, "is_quantized", lambda _m: True)
    cfg = TrainingConfig(
        output_dir="unused",
        gradient_checkpointing=gc,
        kbit_gradient_checkpointing=kbit_gc,
        kbit_upcast=upcast,
    )
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8)
    model, _ = modeling.prepare_model(_bf16_model(), lora, cfg, accelerator=None)
    if upcast == "all":
        assert [c["use_gradient_checkpointing"] for c in calls] == [want_gc]
    else:
        assert calls == []
    base = model.get_base_model()
    assert base.is_activation_checkpointing == want_gc
    fp32 = {n for n, p in base.named_parameters() if p.dtype == torch.float32 and "lora" not in n}
    all_names = {n for n, p in base.named_parameters() if "lora" not in n}
    assert (
        fp32
        == {
            "all": all_names,
            "norms": {n for n in all_names if "norm" in n},
            "none": set(),
        }[upcast]
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the base is frozen


# ------------------------------------------------------------------ fused path: fused="require"


def test_fused_require_refuses_a_sharded_head_and_auto_falls_back():
    from grimoire.errors import ConfigError
    from grimoire.forward.fused_head import fused_parts
    from grimoire.forward.logprobs import compute_token_logps

    model = build_model()
    assert fused_parts(model, require=True) is not None  # unsharded: fine either way
    sharded = build_model(tie_word_embeddings=False)
    sharded.lm_head.weight.ds_id = 7  # what a DeepSpeed ZeRO-3 partitioned parameter carries
    with pytest.raises(ConfigError) as err:
        fused_parts(sharded, require=True)
    message = str(err.value)
    assert "LlamaForCausalLM" in message and "sharded" in message and "fused=True" in message
    # The default keeps the automatic fallback: full logits, the same log-probs.
    assert fused_parts(sharded) is None
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    out = compute_token_logps(sharded, ids, ids)
    want = torch.log_softmax(sharded(input_ids=ids).logits[0, :-1].float(), -1)
    got = out.logps[0][out.mask[0]]
    torch.testing.assert_close(got, want.gather(-1, ids[0, 1:, None])[:, 0].detach())
