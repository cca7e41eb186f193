"""A batch's layout is a type stated by whoever built it (collators, the rollout), and one
forward helper dispatches on it: every collator says Padded or Packed, Packed carries the right
host-side lengths, and the helper gives the same per-sample log-probs for both layouts."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from grimoire.collate.common import collate_prefixed
from grimoire.collate.kto import KTOCollator, PackedKTOCollator
from grimoire.collate.packing import PackedCollator, pack_row_sides, pack_samples
from grimoire.collate.preference import PAIR_SIDES, PackedPairCollator, PreferenceCollator
from grimoire.collate.prompts import GRPOCollator
from grimoire.collate.sft import SFTCollator
from grimoire.contract.layout import LAYOUT_KEY, Packed, Padded, layout_of, num_rows
from grimoire.forward.batch import (
    rows_per_side,
    sample_token_logps,
    side_rows,
    sides_token_logps,
)
from grimoire.losses.base import GrimoireLoss
from grimoire.losses.preference import pair_forward, policy_compute
from grimoire.model.tiny import build_model
from grimoire.rollout.batches import placeholder_batch, training_batch
from grimoire.rollout.engines.base import Rollout
from grimoire.training.trainer import GrimoireTrainer

PAD = 0
LENS = (5, 2, 7, 1, 4)


def sft_samples(lens=LENS) -> list[dict]:
    out = []
    for i, n in enumerate(lens):
        ids = [3 + (7 * i + 5 * t) % 60 for t in range(n)]
        labels = [-100] * min(1, n - 1) + ids[min(1, n - 1) :]  # first token untrained
        out.append({"input_ids": ids, "labels": labels})
    return out


def pair_samples() -> list[dict]:
    chosen, rejected = sft_samples((4, 6, 3)), sft_samples((5, 2, 6))
    return [
        {
            "chosen_input_ids": c["input_ids"],
            "chosen_labels": c["labels"],
            "rejected_input_ids": r["input_ids"],
            "rejected_labels": r["labels"],
            "margin": 0.5,
        }
        for c, r in zip(chosen, rejected)
    ]


def kto_samples() -> list[dict]:
    rows = []
    for i, (p, c) in enumerate([(3, 2), (2, 4), (4, 3)]):
        ids = [10 + i] * p + [20 + i + t for t in range(c)]
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": [1] * len(ids),
                "labels": [-100] * p + ids[p:],
                "completion_start": p,
                "label": i % 2 == 0,
            }
        )
    return rows


# --------------------------------------------------------------------------- the type


def test_packed_host_lengths_and_offsets():
    layout = Packed((3, 1, 2))
    assert layout.num_samples == 3 and layout.num_tokens == 6 and layout.max_seqlen == 3
    assert layout.cu_seqlens == (0, 3, 4, 6)
    assert all(type(n) is int for n in layout.cu_seqlens)  # host values: no device sync
    assert Packed([3, 1, 2]) == layout  # lists are normalised to tuples
    assert layout.split(1) == (Packed((3,)), Packed((1, 2)))
    for bad in [(), (2, 0)]:
        with pytest.raises(ValueError):
            Packed(bad)


def test_layout_of_plain_dict_is_padded():
    assert layout_of({"input_ids": torch.ones(2, 3)}) == Padded()
    assert layout_of({LAYOUT_KEY: Packed((2,))}) == Packed((2,))
    with pytest.raises(TypeError, match="Padded or Packed"):
        layout_of({LAYOUT_KEY: "packed"})


# --------------------------------------------------------------------------- packed collators


def test_packed_collator_states_its_lengths():
    batch = PackedCollator(PAD)(sft_samples())
    assert batch[LAYOUT_KEY] == Packed(LENS)
    assert batch[LAYOUT_KEY].cu_seqlens == (0, 5, 7, 14, 15, 19)
    assert batch["input_ids"].shape == (1, sum(LENS))
    assert "seq_lens" not in batch  # the layout is the one record of the lengths


def test_pack_one_sample_and_exact_fit_and_padding_excluded():
    one = pack_samples(sft_samples((4,)), PAD)
    assert one[LAYOUT_KEY] == Packed((4,)) and one[LAYOUT_KEY].cu_seqlens == (0, 4)
    exact = pack_samples(sft_samples((3, 5)), PAD, pad_to_multiple_of=8)
    assert exact["input_ids"].shape == (1, 8) and exact[LAYOUT_KEY] == Packed((3, 5))
    padded = pack_samples(sft_samples((3, 4)), PAD, pad_to_multiple_of=8)
    assert padded["input_ids"].shape == (1, 8)  # one pad token appended...
    assert padded[LAYOUT_KEY] == Packed((3, 4))  # ...that is no sample
    assert padded[LAYOUT_KEY].cu_seqlens[-1] == 7


def test_pack_row_sides_and_pair_collator_list_every_side_in_order():
    rows = pair_samples()
    chosen = tuple(len(r["chosen_input_ids"]) for r in rows)
    rejected = tuple(len(r["rejected_input_ids"]) for r in rows)
    batch = PackedPairCollator(PAD)(rows)
    assert batch[LAYOUT_KEY] == Packed(chosen + rejected)
    assert rows_per_side(batch, PAIR_SIDES) == len(rows)
    direct = pack_row_sides(rows, PAIR_SIDES, PAD, lambda k: k.startswith(PAIR_SIDES))
    assert direct[LAYOUT_KEY] == batch[LAYOUT_KEY]
    # Cut at the side boundary: two valid packed rows.
    first, second = side_rows(batch, PAIR_SIDES)
    assert first.layout == Packed(chosen) and second.layout == Packed(rejected)
    assert first.input_ids.shape[1] == sum(chosen) and second.position_ids[0, 0] == 0


def test_packed_kto_collator_lists_own_then_kl_samples():
    rows = kto_samples()
    padded = KTOCollator(PAD)(rows)
    packed = PackedKTOCollator(PAD)(rows)
    own = padded["attention_mask"].sum(-1).tolist()
    kl = padded["kl_attention_mask"].sum(-1).tolist()
    assert packed[LAYOUT_KEY] == Packed(tuple(own + kl))


def _rollout() -> Rollout:
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    return Rollout(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4]]),
        prompt_mask=prompt_mask,
        completion_ids=torch.tensor([[11, 12, 0, 0], [13, 14, 15, 16], [17, 0, 0, 0]]),
        completion_mask=completion_mask,
        old_logps=None,
        group_size=3,
        truncated=torch.zeros(3, dtype=torch.bool),
    )


def test_rollout_training_batches_state_their_layout():
    rollout = _rollout()
    assert layout_of(training_batch(rollout, [0, 1, 2], pack=False)) == Padded()
    packed = training_batch(rollout, [0, 1, 2], pack=True)
    assert packed[LAYOUT_KEY] == Packed((4, 7, 2))  # real prompt + completion tokens per row
    assert packed["input_ids"].shape == (1, 13)
    assert training_batch(rollout, [2], pack=True)[LAYOUT_KEY] == Packed((2,))
    prompts = GRPOCollator(PAD)([{"prompt_input_ids": [5, 6], "prompt": "x"}])
    assert prompts[LAYOUT_KEY] == Padded()
    assert layout_of(placeholder_batch(prompts, PAD, pack=False)) == Padded()
    assert placeholder_batch(prompts, PAD, pack=True)[LAYOUT_KEY] == Packed((3,))


# --------------------------------------------------------------------------- padded collators


def test_padded_collators_state_padded():
    sft = sft_samples()
    assert SFTCollator(PAD)(sft)[LAYOUT_KEY] == Padded()
    assert collate_prefixed(sft, PAD)[LAYOUT_KEY] == Padded()
    assert PreferenceCollator(PAD)(pair_samples())[LAYOUT_KEY] == Padded()
    assert KTOCollator(PAD)(kto_samples())[LAYOUT_KEY] == Padded()
    prompts = GRPOCollator(PAD)([{"prompt_input_ids": [5, 6], "answer": "a"}])
    assert prompts[LAYOUT_KEY] == Padded() and prompts["answer"] == ["a"]


# --------------------------------------------------------------------------- the one forward


@pytest.fixture(scope="module")
def model():
    return build_model("llama", vocab_size=64, seed=1).float().eval()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("multiple", [None, 8])
def test_helper_gives_the_same_sample_logps_packed_or_padded(model, fused, multiple):
    samples = sft_samples()
    compute = policy_compute(model, fused=fused, chunk_size=1024)
    padded = SFTCollator(PAD)(samples)
    packed = pack_samples(samples, PAD, pad_to_multiple_of=multiple)
    with torch.no_grad():
        want = sample_token_logps(
            compute,
            padded["input_ids"],
            padded["labels"],
            layout_of(padded),
            padded["attention_mask"],
        )
        got = sample_token_logps(
            compute,
            packed["input_ids"],
            packed["labels"],
            layout_of(packed),
            position_ids=packed["position_ids"],
        )
    assert got.logps.shape == want.logps.shape == (len(LENS), max(LENS))
    assert torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.logps, want.logps, atol=1e-5, rtol=0)


def test_pairs_and_kto_sides_match_across_layouts(model):
    compute = policy_compute(model, fused=False, chunk_size=1024)
    rows = pair_samples()
    with torch.no_grad():
        pads = pair_forward(PreferenceCollator(PAD)(rows), compute)
        packs = pair_forward(PackedPairCollator(PAD)(rows), compute)
        kto_pad = sides_token_logps(compute, KTOCollator(PAD)(kto_samples()), ("", "kl_"))
        kto_pack = sides_token_logps(compute, PackedKTOCollator(PAD)(kto_samples()), ("", "kl_"))
    for want, got in [*zip(pads, packs), *zip(kto_pad, kto_pack)]:
        # Padded sides share the batch's width; unpacked rows are as wide as their longest.
        w = got.logps.shape[1]
        assert not want.mask[:, w:].any()
        torch.testing.assert_close(got.logps, want.logps[:, :w], atol=1e-5, rtol=0)


def test_packed_row_needs_positions_and_no_mask(model):
    batch = pack_samples(sft_samples((2, 3)), PAD)
    compute = policy_compute(model, fused=False, chunk_size=1024)
    with pytest.raises(ValueError, match="position_ids"):
        sample_token_logps(compute, batch["input_ids"], batch["labels"], batch[LAYOUT_KEY])
    with pytest.raises(ValueError, match="attention_mask"):
        sample_token_logps(
            compute,
            batch["input_ids"],
            batch["labels"],
            batch[LAYOUT_KEY],
            torch.ones_like(batch["input_ids"]),
            batch["position_ids"],
        )


# --------------------------------------------------------------------------- transport


def test_layout_survives_pickling_and_dataloader_workers():
    batch = PackedPairCollator(PAD)(pair_samples())
    again = pickle.loads(pickle.dumps(batch))
    assert isinstance(again[LAYOUT_KEY], Packed) and again[LAYOUT_KEY] == batch[LAYOUT_KEY]
    loader = torch.utils.data.DataLoader(
        sft_samples(), batch_size=len(LENS), num_workers=1, collate_fn=PackedCollator(PAD)
    )
    (from_worker,) = list(loader)
    assert from_worker[LAYOUT_KEY] == Packed(LENS)


def test_trainer_moves_tensors_and_passes_the_layout_through():
    batch = pack_samples(sft_samples((2, 3)), PAD)
    stub = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")))
    moved = GrimoireTrainer._to_device(stub, batch)
    assert moved[LAYOUT_KEY] is batch[LAYOUT_KEY]
    assert torch.equal(moved["input_ids"], batch["input_ids"])


class _RowMean(GrimoireLoss):
    """A user method whose loss is a mean over samples: ``loss_weight`` is ``num_rows``."""

    def __call__(self, model, batch, training=True):
        raise NotImplementedError

    def create_collator(self, pad_token_id):
        return SFTCollator(pad_token_id)

    def loss_weight(self, batch):
        return float(num_rows(batch))

    def create_packed_collator(self, pad_token_id):
        return PackedCollator(pad_token_id)


def test_row_mean_loss_units_count_packed_samples_not_rows():
    method = _RowMean()
    assert method.loss_weight(SFTCollator(PAD)(sft_samples())) == len(LENS)
    assert method.loss_weight(pack_samples(sft_samples(), PAD)) == len(LENS)
