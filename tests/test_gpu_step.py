"""The GPU step, checked on a CPU: host reads per optimizer step, width buckets, host counts.

- An SFT and a DPO step (packed and padded, two micro-batches each) read the device back ONCE
  (``tests/helpers/syncs.py`` counts every op that is a host sync on CUDA); before this change
  the same steps read 14 to 18 times.
- Padded micro-batches rounded up to ``pad_to_multiple_of``: widths at the boundaries, and the
  same losses and parameters as without buckets.
- The counts the collators make on the host (targets, tokens, attention segments) equal what
  the device tensors say, and the LM head's sync-free gather equals ``nonzero``.
- The LM head's ``uniform_grad`` promise is checked on the device inside the step: a broken
  promise fails the step before the optimizer applies it.
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.helpers.syncs import HostReads, step_reads
from tests.helpers.train_utils import RecordLosses, params_of, quiet_config

from grimoire import GrimoireTrainer
from grimoire.collate.buckets import WidthBuckets, bucket_multiple, bucket_widths, round_up
from grimoire.collate.common import collate_prefixed
from grimoire.collate.packing import pack_samples
from grimoire.collate.preference import PreferenceCollator
from grimoire.collate.prompts import GRPOCollator
from grimoire.collate.sft import SFTCollator
from grimoire.config.training import TrainingConfig
from grimoire.contract.layout import LAYOUT_KEY, Padded, layout_of
from grimoire.errors import ConfigError
from grimoire.forward.fused_head import target_index
from grimoire.forward.head import function as hfn
from grimoire.forward.logprobs import compute_token_logps, shift_labels
from grimoire.losses import DPOLoss, SFTLoss
from grimoire.model.packed_attention import enable_packed_attention, sample_lengths
from grimoire.model.tiny import build_model, build_tokenizer
from grimoire.normalise.units import count_tokens
from grimoire.training.step import BrokenPromiseError

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 0


def sft_rows(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(3, 60) for _ in range(rng.choice([4, 6, 21, 40]))]
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return rows


def pair_rows(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(3, 60) for _ in range(rng.choice([3, 10]))]
        sides = {}
        for side in ("chosen_", "rejected_"):
            answer = [rng.randrange(3, 60) for _ in range(rng.choice([2, 20]))]
            ids = prompt + answer
            sides[f"{side}input_ids"] = ids
            sides[f"{side}labels"] = [-100] * len(prompt) + answer
            sides[f"{side}attention_mask"] = [1] * len(ids)
        rows.append(sides)
    return rows


# --------------------------------------------------------------------------- host reads per step


@pytest.mark.parametrize("method", ["sft", "dpo"])
@pytest.mark.parametrize("packed", [True, False])
def test_an_optimizer_step_reads_the_device_back_once(tmp_path, method, packed):
    """Two micro-batches per step; padded runs with grimoire's attention, as on CUDA (on a CPU
    the padded path keeps transformers' sdpa, whose mask checks read the device, harmlessly
    there). Steps after the first are counted (the first runs the fused head's one-time
    self-check, once per model)."""
    model = build_model("llama", seed=0)
    if method == "sft":
        loss, rows = SFTLoss(), sft_rows()
    else:
        ref = build_model("llama", seed=0)
        enable_packed_attention(ref)
        loss, rows = DPOLoss(ref_model=ref), pair_rows()
    enable_packed_attention(model)
    config = quiet_config(
        tmp_path, max_steps=3, batch_size=4, gradient_accumulation_steps=2, padding_free=packed
    )
    trainer = GrimoireTrainer(model, build_tokenizer(), config, loss, rows)
    reads = step_reads(trainer)
    trainer.train()
    assert trainer.packed is packed and len(reads) == 3
    for step in reads[1:]:
        # The one read: the step's metrics, flags and gradient norm in one .tolist().
        assert len(step) == 1, step
        assert step[0][0] == "Tensor.tolist" and "reduction.py" in step[0][1]
    # The first step adds only the fused head's one-time self-check (once per model).
    assert all("_self_check" in site or "reduction.py" in site for _, site in reads[0])


def test_the_counter_sees_what_the_old_step_read(tmp_path):
    """The counter itself: the reads this change removed are each seen when made."""
    t = torch.tensor([1.0, 0.0, 2.0])
    with HostReads("cpu") as reads:
        float(t.sum())
        t.nonzero()
        t[t > 0]
        t.tolist()
        bool((t == t[:1]).all())
    ops = [op for op, _ in reads.where]
    assert ops.count("aten._local_scalar_dense.default") == 2
    assert ops.count("aten.nonzero.default") == 1
    assert ops.count("aten.index.Tensor") == 1  # a boolean mask: a nonzero inside the kernel
    assert "Tensor.tolist" in ops
    with HostReads("cuda") as reads:  # another device's tensors are not counted
        float(t.sum())
    assert reads.count == 0


def test_a_broken_uniform_grad_promise_fails_the_step(tmp_path):
    """Inside the step the head's backward checks the promise on the device (no read); a loss
    that breaks it is stopped before the optimizer applies the wrong head gradient."""

    class Weighted(SFTLoss):
        def __call__(self, model, batch, training=True):
            out = compute_token_logps(
                model,
                batch["input_ids"],
                batch["labels"],
                attention_mask=batch.get("attention_mask"),
                uniform_grad=True,
            )
            weights = torch.linspace(0.5, 1.5, out.logps.shape[1])
            return -(out.logps * weights).sum() / out.mask.sum(), {}

    model = build_model("llama", seed=0)
    before = params_of(model)
    config = quiet_config(tmp_path, max_steps=1, batch_size=4, padding_free=False)
    trainer = GrimoireTrainer(model, build_tokenizer(), config, Weighted(), sft_rows(4))
    with pytest.raises(BrokenPromiseError, match="uniform_grad"):
        trainer.train()
    after = params_of(trainer.unwrapped_model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_deferred_checks_keep_the_hidden_gradient_exact():
    """Under the deferred check, unequal upstream grads give the exact hidden-state gradient
    (scaled per row) and a set flag; equal grads leave the flag clear."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30)
    hidden = torch.randn(7, 8, requires_grad=True)
    targets = torch.randint(0, 30, (7,))
    params = list(head.parameters())
    spec = hfn._HeadSpec(head, [], False, "cpu", len(params), chunk_size=3, uniform_grad=True)
    g = torch.linspace(0.1, 1.0, 7)
    ref = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    (want,) = torch.autograd.grad((ref * g).sum(), [hidden])
    for weights, broken in ((g, True), (torch.full((7,), 0.3), False)):
        with hfn.deferred_promise_checks() as checks:
            out = hfn._HeadLogps.apply(hidden, targets, spec, *params)
        (got,) = torch.autograd.grad((out * weights).sum(), [hidden])
        assert bool(checks.broken) is broken
        if broken:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- width buckets


def test_widths_round_up_at_the_boundaries():
    assert [round_up(w, 64) for w in (1, 63, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 192]
    assert round_up(37, 1) == 37
    assert (bucket_multiple(None, "cuda"), bucket_multiple(None, "cpu")) == (64, 1)
    assert bucket_multiple(16, "cpu") == 16
    with pytest.raises(ConfigError, match="pad_to_multiple_of"):
        TrainingConfig(pad_to_multiple_of=0)


def test_bucketed_batches_are_padding_like_any_other():
    rows = sft_rows(4, seed=1)
    plain = SFTCollator(PAD)(rows)
    width = plain["input_ids"].shape[1]
    for multiple, want in ((8, round_up(width, 8)), (width, width)):  # an exact multiple stays
        out = WidthBuckets(SFTCollator(PAD), multiple, PAD)(rows)
        assert out["input_ids"].shape == out["labels"].shape == (4, want)
        extra = slice(width, None)
        assert (out["input_ids"][:, extra] == PAD).all() and (out["labels"][:, extra] == -100).all()
        assert (out["attention_mask"][:, extra] == 0).all()
        assert torch.equal(out["input_ids"][:, :width], plain["input_ids"])
        assert count_tokens(out) == count_tokens(plain) and layout_of(out) == Padded()
        assert layout_of(out).num_targets == layout_of(plain).num_targets
    pairs = PreferenceCollator(PAD)(pair_rows(3))
    out = bucket_widths(pairs, 16, PAD)
    assert out["chosen_input_ids"].shape[1] == out["rejected_input_ids"].shape[1]
    assert out["chosen_input_ids"].shape[1] % 16 == 0


def test_what_is_not_bucketed():
    prompts = GRPOCollator(PAD)([{"prompt_input_ids": [5, 6, 7]}, {"prompt_input_ids": [5]}])
    assert bucket_widths(prompts, 8, PAD)["prompt_input_ids"].shape[1] == 3  # left-padded
    rows = sft_rows(2)
    batch = collate_prefixed(rows, PAD)
    batch["token_weights"] = torch.ones_like(batch["labels"], dtype=torch.float)
    assert bucket_widths(batch, 8, PAD)["input_ids"].shape == batch["input_ids"].shape
    width = SFTCollator(PAD)(rows)["input_ids"].shape[1]
    capped = WidthBuckets(SFTCollator(PAD), 64, PAD, max_tokens=2 * width)(rows)
    assert capped["input_ids"].shape[1] == width  # rounding up would break the token budget


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_bucketed_training_equals_unbucketed(tmp_path, method):
    """Parity: the padded path with buckets of 16 trains the same losses and parameters (SGD, so
    parameters move by the gradients themselves: Adam's sign-like first steps would turn float
    rounding on near-zero gradients into full-size differences)."""
    results = []
    for multiple in (None, 16):
        model = build_model("llama", seed=0)
        if method == "sft":
            loss, rows = SFTLoss(), sft_rows(8)
        else:
            loss, rows = DPOLoss(ref_model=build_model("llama", seed=0)), pair_rows(8)
        record = RecordLosses()
        config = quiet_config(
            tmp_path / str(multiple),
            max_steps=3,
            batch_size=4,
            padding_free=False,
            pad_to_multiple_of=multiple,
            optimizer="sgd",
            learning_rate=0.1,
        )
        trainer = GrimoireTrainer(model, build_tokenizer(), config, loss, rows, callbacks=[record])
        micro = trainer.loader.step(0, 0)  # (the first step's micro-batches, as collated)
        widths = [b[k].shape[1] for b, _ in micro for k in b if k.endswith("input_ids")]
        assert all(w % (multiple or 1) == 0 for w in widths)
        trainer.train()
        results.append((record.losses, params_of(trainer.unwrapped_model)))
    (plain_losses, plain), (bucket_losses, bucketed) = results
    assert bucket_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    for name, p in plain.items():
        torch.testing.assert_close(bucketed[name], p, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- host-side counts


def test_host_counts_equal_what_the_device_tensors_say():
    rows = sft_rows(6, seed=2)
    for batch in (SFTCollator(PAD)(rows), pack_samples(rows, PAD, pad_to_multiple_of=16)):
        targets = shift_labels(batch["labels"], batch.get("position_ids")) != -100
        assert layout_of(batch).num_targets == int(targets.sum())
    packed = pack_samples(rows, PAD, pad_to_multiple_of=16)
    layout = packed[LAYOUT_KEY]
    row_len = packed["input_ids"].shape[1]
    assert list(layout.attention_segments(row_len)) == sample_lengths(packed["position_ids"], 1)[0]
    # Pretrain blocks: documents restart inside a sample, and a block whose positions continue
    # the previous one's (2 -> 3) continues its document: segments follow position_ids exactly
    # as transformers' find_packed_sequence_indices reads them.
    blocks = [
        {"input_ids": [5] * 6, "labels": [5] * 6, "position_ids": [0, 1, 2, 0, 1, 2]},
        {"input_ids": [6] * 4, "labels": [6] * 4, "position_ids": [3, 4, 0, 1]},
    ]
    row = pack_samples(blocks, PAD)
    assert row[LAYOUT_KEY].segments == (3, 5, 2)
    assert list(row[LAYOUT_KEY].attention_segments(10)) == sample_lengths(row["position_ids"], 1)[0]
    targets = shift_labels(row["labels"], row["position_ids"]) != -100
    assert row[LAYOUT_KEY].num_targets == int(targets.sum())


def test_the_heads_gather_without_nonzero_equals_nonzero():
    gen = torch.Generator().manual_seed(0)
    for p in (0.0, 0.3, 1.0):
        mask = torch.rand(97, generator=gen) < p
        want = mask.nonzero().squeeze(-1)
        with HostReads("cpu") as reads:
            got = target_index(mask, int(want.numel()))
        assert torch.equal(got, want) and reads.count == 0
    with pytest.raises(RuntimeError, match="target count"):
        target_index(torch.tensor([True, False, True]), 1)
