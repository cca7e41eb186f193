"""Tests for OSFT (arXiv 2504.07097): subspace preservation, projections, saving, edge cases, DDP.

Transformers/peft are imported inside helpers, not at module top: the 2-process test spawns
workers that re-import this module, and each would otherwise pay seconds importing transformers.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from grimoire.errors import ConfigError
from grimoire.model.osft import (
    OSFTLinear,
    apply_osft,
    num_frozen_components,
    osft_dense_state_dict,
    resolve_osft_targets,
    unapply_osft,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared, busy CPU OpenMP spin-waiting makes
    # them 100x slower; restored afterwards so other test modules are unaffected.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(arch: str = "llama", seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

    config = {
        "llama": lambda: LlamaConfig(**SIZES),
        "qwen2": lambda: Qwen2Config(**SIZES),  # q/k/v have biases: checks bias handling
        "gemma2": lambda: Gemma2Config(**SIZES, head_dim=8),  # tied embeddings
    }[arch]()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(
        0, VOCAB, (2, 8), generator=g
    )


def random_loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    ids, labels = batch(seed)
    logits = model(ids).logits
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def train(model, state, steps: int = 5, lr: float = 1e-2, project: bool = True) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad()
        random_loss(model, seed=step).backward()
        if project:
            state.project_gradients()
        opt.step()
        if project:
            state.reproject()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(batch()[0]).logits


def naive_dense(m: OSFTLinear) -> torch.Tensor:
    """Independent float64 reference: sum of rank-1 terms s_i u_i v_i^T over both parts."""
    w = torch.zeros(m.out_features, m.in_features, dtype=torch.float64)
    for u, s, v in ((m.U_h, m.S_h, m.V_h), (m.U_l, m.S_l, m.V_l)):
        u, s, v = (t.detach().double() for t in (u, s, v))
        for i in range(s.numel()):
            w += s[i] * torch.outer(u[:, i], v[:, i])
    return w


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles between span(a) and span(b): arccos of the singular values of Qa^T Qb.

    Bases are re-orthonormalised in float64 first: fp32 bases are orthonormal only to ~1e-7, and
    arccos(1 - 1e-7) is already 4.5e-4, which would swamp a 1e-4 tolerance.
    """
    qa, qb = torch.linalg.qr(a.double())[0], torch.linalg.qr(b.double())[0]
    cos = torch.linalg.svdvals(qa.T @ qb).clamp(-1.0, 1.0)
    return torch.arccos(cos)


# --- rank formula and edge cases ------------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "ratio", "k"),
    [
        (32, 0.25, 24),
        (32, 1.0, 0),
        (32, 0.0, 32),
        (10, 0.9, 1),
        (10, 0.7, 3),
        (7, 0.5, 3),
        (1, 0.5, 0),
    ],
)
def test_num_frozen_components_is_floor_formula(m, ratio, k):
    # (10, 0.9): naive float math gives floor(0.9999999999999998) = 0.
    assert num_frozen_components(m, ratio) == k


@pytest.mark.parametrize("ratio", [-0.1, 1.5, True, "0.5"])
def test_invalid_ratio_raises(ratio):
    with pytest.raises(ConfigError, match="unfreeze_rank_ratio"):
        apply_osft(Toy(), ratio)


def test_ratio_quarter_on_32x64_matrix_freezes_24():
    model = tiny_model()
    apply_osft(model, 0.25)
    down = model.model.layers[0].mlp.down_proj  # weight [32, 64]
    assert isinstance(down, OSFTLinear)
    assert down.U_h.shape == (32, 24) and down.S_h.shape == (24,) and down.V_h.shape == (64, 24)
    assert down.U_l.shape == (32, 8) and down.S_l.shape == (8,) and down.V_l.shape == (64, 8)


def test_ratio_one_freezes_nothing_and_trains():
    model = tiny_model()
    ref = logits(model)
    state = apply_osft(model, 1.0)
    for m in state.modules.values():
        assert m.U_h.shape[1] == 0 and m.S_h.numel() == 0 and m.V_h.shape[1] == 0
        assert m.U_l.shape[1] == min(m.in_features, m.out_features) and m.U_l.requires_grad
    torch.testing.assert_close(logits(model), ref, atol=1e-5, rtol=0)
    before = {n: m.merged_weight().clone() for n, m in state.modules.items()}
    train(model, state, steps=2)
    assert all(not torch.equal(m.merged_weight(), before[n]) for n, m in state.modules.items())


def test_ratio_zero_has_no_trainable_factors_and_targets_never_change():
    model = tiny_model()
    ref = logits(model)
    state = apply_osft(model, 0.0)
    assert state.trainable_factors() == []
    for m in state.modules.values():
        assert m.U_l.numel() == m.S_l.numel() == m.V_l.numel() == 0 and not m.U_l.requires_grad
    torch.testing.assert_close(logits(model), ref, atol=1e-5, rtol=0)

    # Training everything else (embeddings, norms, head) leaves every target matrix bit-identical.
    before = {n: m.merged_weight().clone() for n, m in state.modules.items()}
    train(model, state, steps=3)
    for n, m in state.modules.items():
        assert torch.equal(m.merged_weight(), before[n])

    # With only targets trainable there is nothing to train, so the output cannot change.
    model = tiny_model()
    state = apply_osft(model, 0.0)
    for name, p in model.named_parameters():
        if not any(name.startswith(t + ".") for t in state.modules):
            p.requires_grad_(False)
    assert [p for p in model.parameters() if p.requires_grad] == []
    torch.testing.assert_close(logits(model), ref, atol=1e-5, rtol=0)


# --- targets --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_default_targets_and_logits_unchanged_after_apply(arch):
    model = tiny_model(arch)
    ref = logits(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    state = apply_osft(model, 0.5)
    # Every attention/MLP projection, i.e. every Linear except the LM head.
    assert set(state.modules) == linears - {"lm_head"}
    assert len(state.modules) == 7 * 2
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, OSFTLinear)
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    torch.testing.assert_close(logits(model), ref, atol=1e-5, rtol=0)
    if arch == "qwen2":  # bias kept as the same Parameter
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_explicit_target_suffixes():
    model = tiny_model()
    state = apply_osft(model, 0.5, target_modules=["q_proj", "v_proj"])
    assert list(state.modules) == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    ]
    assert type(model.model.layers[0].self_attn.k_proj) is nn.Linear


def test_bad_targets_are_reported():
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"'q_prj' matches nothing \(did you mean \"q_proj\"\?\)"):
        resolve_osft_targets(model, ["q_prj"])
    with pytest.raises(ConfigError, match=r"not an nn\.Linear"):
        resolve_osft_targets(model, ["mlp"])


def test_apply_twice_raises():
    model = tiny_model()
    apply_osft(model, 0.5)
    with pytest.raises(ConfigError, match="already applied"):
        apply_osft(model, 0.5)


def test_lora_and_osft_cannot_be_combined():
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="OSFT and LoRA cannot be combined"):
        apply_osft(get_peft_model(tiny_model(), config), 0.5)
    # LoRA layers injected without a PeftModel wrapper are caught too.
    with pytest.raises(ValueError, match="OSFT and LoRA cannot be combined"):
        apply_osft(inject_adapter_in_model(config, tiny_model()), 0.5)


# --- subspace preservation ------------------------------------------------------------------


@pytest.mark.parametrize("project", [True, False])
def test_frozen_singular_triplets_survive_training(project):
    """span(U_h) stays an invariant singular subspace: U_h^T W = S_h V_h^T and W V_h = U_h S_h.

    This (not "top-k subspace of W_new == span(U_h)") is what OSFT guarantees after arbitrary
    updates: the low part can grow singular values above min(S_h), reordering the spectrum
    while leaving the frozen triplets intact. Without projection (control) it breaks.
    """
    model = tiny_model()
    state = apply_osft(model, 0.5)
    frozen = {n: (m.U_h.clone(), m.S_h.clone(), m.V_h.clone()) for n, m in state.modules.items()}
    w0 = {n: m.merged_weight().clone() for n, m in state.modules.items()}
    train(model, state, steps=5, lr=5e-2, project=project)
    worst, reordered = 0.0, 0
    for n, m in state.modules.items():
        u_h, s_h, v_h = frozen[n]
        w = m.merged_weight()
        assert (w - w0[n]).norm() > 0.1 * w0[n].norm()  # training moved W substantially
        assert torch.equal(m.U_h, u_h) and torch.equal(m.S_h, s_h) and torch.equal(m.V_h, v_h)
        err = max(
            (u_h.T @ w - s_h[:, None] * v_h.T).abs().max().item(),
            (w @ v_h - u_h * s_h).abs().max().item(),
        )
        worst = max(worst, err)
        low = torch.linalg.svdvals(w - (u_h * s_h) @ v_h.T)
        reordered += int(low.max() > s_h.min())
    if project:
        assert worst < 1e-5
        # At this lr the low part overtakes min(S_h): top-k of W_new is no longer span(U_h),
        # which is why the invariance identities, not top-k angles, are the general test.
        assert reordered > 0
    else:
        assert worst > 1e-3


def test_top_k_singular_subspaces_unchanged_with_spectral_gap():
    """Principal angles between old U_h (V_h) and the new W's top-k singular vectors < 1e-4.

    Holds when the trained low part's singular values stay below min(S_h); like pretrained
    weights, we give the matrices a dominant top-k spectrum and check that condition explicitly.
    """
    model = tiny_model()
    ratio = 0.25
    with torch.no_grad():
        for name in resolve_osft_targets(model):
            w = model.get_submodule(name).weight
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            k = num_frozen_components(s.numel(), ratio)
            w.copy_(u @ torch.diag(s + (torch.arange(s.numel()) < k).float()) @ vh)
    state = apply_osft(model, ratio)
    old = {n: (m.U_h.clone(), m.V_h.clone()) for n, m in state.modules.items()}
    w0 = {n: m.merged_weight().clone() for n, m in state.modules.items()}
    train(model, state, steps=5, lr=3e-2)
    for n, m in state.modules.items():
        w, k = m.merged_weight(), m.num_frozen
        low = torch.linalg.svdvals((m.U_l * m.S_l) @ m.V_l.T)
        assert low.max() < 0.9 * m.S_h.min()  # the gap condition the claim needs
        assert (w - w0[n]).norm() > 0.02 * w0[n].norm()  # and the matrix did change
        u, _, vh = torch.linalg.svd(w.double(), full_matrices=False)
        u_h, v_h = old[n]
        assert principal_angles(u_h, u[:, :k]).max() < 1e-4
        assert principal_angles(v_h, vh[:k].T).max() < 1e-4


def test_applied_update_has_no_component_in_frozen_subspace():
    model = tiny_model()
    state = apply_osft(model, 0.5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    random_loss(model).backward()
    mods = list(state.modules.values())
    # The raw gradient does point into span(U_h) / span(V_h): projection has work to do.
    assert max((m.U_h.T @ m.U_l.grad).norm().item() for m in mods) > 1e-4
    assert max((m.V_h.T @ m.V_l.grad).norm().item() for m in mods) > 1e-4
    state.project_gradients()
    for m in mods:
        assert (m.U_h.T @ m.U_l.grad).norm() < 1e-6 and (m.V_h.T @ m.V_l.grad).norm() < 1e-6
    before = {id(m): (m.U_l.detach().clone(), m.V_l.detach().clone()) for m in mods}
    opt.step()
    # Adam's per-element scaling leaks the projected step back into span(U_h) ...
    leak = max((m.U_h.T @ (m.U_l - before[id(m)][0])).norm().item() for m in mods)
    assert leak > 1e-5
    state.reproject()  # ... which reproject removes.
    for m in mods:
        u0, v0 = before[id(m)]
        assert (m.U_h.T @ (m.U_l - u0)).norm() < 1e-6
        assert (m.V_h.T @ (m.V_l - v0)).norm() < 1e-6


# --- saving, resuming, dtypes ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_dense_save_round_trip(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(arch)
    state = apply_osft(model, 0.5)
    train(model, state, steps=2)
    dense = osft_dense_state_dict(model)
    for n, m in state.modules.items():
        assert not any(
            k.startswith(n + ".") and k.rsplit(".", 1)[1][:2] in ("U_", "S_", "V_") for k in dense
        )
        torch.testing.assert_close(dense[n + ".weight"].double(), naive_dense(m), atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path, state_dict=dense)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, OSFTLinear) for m in loaded.modules())
    expected = logits(model)
    torch.testing.assert_close(logits(loaded), expected, atol=1e-5, rtol=0)

    merged = unapply_osft(copy.deepcopy(model))
    assert not any(isinstance(m, OSFTLinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(loaded.state_dict())
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=0)


def test_resume_from_osft_state_dict():
    model = tiny_model()
    state = apply_osft(model, 0.5)
    train(model, state, steps=2)
    sd = model.state_dict()
    assert {"U_h", "S_h", "V_h", "U_l", "S_l", "V_l"} <= {k.rsplit(".", 1)[1] for k in sd}
    fresh = tiny_model(seed=123)
    apply_osft(fresh, 0.5, decompose=False)
    fresh.load_state_dict(sd)
    torch.testing.assert_close(logits(fresh), logits(model), atol=0, rtol=0)


def test_autocast_and_bf16():
    model = tiny_model()
    ref = logits(model)
    state = apply_osft(model, 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = random_loss(model)
        out = logits(model)
    loss.backward()
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=0)
    m = next(iter(state.modules.values()))
    assert m.U_l.grad is not None and m.U_l.grad.dtype == torch.float32

    bf16 = tiny_model().to(torch.bfloat16)
    ref16 = logits(bf16)
    state16 = apply_osft(bf16, 0.5)
    m = next(iter(state16.modules.values()))
    assert m.U_h.dtype == m.U_l.dtype == torch.bfloat16
    torch.testing.assert_close(logits(bf16).float(), ref16.float(), atol=5e-2, rtol=0)
    train(bf16, state16, steps=1)


# --- multi-process SVD ------------------------------------------------------------------------


class ToyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 24)
        self.o = nn.Linear(24, 16, bias=False)


class ToyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 40)
        self.down = nn.Linear(40, 16)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ToyAttention(), ToyMLP()])
        self.head = nn.Linear(16, 10)  # outside Attention/MLP: not a target


def _worker(rank: int, world_size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world_size
    )
    try:
        model = Toy()
        state = apply_osft(model, 0.5, rank=rank, world_size=world_size)
        torch.save(
            {"sd": model.state_dict(), "local": state.decomposed_locally}, f"{tmp}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def test_two_process_svd_split_and_broadcast(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    targets = ["blocks.0.q", "blocks.0.o", "blocks.1.up", "blocks.1.down"]
    assert r0["local"] == targets[0::2] and r1["local"] == targets[1::2]
    single = Toy()
    apply_osft(single, 0.5)
    expected = single.state_dict()
    assert r0["sd"].keys() == r1["sd"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(r0["sd"][key], r1["sd"][key]), key  # broadcast: bitwise identical
        torch.testing.assert_close(r0["sd"][key], value, atol=1e-6, rtol=0)
    assert math.isclose(
        float(r0["sd"]["blocks.1.down.S_h"][0]), float(expected["blocks.1.down.S_h"][0])
    )
