"""``reward_model``: a saved sequence-classification checkpoint scores prompt + completion in
padded batches exactly as the model scores each text alone."""

from __future__ import annotations

import pytest
import torch

from grimoire.errors import ConfigError
from grimoire.model.tiny import build_tokenizer, tiny_config
from grimoire.rollout.rewards.calls import resolve_reward_funcs
from grimoire.rollout.rewards.reward_model import (
    RewardModelReward,
    pooling_mismatches,
    right_padded,
)
from grimoire.rollout.rewards.scoring import score_completions


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A random tiny Llama with a one-score head and the char tokenizer, saved as reward
    modelling saves one (pad id 0, distinct from EOS 2)."""
    from transformers import AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-rm")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=64, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def naive_scores(path, prompts, completions):
    """One text at a time, no padding: BOS + prompt + completion + EOS through the model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    out = []
    for p, c in zip(prompts, completions):
        ids = [tok.bos_token_id, *tok.encode(p + c, add_special_tokens=False), tok.eos_token_id]
        with torch.no_grad():
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


def test_batched_scores_equal_the_model_one_text_at_a_time(rm_dir):
    prompts = ["reverse ab=", "reverse abcdef=", "copy a=", "first abcd="]
    completions = ["ba", "fedcba", "a", "a b c d e f g"]  # lengths differ: rows are padded
    reward = RewardModelReward(str(rm_dir), batch_size=3)
    got = reward(prompts=prompts, completions=completions)
    want = naive_scores(rm_dir, prompts, completions)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 4) for x in want)) == 4  # distinct scores: the order is checked too
    # a prompt already starting with BOS (a rendered chat template) is not given a second one
    bos_prompts = ["<bos>" + p for p in prompts]
    assert reward(prompts=bos_prompts, completions=completions) == pytest.approx(want, abs=1e-5)
    model = reward.load()[0]
    assert reward.load()[0] is model  # loaded once


def test_encode_by_hand(rm_dir):
    reward = RewardModelReward(str(rm_dir), max_length=4)
    tok = reward.load()[1]
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    # BOS a = b EOS; with max_length=4 its last 4 tokens (the score is read at the end)
    eq = tok.convert_tokens_to_ids("=")
    assert RewardModelReward(str(rm_dir)).encode(tok, "a=", "b") == [1, a, eq, b, 2]
    assert reward.encode(tok, "a=", "b") == [a, eq, b, 2]


def test_padding_helpers_by_hand():
    ids, mask = right_padded([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert pooling_mismatches(ids, mask, pad=0) == []
    # a row ending in the pad id (pad == eos): transformers would read the score one token early
    ids, mask = right_padded([[5, 2], [8]], pad=2)
    assert pooling_mismatches(ids, mask, pad=2) == [0]


def test_from_a_config_entry_and_bad_options(rm_dir):
    (rf,) = resolve_reward_funcs([{"type": "reward_model", "args": {"path": str(rm_dir)}}])
    assert rf.name == "reward_model" and rf.required_columns() == []
    total, _ = score_completions([rf], ["copy a="], ["a"], {"answer": ["a"]})
    assert total.tolist() == pytest.approx(naive_scores(rm_dir, ["copy a="], ["a"]), abs=1e-5)
    with pytest.raises(ConfigError) as err:
        resolve_reward_funcs(
            [
                {"type": "reward_model", "args": {"path": "/nowhere/rm"}},
                {"type": "reward_model", "args": {"path": str(rm_dir), "batch_size": 0}},
                {"type": "reward_model", "args": {"path": str(rm_dir), "dtype": "fp8"}},
            ]
        )
    text = str(err.value)
    assert "reward_funcs[0]: reward_model: path: '/nowhere/rm' is not a model folder" in text
    assert "reward_funcs[1]: reward_model: batch_size must be an int >= 1, got 0" in text
    assert "reward_funcs[2]: reward_model: dtype must be one of" in text


def test_pad_equal_to_eos_is_refused(rm_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    model.config.pad_token_id = 2  # the EOS every text ends with
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ends with the pad token id 2"):
        RewardModelReward(str(tmp_path))(prompts=["a=", "ab="], completions=["a", "ba"])
