"""Correctness checks that need a CUDA GPU; run by ``benchmarks/gpu_check.sh`` (one section each).

    python benchmarks/gpu_checks.py head-parity   # fused head (eager + recompute) vs full logits
    python benchmarks/gpu_checks.py liger         # use_liger=True: same first loss, loss falls
    python benchmarks/gpu_checks.py precision     # mixed_precision="auto" resolves to bf16 here
    python benchmarks/gpu_checks.py sdpa-shapes   # per-sample sdpa: default kernels vs no cuDNN
    python benchmarks/gpu_checks.py varlen-parity # packed rows: varlen kernel vs per-sample sdpa
    python benchmarks/gpu_checks.py step-syncs    # host syncs per SFT / DPO step on CUDA

Each prints what it measured and exits non-zero when a check fails. Nothing in CI runs this.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile

import torch

try:  # imported as benchmarks.gpu_checks (the repository root on sys.path)
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import common as bench

#: ``GPU_CHECK_DEVICE=cpu`` dry-runs the checks' logic on a CPU (slow, bf16 bounds the same).
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")


def _model():
    """The checks' model: a 2-layer x 512 Llama, untied 32k vocabulary, on ``DEVICE``."""
    return bench.tiny_llama(32000, 512, 2, 1024).to(DEVICE)


def head_parity() -> bool:
    """Log-probs and gradients of the fused head (eager and recompute routes) against the
    full-logits path on CUDA, fp32 and bf16 autocast, several chunks per call."""
    from grimoire.forward import fused_head as fh
    from grimoire.forward.logprobs import compute_token_logps

    torch.manual_seed(0)
    model = _model()
    ids = torch.randint(3, 32000, (4, 300), device=DEVICE)
    labels = ids.clone()
    labels[:, :50] = -100
    ok = True
    for bf16 in (False, True):
        results = {}
        for name, kw in (
            ("full", dict(fused=False)),
            ("recompute", dict(fused=True)),
            ("eager", dict(fused=True, uniform_grad=True)),
        ):
            model.zero_grad(set_to_none=True)
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
                out = compute_token_logps(model, ids, labels, chunk_size=256, **kw)
                loss = -out.logps.sum() / out.mask.sum()
            loss.backward()
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
            results[name] = (out.logps.detach().float(), grads)
        assert fh._STATE[model].checked and fh._STATE[model].disabled is None
        ref_logps, ref_grads = results["full"]
        for name in ("recompute", "eager"):
            logps, grads = results[name]
            err = float((logps - ref_logps).abs().max())
            rel = max(
                float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                for n, g in ref_grads.items()
            )
            bound = (0.05, 0.03) if bf16 else (1e-3, 1e-3)
            good = err <= bound[0] and rel <= bound[1]
            ok &= good
            print(
                f"{'bf16' if bf16 else 'fp32'} {name:<9}: max |logp - full| {err:.2e}, "
                f"max grad rel err {rel:.2e} (bounds {bound}) {'ok' if good else 'FAIL'}"
            )
    return ok


def _sft_rows(n: int = 64, length: int = 128, vocab: int = 32000):
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 16 + ids[16:]})
    return rows


def _train(use_liger: bool, steps: int = 12) -> list[float]:
    from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
    from grimoire.losses import SFTLoss
    from grimoire.model.tiny import build_tokenizer

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics):
            losses.append(loss)

    rows = _sft_rows()
    with tempfile.TemporaryDirectory() as out:
        config = TrainingConfig(
            output_dir=out,
            max_steps=steps,
            batch_size=8,
            learning_rate=1e-3,
            lr_scheduler="constant",
            warmup_ratio=0.0,
            logging_steps=1,
            progress_bar=False,
            save_on_epoch_end=False,
            use_liger=use_liger,
            seed=0,
        )
        trainer = GrimoireTrainer(
            _model(), build_tokenizer(), config, SFTLoss(), rows, callbacks=[Losses()]
        )
        trainer.train()
        trainer.close()
    return losses


def liger() -> bool:
    """``use_liger=True`` against the same run without it: first losses agree (same model, same
    batch, bf16 kernels), and the loss falls."""
    plain, patched = _train(False), _train(True)
    first = abs(plain[0] - patched[0]) / plain[0]
    ok = first < 0.02 and patched[-1] < patched[0] - 0.1 and all(map(math.isfinite, patched))
    print(f"no liger: {plain[0]:.4f} -> {plain[-1]:.4f}")
    print(f"liger   : {patched[0]:.4f} -> {patched[-1]:.4f}; first-step rel diff {first:.2e}")
    print("ok" if ok else "FAIL")
    return ok


def precision() -> bool:
    from grimoire.model.precision import resolve_auto

    logging.basicConfig(level=logging.INFO)
    resolved = resolve_auto("auto")
    print(f"auto -> {resolved} (torch.cuda.is_bf16_supported() = {torch.cuda.is_bf16_supported()})")
    return resolved == "bf16"


def sdpa_shapes() -> bool:
    """Causal sdpa fwd+bwd over 32 samples of distinct lengths (a packed row's per-sample calls),
    twice (new shapes, then the same shapes again), with torch's default kernel choice and with
    cuDNN excluded (grimoire.model.packed_attention on CUDA). Tests the suspicion that cuDNN's
    per-length plans made the packed path slow on an H200 (docs/performance.md)."""
    import contextlib
    import time

    from grimoire.model.packed_attention import sdpa_backends

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 2048, (32,), generator=g).tolist()

    def one_pass(offset: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n in lengths:
            q, k, v = (
                torch.randn(
                    1, 4, n + offset, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True
                )
                for _ in range(3)
            )
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    variants = (
        ("default", contextlib.nullcontext()),
        ("no cuDNN", sdpa_backends(torch.device(DEVICE))),
    )
    for offset, (name, kernels) in enumerate(variants):
        # Each variant gets lengths the other has not seen (offset), so both start cold.
        with kernels:
            cold, warm = one_pass(offset), one_pass(offset)
        print(f"{name:<9}: 32 new lengths {cold:.3f} s, the same again {warm:.3f} s")
    return True


def _packed_rows(n: int = 24, vocab: int = 32000, seed: int = 0) -> list[dict]:
    """Rows of many distinct lengths (16..700), the first quarter of each a masked prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in torch.randint(16, 700, (n,), generator=g).tolist():
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (length // 4) + ids[length // 4 :]})
    return rows


def varlen_parity() -> bool:
    """A packed row's log-probs and gradients through the varlen route (one kernel call per
    layer; the route the run would pick is printed) against the per-sample sdpa route, bf16
    autocast, on ``DEVICE``. On a CPU (``GPU_CHECK_DEVICE=cpu``) both are the per-sample route."""
    from grimoire.collate.packing import pack_samples
    from grimoire.contract.layout import LAYOUT_KEY, to_device
    from grimoire.forward.batch import sample_token_logps
    from grimoire.losses.preference import policy_compute
    from grimoire.model import packed_attention as pa
    from grimoire.model import varlen_attention as va
    from grimoire.model.packed_attention import enable_packed_attention

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    model = bench.tiny_llama(32000, 512, 2, 2048).to(DEVICE)  # head_dim 128
    enable_packed_attention(model)
    batch = to_device(pack_samples(_packed_rows(), 0), DEVICE)
    print(
        f"kernels: {va.describe() if DEVICE == 'cuda' else 'cpu'}; "
        f"{batch[LAYOUT_KEY].num_samples} samples, {batch['input_ids'].shape[1]} tokens"
    )
    calls = {"varlen": 0}
    real = va.varlen_forward

    def counted(*a, **k):
        calls["varlen"] += 1
        return real(*a, **k)

    pa.varlen_forward = counted
    results = {}
    for name, route in (("varlen", pa.route_for), ("per-sample", lambda q, d: ("per_sample", ""))):
        pa.route_for = route
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = sample_token_logps(
                policy_compute(model, fused=True, chunk_size=1024),
                batch["input_ids"],
                batch["labels"],
                batch[LAYOUT_KEY],
                position_ids=batch["position_ids"],
            )
            loss = -out.logps.sum() / out.mask.sum()
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        results[name] = (out.logps.detach().float(), grads)
    pa.route_for, pa.varlen_forward = va.route_for, real
    (logps, grads), (ref, ref_grads) = results["varlen"], results["per-sample"]
    err = float((logps - ref).abs().max())
    rel = max(
        float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        for n, g in ref_grads.items()
    )
    ok = err <= 0.05 and rel <= 0.03
    print(f"varlen calls in the varlen pass: {calls['varlen']} (layers: 2, forward only)")
    print(
        f"max |logp varlen - per-sample| {err:.2e}, max grad rel err {rel:.2e} (bounds 0.05, "
        f"0.03) {'ok' if ok else 'FAIL'}"
    )
    return ok and (calls["varlen"] == 2 or DEVICE != "cuda")


def step_syncs() -> bool:
    """Host reads per optimizer step of SFT and DPO on ``DEVICE`` (the default config: auto
    packing, bf16), counted two ways: the dispatch-mode counter of tests/helpers/syncs.py, and
    torch's own CUDA sync detector (``set_sync_debug_mode``). Steps 2+ must read at most twice."""
    import warnings

    from tests.helpers.syncs import step_reads

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses import DPOLoss, SFTLoss
    from grimoire.model.tiny import build_tokenizer

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ok = True
    for name in ("sft", "dpo"):
        rows, loss = _packed_rows(32), SFTLoss()
        if name == "dpo":  # pairs: each row as chosen, the next row as rejected
            pairs = []
            for chosen, rejected in zip(rows, rows[1:] + rows[:1]):
                pair = {}
                for side, r in (("chosen_", chosen), ("rejected_", rejected)):
                    pair[f"{side}input_ids"], pair[f"{side}labels"] = r["input_ids"], r["labels"]
                    pair[f"{side}attention_mask"] = [1] * len(r["input_ids"])
                pairs.append(pair)
            rows, loss = pairs, DPOLoss(ref_model=_model())
        with tempfile.TemporaryDirectory() as out:
            config = TrainingConfig(
                output_dir=out,
                max_steps=4,
                batch_size=8,
                gradient_accumulation_steps=2,
                progress_bar=False,
                save_on_epoch_end=False,
                logging_steps=1,
            )
            trainer = GrimoireTrainer(_model(), build_tokenizer(), config, loss, rows)
            reads = step_reads(trainer, DEVICE)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if DEVICE == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    trainer.train()
                finally:
                    if DEVICE == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
            trainer.close()
        syncing = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        counts = [len(r) for r in reads]
        good = all(c <= 2 for c in counts[1:])
        ok &= good
        print(
            f"{name}: packed={trainer.packed}; reads per step {counts}; "
            f"CUDA sync warnings over the run: {len(syncing)} {'ok' if good else 'FAIL'}"
        )
        for op, site in reads[-1]:
            print(f"   last step: {op} at {site}")
        for line in sorted(set(syncing))[:10]:
            print(f"   sync warning: {line}")
    return ok


CHECKS = {
    "head-parity": head_parity,
    "liger": liger,
    "precision": precision,
    "sdpa-shapes": sdpa_shapes,
    "varlen-parity": varlen_parity,
    "step-syncs": step_syncs,
}

if __name__ == "__main__":
    name = sys.argv[1]
    sys.exit(0 if CHECKS[name]() else 1)
