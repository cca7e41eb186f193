"""``grimoire estimate-memory``: the formulas by hand, against autograd, against measured peaks.

1. A 2-layer model worked out by hand: parameters, every part and every phase.
2. The per-token activation formula against what autograd really saves (``saved_tensors_hooks``
   on a transformers Llama) in fp32, under bf16 autocast and in bf16, full and LoRA.
3. The estimate against the measured peak of live tensors of real ``grimoire train`` runs
   (``benchmarks/memory_estimate.py --quick``): within 20% for four configurations.
4. The command: its table, its errors, and the tables of ``docs/multi-gpu.md`` regenerated.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from grimoire.cli.main import main as grimoire_main
from grimoire.model.activations import (
    Numerics,
    layer_bytes_per_token,
    model_bytes_per_token,
)
from grimoire.tools.memory import LoraShape, ModelShape, Setup, estimate, plan_from_config
from grimoire.tools.memory.report import verdict

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

# hidden 64, 2 layers, 4 heads of 16 (2 KV heads: K = 32 wide), MLP 128, vocab 100, untied.
SMALL = ModelShape(
    hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100
)
# Per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + gate/up/down 3 * 64*128, and 2 norms.
LAYER = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 2 * 64
TOTAL = 2 * LAYER + 100 * 64 + 100 * 64 + 64  # + embedding, head, final norm


def test_parameter_counts_by_hand():
    assert SMALL.layer_params == LAYER == 36992
    assert SMALL.total_params == TOTAL == 86848
    assert SMALL.root_params == 100 * 64 * 2 + 64
    # LoRA r=8 on q and v: A (8 x 64) and B (64 x 8) for q; A (8 x 64) and B (32 x 8) for v.
    lora = LoraShape(r=8, targets=("q_proj", "v_proj"))
    assert lora.adapter_params(SMALL) == 2 * (8 * (64 + 64) + 8 * (64 + 32))


def test_one_process_fp32_adamw_by_hand():
    setup = Setup(weight_dtype="float32", checkpointing=False, tokens=10, device="cuda")
    est = estimate(SMALL, setup)
    w = 4 * TOTAL
    assert est.part("weights").device == w
    assert est.part("gradients").device == w
    assert est.part("optimizer states").device == 2 * w
    # One fp32 layer keeps per token: 2 norms x (input 4H + 1/rms 4 + x*rsqrt 4H + output 4H),
    # attention 4 x (2 x 64 + 2 x 32) + lse 4 x 4 heads, MLP 3 x 4I + the product 4I.
    per_layer = 2 * (4 * 64 + 4 + 4 * 64 + 4 * 64) + 4 * (2 * 64 + 2 * 32) + 16 + 4 * 4 * 128
    assert layer_bytes_per_token(SMALL, Numerics.of(4, False, False)) == per_layer == 4376
    # Outside the layers: ids 8, cos/sin 2 x 16 x 4, final norm 4H + 4 + 4H, its output 4H.
    outside = 8 + 128 + (4 * 64 + 4) + 4 * 64 + 4 * 64
    flow = 2 * 4 * 64 * 10  # the hidden-state gradients in flight
    assert est.part("activations").device == (2 * per_layer + outside) * 10 + flow
    # Fused head, 10 rows in one chunk: fp32 logits [10, 100], the inputs [10, 64] and their grad.
    head = 4 * 10 * 100 + 2 * 4 * 10 * 64
    assert est.part("logits").device == head
    base = w + 2 * w  # weights + AdamW, live all along
    acts = (2 * per_layer + outside) * 10 + flow
    assert est.phases["backward start"] == base + acts + head + 4 * 100 * 64  # + head's grad
    assert est.phases["backward end"] == base + w + per_layer * 10 + flow
    assert est.phases["optimizer step"] == base + w
    assert est.peak == est.phases["backward end"]


def test_sharding_offload_and_hsdp_by_hand():
    full = Setup(weight_dtype="bfloat16", mixed_precision="bf16", world_size=8)
    ddp = estimate(SMALL, full)
    assert ddp.part("DDP gradient buckets").device == 2 * TOTAL
    fsdp = estimate(SMALL, full.with_(distributed="fsdp2"))
    assert fsdp.part("weights").device == 2 * TOTAL / 8
    assert fsdp.part("optimizer states").device == 2 * 2 * TOTAL / 8
    # Gathered in bf16: the root unit (embedding, head, final norm) and two layers.
    assert fsdp.part("gathered weights").device == 2 * (SMALL.root_params + 2 * LAYER)
    assert fsdp.part("logits").note.startswith("fused")  # FSDP2 gathers the head: fused chunks
    hsdp = estimate(SMALL, full.with_(distributed="fsdp2", shard_group=4))
    assert hsdp.part("weights").device == 2 * TOTAL / 4
    off = estimate(SMALL, full.with_(distributed="fsdp2", cpu_offload=True))
    assert off.part("weights").device == 0 and off.part("weights").host == 2 * TOTAL / 8
    assert off.host == 2 * TOTAL / 8 * (1 + 1 + 2)  # weights, gradients, AdamW on the host


def test_optimizers_and_lora_by_hand():
    one = Setup(weight_dtype="float32")
    # bitsandbytes: tensors of >= 4096 values keep 2 x (1 byte + an fp32 scale per 256); smaller
    # ones (k/v projections of 2048, the norms) two fp32 states.
    est = estimate(SMALL, one.with_(optimizer="adamw_8bit"))
    large = [4096, 4096, 8192, 8192, 8192] * 2 + [6400, 6400]
    small = [2048, 2048] * 2 + [64] * 5
    assert est.part("optimizer states").device == pytest.approx(
        sum(large) * 2 * (1 + 4 / 256) + 8 * sum(small)
    )
    assert estimate(SMALL, one.with_(optimizer="sgd")).part("optimizer states").device == 0
    # Muon: one fp32 momentum for the hidden matrices, two AdamW states for the rest.
    matrices = 2 * (LAYER - 128)
    muon = estimate(SMALL, one.with_(optimizer="muon")).part("optimizer states").device
    assert muon == 4 * matrices + 8 * (TOTAL - matrices)
    lora = LoraShape(r=8, targets=("q_proj", "v_proj"))
    est = estimate(SMALL, one.with_(lora=lora))
    adapters = lora.adapter_params(SMALL)
    assert est.part("weights (frozen base)").device == 4 * TOTAL
    assert est.part("weights (adapters)").device == 4 * adapters
    assert est.part("optimizer states").device == 8 * adapters


def test_reference_and_rollout_parts():
    one = Setup(weight_dtype="bfloat16", reference="model")
    assert estimate(SMALL, one).part("reference model").device == 2 * TOTAL
    assert "reference model" not in {p.name for p in estimate(SMALL, Setup()).parts}
    from grimoire.tools.memory import Rollout

    est = estimate(SMALL, Setup(weight_dtype="bfloat16", rollout=Rollout(sequences=8, length=50)))
    # Keys and values of 2 layers x 32 wide, bf16, for 8 sequences of 50; fp32 sampler logits x 2.
    assert est.part("rollout KV cache").device == 2 * 2 * 32 * 2 * 8 * 50 + 2 * 4 * 8 * 100
    assert "sampling" in est.phases


# --------------------------------------------------------------------------- against autograd


def _saved_bytes(model, ids, autocast):
    """Bytes autograd keeps for backward, each storage once, without parameters and their casts."""
    import torch

    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()}
    shapes |= {s[::-1] for s in shapes}
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        model(input_ids=ids)
    return sum(n for k, (n, s) in seen.items() if k not in params and s not in shapes)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")
@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16"])
@pytest.mark.parametrize("lora", [None, 0.0, 0.1], ids=["full", "lora", "lora-dropout"])
def test_activation_formula_matches_autograd(mode, lora):
    import torch
    from peft import LoraConfig, get_peft_model

    from grimoire.model.tiny import build_model
    from grimoire.tools.memory import shape_from_config

    model = build_model(
        "llama", vocab_size=512, hidden_size=128, num_layers=2, intermediate_size=384
    )
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    shape, adapter, decoder = shape_from_config(model.config), None, model.model
    if lora is not None:
        adapter = LoraShape(r=4, targets=("q_proj", "k_proj", "o_proj", "down_proj"), dropout=lora)
        peft = get_peft_model(
            model, LoraConfig(r=4, target_modules=list(adapter.targets), lora_dropout=lora)
        )
        peft.train()
        decoder = peft.base_model.model.model
    tokens = 96  # not a weight dimension, so weight casts are told apart by shape
    got = _saved_bytes(decoder, torch.randint(0, 512, (1, tokens)), mode == "autocast") / tokens
    num = Numerics.of(2 if mode == "bf16" else 4, mode != "fp32", False, device="cpu")
    want = shape.layers * layer_bytes_per_token(shape, num, adapter)
    want += model_bytes_per_token(shape, num, head_trains=False, lora=adapter)
    assert got == want


# --------------------------------------------------------------------------- against measurement


def test_estimate_within_20_percent_of_measured_peaks():
    """Four real runs (benchmarks/memory_estimate.py --quick), each in a fresh process."""
    from benchmarks import memory_estimate as bench

    rows = [bench.run_case(name, "quick") for name in bench.QUICK_CASES]
    print("\n" + bench.table(rows))
    assert len(rows) >= 4
    for row in rows:
        ratio = row["estimate"] / row["measured"]
        assert 0.8 <= ratio <= 1.2, f"{row['case']}: estimate / measured = {ratio:.2f}"


# --------------------------------------------------------------------------- the command


def _write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


RUN = """
model: {pretrained: MODEL}
dataset: {jsonl: train.jsonl}
loss: {type: dpo, ref_model: copy}
peft: null
training:
  distributed: fsdp2
  max_tokens_per_device: 4096
  learning_rate: 2e-5
"""


def test_command_prints_the_table(tmp_path, capsys):
    config = _write(tmp_path, RUN.replace("MODEL", str(ROOT / "docs/memory/llama-3-8b.json")))
    assert grimoire_main(["estimate-memory", "--config", config, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "optimizer states", "activations", "logits", "reference model"):
        assert re.search(rf"^\| {part} \| [\d.]+ \|", out, re.M), part
    assert "fsdp2 over 8 ranks" in out and "peak:" in out and "with gradient_checkpointing" in out
    # HSDP across 2 nodes: shards of 8 instead of 16.
    args = ["estimate-memory", "--config", config, "--world-size", "16", "--nodes", "2"]
    assert grimoire_main([*args, "--hsdp"]) == 0
    assert "HSDP: shards of 8, 2 replicas" in capsys.readouterr().out


def test_plan_reads_the_run_config(tmp_path):
    raw = {
        "model": {"pretrained": "tiny:llama", "model_kwargs": {"dtype": "bf16"}},
        "loss": {"type": "grpo", "args": {"reward_funcs": "exact_match", "beta": 0.1}},
        "peft": {"r": 4, "target_modules": ["q_proj"]},
        "training": {"max_length": 64, "batch_size": 2, "gradient_checkpointing": "auto"},
    }
    plan = plan_from_config(raw, world_size=2)
    setup = plan.setup
    assert (
        setup.weight_dtype == "bfloat16" and setup.checkpointing and setup.reference == "adapters"
    )
    assert setup.lora.targets == ("q_proj",) and setup.rollout is not None
    assert setup.tokens == 2 * 8 * (64 + 256)  # batch x G x (prompt + max_new_tokens)
    raw["loss"]["cache_reference"] = True
    assert plan_from_config(raw).setup.reference == "cached"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "missing.yaml"], "cannot read config"),
        (["--world-size", "3", "--nodes", "2", "--model", "tiny:llama"], "not a multiple"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        ([], "give --config"),
        (["--model", "tiny:llama", "--set", "training.optimizer=adamx"], "optimizer='adamx'"),
        (["--model", "tiny:llama", "--shard-group-size", "2", "--world-size", "4"], "fsdp2"),
    ],
)
def test_command_errors_clearly(args, message, capsys):
    assert grimoire_main(["estimate-memory", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grimoire estimate-memory: ") and message in err


def test_verdict_keeps_room_for_the_context():
    device = 80 * GIB
    assert verdict(70 * GIB, device) == "fits"
    assert verdict(77 * GIB, device) == "tight"
    assert verdict(81 * GIB, device) == "does not fit"


def test_docs_tables_are_what_the_command_prints(capsys):
    """Each table in docs/multi-gpu.md under a ``<!-- estimate-memory ARGS -->`` marker is the
    output of ``grimoire estimate-memory ARGS`` (so the docs cannot drift from the tool)."""
    doc = (ROOT / "docs/multi-gpu.md").read_text()
    blocks = re.findall(r"<!-- estimate-memory (.+?) -->\n\n((?:\|.*\n)+)", doc)
    assert len(blocks) >= 4
    for args, table in blocks:
        assert grimoire_main(["estimate-memory", *shlex.split(args)]) == 0
        printed = capsys.readouterr().out
        assert table.strip() in printed, f"docs/multi-gpu.md is stale for: {args}"
