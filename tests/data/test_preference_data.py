"""Preference and KTO data: tokenization layouts, truncation, errors, collators, validation.

The tiny tokenizer is character-level, so every expected layout is written out here token by
token (``ids("abc")`` = one id per character), independently of the code under test.
"""

from __future__ import annotations

import logging

import pytest
import torch

from grimoire.collate.kto import KTOCollator
from grimoire.collate.preference import PreferenceCollator
from grimoire.errors import DataError
from grimoire.forward.precomputed import cache_reference_log_probs
from grimoire.losses.dpo import DPOLoss
from grimoire.losses.kto import KTOLoss
from grimoire.rows.common import counting_cuts
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import PREFERENCE_COLUMNS, tokenize_preference
from grimoire.rows.sources import tokenize_dataset

IGN = -100


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer


def ids(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(text))


def special(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


# ------------------------------------------------------------------------------------------------
# tokenize_preference: layouts
# ------------------------------------------------------------------------------------------------


def test_string_layout_masks_prompt_and_trains_eos(tok):
    out = tokenize_preference(
        {"prompt": "reverse abc=", "chosen": "cba", "rejected": "cbb"}, tok, max_length=64
    )
    bos, eos = tok.bos_token_id, tok.eos_token_id
    prompt = [bos, *ids(tok, "reverse abc=")]
    for side, text in (("chosen", "cba"), ("rejected", "cbb")):
        response = [*ids(tok, text), eos]
        assert out[f"{side}_input_ids"] == prompt + response
        assert out[f"{side}_labels"] == [IGN] * len(prompt) + response
        assert out[f"{side}_attention_mask"] == [1] * (len(prompt) + len(response))
    assert set(out) == {
        f"{s}_{c}"
        for s in ("chosen", "rejected")
        for c in ("input_ids", "attention_mask", "labels")
    }


def chat_expected(tok, prompt_turns, answer):
    """``<bos><|role|>text<|end|>...<|assistant|>answer<|end|>`` and its labels: the template's
    rendering, no EOS after the ``<|end|>`` that closes the final turn."""
    end = special(tok, "<|end|>")
    prompt = [tok.bos_token_id]
    for role, text in prompt_turns:
        prompt += [special(tok, f"<|{role}|>"), *ids(tok, text), end]
    prompt.append(special(tok, "<|assistant|>"))
    response = [*ids(tok, answer), end]
    return prompt + response, [IGN] * len(prompt) + response


@pytest.mark.parametrize("form", ["messages", "strings_for_responses", "implicit_prompt"])
def test_conversational_layouts(tok, form):
    user = [{"role": "user", "content": "reverse ab="}]
    if form == "messages":
        row = {
            "prompt": user,
            "chosen": [{"role": "assistant", "content": "ba"}],
            "rejected": [{"role": "assistant", "content": "bb"}],
        }
    elif form == "strings_for_responses":
        row = {"prompt": user, "chosen": "ba", "rejected": "bb"}
    else:
        row = {
            "chosen": [*user, {"role": "assistant", "content": "ba"}],
            "rejected": [*user, {"role": "assistant", "content": "bb"}],
        }
    out = tokenize_preference(row, tok, max_length=64)
    for side, answer in (("chosen", "ba"), ("rejected", "bb")):
        exp_ids, exp_labels = chat_expected(tok, [("user", "reverse ab=")], answer)
        assert out[f"{side}_input_ids"] == exp_ids
        assert out[f"{side}_labels"] == exp_labels


def test_assistant_turns_inside_the_prompt_are_not_trained(tok):
    prompt = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ab"},
    ]
    out = tokenize_preference({"prompt": prompt, "chosen": "ba", "rejected": "aa"}, tok, 64)
    exp_ids, exp_labels = chat_expected(
        tok, [("user", "hi"), ("assistant", "yo"), ("user", "ab")], "ba"
    )
    assert out["chosen_input_ids"] == exp_ids
    assert out["chosen_labels"] == exp_labels


# ------------------------------------------------------------------------------------------------
# truncation
# ------------------------------------------------------------------------------------------------


def test_long_prompt_keeps_bos_prompt_end_and_whole_responses(tok):
    prompt = "reverse " + "abcdefghijkl" * 3 + "="
    with counting_cuts() as cut:
        out = tokenize_preference({"prompt": prompt, "chosen": "abc", "rejected": "abd"}, tok, 16)
    # Longest response: 3 chars + EOS = 4, so the prompt keeps 16 - 4 = 12 tokens: BOS + its
    # last 11 characters.
    kept_prompt = [tok.bos_token_id, *ids(tok, prompt[-11:])]
    assert out["chosen_input_ids"] == kept_prompt + ids(tok, "abc") + [tok.eos_token_id]
    assert out["chosen_labels"][:12] == [IGN] * 12
    assert len(out["rejected_input_ids"]) == 16
    # Counted for the log: BOS + 45 prompt characters cut to 12 on each side, no response cut.
    assert cut == {"rows": 1, "dropped": 0, "turns": 0, "tokens": 2 * 34, "open_turns": 0}


def test_long_responses_keep_their_start_and_lose_eos(tok):
    chosen, rejected = "abcdefghijkl" * 3, "bbcdefghijkl" * 2
    with counting_cuts() as cut:
        out = tokenize_preference({"prompt": "p=", "chosen": chosen, "rejected": rejected}, tok, 10)
    prompt = [tok.bos_token_id, *ids(tok, "p=")]  # short prompt: untouched
    assert out["chosen_input_ids"] == prompt + ids(tok, chosen[:7])
    assert out["rejected_input_ids"] == prompt + ids(tok, rejected[:7])
    assert out["chosen_labels"] == [IGN] * 3 + ids(tok, chosen[:7])  # no EOS: the text goes on
    assert tok.eos_token_id not in out["chosen_input_ids"]
    # Counted: chosen 36 + EOS and rejected 24 + EOS cut to 7 each; both lose their end.
    assert cut == {"rows": 1, "dropped": 0, "turns": 0, "tokens": 30 + 18, "open_turns": 2}


def test_max_prompt_length_is_the_prompt_floor(tok):
    prompt = "q" * 20 + "="
    row = {"prompt": prompt, "chosen": "a" * 20, "rejected": "b" * 20}
    out = tokenize_preference(row, tok, max_length=12, max_prompt_length=4)
    assert out["chosen_input_ids"][:4] == [tok.bos_token_id, *ids(tok, prompt[-3:])]
    assert out["chosen_input_ids"][4:] == ids(tok, "a" * 8)
    with pytest.raises(ValueError, match="max_prompt_length"):
        tokenize_preference(row, tok, max_length=12, max_prompt_length=12)


def test_truncation_that_makes_the_pair_identical_is_an_error(tok):
    row = {"prompt": "p=", "chosen": "abcdefgh", "rejected": "abcdefgx"}
    with pytest.raises(DataError, match="identical after truncation"):
        tokenize_preference(row, tok, max_length=6)


def test_a_user_turn_opening_both_responses_is_shared_untrained_prompt(tok):
    # The responses open with the same user turn: it is context, so it joins the shared prompt
    # (cut from the front like any prompt) and each response starts at its assistant turn.
    row = {
        "prompt": [{"role": "user", "content": "ab"}],
        "chosen": [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "a"}],
        "rejected": [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "b"}],
    }
    out = tokenize_preference(row, tok, max_length=20)
    for side, answer in (("chosen", "a"), ("rejected", "b")):
        ids, labels = out[f"{side}_input_ids"], out[f"{side}_labels"]
        assert len(ids) <= 20
        trained = tok.decode([t for t in labels if t != -100])
        assert trained == f"{answer}<|end|>"
    n = len(out["chosen_input_ids"]) - 2  # both share everything before the answer
    assert out["chosen_input_ids"][:n] == out["rejected_input_ids"][:n]


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "kwargs", "pattern"),
    [
        ({"prompt": "p", "chosen": "", "rejected": "b"}, {}, "field 'chosen' is empty"),
        (
            {"prompt": "p", "chosen": "a", "rejected": "  "},
            {},
            "field 'rejected' is only whitespace",
        ),
        ({"prompt": "p", "chosen": "a"}, {}, "missing field 'rejected'.*rejected_field="),
        ({"chosen": "a", "rejected": "b"}, {}, "missing field 'prompt'"),
        (
            {"prompt": "p", "good": "a", "bad": "b"},
            {"chosen_field": "good"},
            "missing field 'rejected'",
        ),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, {}, "identical"),
        ({"prompt": "p", "chosen": [{"text": "a"}], "rejected": "b"}, {}, "field 'chosen' must be"),
        (
            {"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"},
            {"margin_field": "margin"},
            "field 'margin' must be a number",
        ),
    ],
)
def test_bad_rows_raise_data_error_naming_the_field(tok, row, kwargs, pattern):
    with pytest.raises(DataError, match=pattern):
        tokenize_preference(row, tok, max_length=64, **kwargs)


def test_bad_rows_are_named_by_index_through_tokenize_dataset(tok):
    rows = [
        {"prompt": "a=", "chosen": "a", "rejected": "b"},
        {"prompt": "b=", "chosen": "", "rejected": "b"},
        {"prompt": "c=", "chosen": "c", "rejected": "c"},
    ]
    with pytest.raises(DataError) as info:
        tokenize_dataset(rows, tokenize_preference, source_name="train", tokenizer=tok)
    text = str(info.value)
    assert "train row 1: tokenize_preference: field 'chosen' is empty" in text
    assert "train row 2:" in text and "identical" in text
    assert "row 0" not in text


def test_margin_field_is_copied(tok):
    row = {"prompt": "p", "chosen": "a", "rejected": "b", "gap": 2}
    assert tokenize_preference(row, tok, 64, margin_field="gap")["gap"] == 2.0


# ------------------------------------------------------------------------------------------------
# PreferenceCollator
# ------------------------------------------------------------------------------------------------


def test_preference_collator_pads_both_sides_to_one_width(tok):
    rows = [
        tokenize_preference({"prompt": "p=", "chosen": "abcdef", "rejected": "a"}, tok, 64),
        tokenize_preference({"prompt": "pp=", "chosen": "a", "rejected": "bc"}, tok, 64),
    ]
    rows[0]["ref_chosen_logps"], rows[1]["ref_chosen_logps"] = -1.5, -2.25
    batch = PreferenceCollator(pad_token_id=0)(rows)
    width = 1 + 2 + 6 + 1
    for side in ("chosen", "rejected"):
        assert batch[f"{side}_input_ids"].shape == (2, width)
        for i, r in enumerate(rows):
            n = len(r[f"{side}_input_ids"])
            assert batch[f"{side}_input_ids"][i, :n].tolist() == r[f"{side}_input_ids"]
            assert batch[f"{side}_input_ids"][i, n:].eq(0).all()
            assert batch[f"{side}_attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
            assert batch[f"{side}_labels"][i, n:].eq(IGN).all()
    assert batch["ref_chosen_logps"].dtype == torch.float32
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -2.25]


# ------------------------------------------------------------------------------------------------
# KTO data
# ------------------------------------------------------------------------------------------------


def test_tokenize_kto_layout(tok):
    out = tokenize_kto({"prompt": "reverse ab=", "completion": "ba", "label": True}, tok, 64)
    prompt = [tok.bos_token_id, *ids(tok, "reverse ab=")]
    response = [*ids(tok, "ba"), tok.eos_token_id]
    assert out == {
        "input_ids": prompt + response,
        "attention_mask": [1] * (len(prompt) + len(response)),
        "labels": [IGN] * len(prompt) + response,
        "label": True,
    }
    assert tokenize_kto({"prompt": "p", "completion": "c", "label": 0}, tok, 64)["label"] is False


@pytest.mark.parametrize(
    ("row", "pattern"),
    [
        ({"prompt": "p", "completion": "c"}, "missing field 'label'"),
        ({"prompt": "p", "completion": "c", "label": "yes"}, "field 'label' must be a bool"),
        ({"prompt": "p", "completion": "c", "label": 2}, "field 'label' must be a bool"),
        ({"prompt": "p", "completion": "", "label": True}, "field 'completion' is empty"),
        ({"completion": "c", "label": True}, "missing field 'prompt'"),
    ],
)
def test_tokenize_kto_bad_rows(tok, row, pattern):
    with pytest.raises(DataError, match=pattern):
        tokenize_kto(row, tok, 64)


KTO_RAW = [
    {"prompt": "reverse abc=", "completion": "cba", "label": True},
    {"prompt": "reverse de=", "completion": "dd", "label": False},
    {"prompt": "reverse fghi=", "completion": "ihgf", "label": True},
]


def test_kto_collator_pairs_prompt_i_with_completion_i_plus_1(tok):
    feats = [tokenize_kto(r, tok, 64) for r in KTO_RAW]
    batch = KTOCollator(pad_token_id=0)(feats)
    assert batch["label"].tolist() == [True, False, True]
    assert batch["label"].dtype == torch.bool
    for i, row in enumerate(KTO_RAW):
        nxt = KTO_RAW[(i + 1) % len(KTO_RAW)]
        prompt = [tok.bos_token_id, *ids(tok, row["prompt"])]
        completion = [*ids(tok, nxt["completion"]), tok.eos_token_id]
        n = len(prompt) + len(completion)
        assert batch["kl_input_ids"][i, :n].tolist() == prompt + completion
        assert batch["kl_labels"][i, :n].tolist() == [IGN] * len(prompt) + completion
        assert batch["kl_attention_mask"][i].sum() == n
        assert batch["kl_labels"][i, n:].eq(IGN).all()
        # the row itself is untouched
        own = feats[i]["input_ids"]
        assert batch["input_ids"][i, : len(own)].tolist() == own


def test_kto_collator_bounds_pairs_and_keeps_cached_pairs(tok):
    feats = [tokenize_kto(r, tok, 64) for r in KTO_RAW]
    # Prompt 2 (14 tokens) + completion 0 (4 tokens) = 18 > 16: the completion's end is cut.
    batch = KTOCollator(pad_token_id=0, max_length=16)(feats)
    assert int(batch["kl_attention_mask"][2].sum()) == 16
    assert batch["kl_input_ids"][2, 14:16].tolist() == ids(tok, "cb")
    cached = [dict(f, kl_input_ids=[5, 6, 7], kl_labels=[IGN, 6, 7]) for f in feats]
    batch = KTOCollator(pad_token_id=0)(cached)
    assert batch["kl_input_ids"].tolist() == [[5, 6, 7]] * 3


def test_single_class_kto_dataset_is_flagged_with_counts(tok, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from grimoire import GrimoireTrainer, TrainingConfig

    feats = [tokenize_kto(dict(r, label=True), tok, 64) for r in KTO_RAW]
    problems = KTOLoss().validate_dataset(feats, "train")
    assert len(problems) == 1
    assert "3 desirable (True) and 0 undesirable (False)" in problems[0]
    balanced = [tokenize_kto(r, tok, 64) for r in KTO_RAW]
    assert KTOLoss().validate_dataset(balanced, "train") == []

    config = TrainingConfig(
        output_dir=str(tmp_path),
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        batch_size=2,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(DataError, match="0 undesirable"):
        GrimoireTrainer(model, tok, config, KTOLoss(ref_model=model), feats)


def test_kto_class_ratio_outside_the_paper_range_warns(tok, caplog):
    feats = [tokenize_kto(r, tok, 64) for r in KTO_RAW]  # 2 desirable, 1 undesirable
    with caplog.at_level(logging.WARNING, logger="grimoire.losses.kto"):
        assert KTOLoss().validate_dataset(feats, "train") == []
    assert "= 2" in caplog.text and "[1, 4/3]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grimoire.losses.kto"):
        KTOLoss(desirable_weight=0.6).validate_dataset(feats, "train")  # 1.2: inside the range
    assert caplog.text == ""


def test_pairwise_losses_report_missing_columns(tok):
    feats = [tokenize_kto(r, tok, 64) for r in KTO_RAW]
    (problem,) = DPOLoss().validate_dataset(feats, "eval")
    assert "eval dataset: missing column(s)" in problem and "chosen_input_ids" in problem


def test_cache_rejects_untokenized_rows(tiny_model):
    with pytest.raises(DataError, match="expected tokenized preference rows"):
        cache_reference_log_probs(tiny_model, [{"prompt": "a", "chosen": "b", "rejected": "c"}])


def test_cache_writes_kto_pairs_and_reduction(tok, tiny_model):
    feats = [tokenize_kto(r, tok, 64) for r in KTO_RAW]
    ds = cache_reference_log_probs(tiny_model, feats, batch_size=2, reduction="mean")
    assert list(ds["ref_logps_reduction"]) == ["mean"] * 3
    # Dataset-level pairs: row i's prompt with row (i + 1) mod N's completion.
    batch = KTOCollator(pad_token_id=0)(feats)
    for i in range(3):
        n = int(batch["kl_attention_mask"][i].sum())
        assert ds[i]["kl_input_ids"] == batch["kl_input_ids"][i, :n].tolist()
    assert all(x < 0 for x in [*ds["ref_logps"], *ds["ref_kl_logps"]])


def test_rows_keep_one_set_of_columns_whether_cut_or_not(tok):
    # datasets.map needs every row to return the same keys: the cut count is a side channel.
    from datasets import Dataset

    rows = [
        {"prompt": "p=", "chosen": "a" * 30, "rejected": "b"},
        {"prompt": "p=", "chosen": "a", "rejected": "b"},
    ]
    with counting_cuts() as cut:
        ds = Dataset.from_list(rows).map(
            lambda r: tokenize_preference(r, tok, 10),
            remove_columns=["prompt", "chosen", "rejected"],
        )
    assert sorted(ds.column_names) == sorted(PREFERENCE_COLUMNS)
    assert cut["rows"] == 1
