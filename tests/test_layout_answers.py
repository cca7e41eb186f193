"""The layout answers what the rest of the code asked the keys: rows, targets, tokens, whether a
batch holds prompts to evaluate; and the rollout packs and scores through the collators' packer
and the forward's one dispatch. Golden values come from naive loops over plain lists."""

from __future__ import annotations

import pytest
import torch

from grimoire.collate.common import pad_sequences
from grimoire.collate.packing import pack_samples
from grimoire.collate.prompts import GRPOCollator
from grimoire.collate.sft import SFTCollator
from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import (
    LAYOUT_KEY,
    is_prompt_batch,
    num_rows,
    num_targets,
    num_tokens,
    shift_labels,
)
from grimoire.forward.completions import batch_completion_logps
from grimoire.losses import GRPOMethod
from grimoire.model.tiny import build_model
from grimoire.rollout.batches import training_batch
from grimoire.rollout.engines.base import Rollout

PAD = 0
#: (input_ids, labels) of three SFT rows of different lengths; -100 = prompt, not trained.
ROWS = [
    ([5, 6, 7, 8], [-100, -100, 7, 8]),
    ([9, 10], [-100, 10]),
    ([11, 12, 13, 14, 15, 16], [-100, -100, -100, 14, 15, 16]),
]


def _sft_samples():
    return [{"input_ids": ids, "labels": labels} for ids, labels in ROWS]


def _naive_targets() -> int:
    """Trained targets by hand: a token is trained when its label is set and a token of the
    same row precedes it (the first token of a row predicts nothing)."""
    return sum(1 for _, labels in ROWS for t, lab in enumerate(labels) if t > 0 and lab != -100)


def test_shift_labels_is_a_naive_shift_that_never_crosses_a_sample():
    labels = torch.tensor([[1, 2, 3, 4, 5, 6]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])  # samples of 3, 2 and 1 tokens
    want = []
    for t in range(6):
        nxt = t + 1
        crosses = nxt < 6 and int(position_ids[0, nxt]) == 0
        want.append(IGNORE_INDEX if nxt == 6 or crosses else int(labels[0, nxt]))
    assert shift_labels(labels, position_ids).tolist() == [want]
    assert shift_labels(labels).tolist() == [[2, 3, 4, 5, 6, IGNORE_INDEX]]


@pytest.mark.parametrize("packed", [False, True])
def test_layout_counts_equal_the_counts_read_from_the_tensors(packed):
    batch = pack_samples(_sft_samples(), PAD) if packed else SFTCollator(PAD)(_sft_samples())
    plain = {k: v for k, v in batch.items() if k != LAYOUT_KEY}  # a user collator's dict
    assert num_targets(batch) == num_targets(plain) == _naive_targets()
    assert num_tokens(batch) == sum(len(ids) for ids, _ in ROWS)
    if not packed:  # a padded dict without its layout: the attention mask's real tokens
        assert num_tokens(plain) == num_tokens(batch)
    assert num_rows(batch) == len(ROWS)
    assert num_rows(plain) == (1 if packed else len(ROWS))  # a bare packed row is one row


def test_pad_sequences_pads_either_side_with_a_mask_of_the_values():
    ids, mask = pad_sequences([[1, 2], [3], []], 9, left=True, min_width=3)
    assert ids.tolist() == [[9, 1, 2], [9, 9, 3], [9, 9, 9]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    ids, mask = pad_sequences([[1, 2], [3]], 9)
    assert ids.tolist() == [[1, 2], [3, 9]] and mask.tolist() == [[1, 1], [1, 0]]


def _rollout() -> tuple[Rollout, list[list[int]], list[list[int]]]:
    """Two prompts x 2 completions, left-padded prompts and right-padded completions."""
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]
    completions = [[10, 11, 12], [13], [14, 15], [16, 17, 18]]
    prompt_ids, prompt_mask = pad_sequences(prompts, PAD, left=True)
    completion_ids, completion_mask = pad_sequences(completions, PAD)
    rollout = Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        old_logps=None,
        group_size=2,
        truncated=torch.zeros(4, dtype=torch.bool),
    )
    return rollout, prompts, completions


def test_a_packed_rollout_batch_is_the_collators_packed_row_of_its_real_tokens():
    rollout, prompts, completions = _rollout()
    batch = training_batch(rollout, [0, 1, 2, 3], pack=True)
    samples = [
        {"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c}
        for p, c in zip(prompts, completions)
    ]
    want = pack_samples(samples, PAD)
    for key in ("input_ids", "labels", "position_ids", "sample_index"):
        assert torch.equal(batch[key], want[key]), key
    assert batch[LAYOUT_KEY] == want[LAYOUT_KEY]
    index = batch["completion_index"]
    for i, c in enumerate(completions):  # each completion token found where the index says
        assert batch["input_ids"][0][index[i, : len(c)]].tolist() == c
        assert (index[i, len(c) :] == -1).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("pack", [False, True])
def test_completion_logps_of_either_layout_are_those_of_each_row_alone(temperature, pack):
    torch.manual_seed(0)
    model = build_model(seed=0).eval()
    rollout, prompts, completions = _rollout()
    batch = training_batch(rollout, [0, 1, 2, 3], pack=pack)
    with torch.no_grad():
        logps, entropy = batch_completion_logps(model, batch, temperature, with_entropy=True)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        with torch.no_grad():  # the row alone, unpadded: the naive reference
            logits = model(torch.tensor([p + c])).logits[0].double() / temperature
        lp = torch.log_softmax(logits, -1)
        want = [float(lp[len(p) - 1 + t, tok]) for t, tok in enumerate(c)]
        want_h = [
            float(-(lp[len(p) - 1 + t].exp() * lp[len(p) - 1 + t]).sum()) for t in range(len(c))
        ]
        assert logps[i, : len(c)].tolist() == pytest.approx(want, abs=1e-4)
        assert entropy is not None
        assert entropy[i, : len(c)].tolist() == pytest.approx(want_h, abs=1e-4)
        assert logps[i, len(c) :].abs().sum() == 0


def test_prompt_batches_say_they_are_for_evaluation_and_weigh_one_unit_per_prompt():
    prompts = GRPOCollator(PAD)([{"prompt_input_ids": [5, 6, 7]}, {"prompt_input_ids": [8]}])
    assert is_prompt_batch(prompts) and num_rows(prompts) == 2
    rollout, _, _ = _rollout()
    assert not is_prompt_batch(training_batch(rollout, [0, 1], pack=False))
    assert not is_prompt_batch(training_batch(rollout, [0, 1], pack=True))
    method = GRPOMethod(["char_match"], num_generations=2)
    assert method.loss_weight(prompts) == 2.0
    with pytest.raises(RuntimeError, match="rollout stage"):
        method(build_model(seed=0), prompts)
