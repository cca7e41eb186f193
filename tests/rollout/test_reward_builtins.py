"""The built-in rewards for real recipes against hand-worked cases: answer extraction with numeric
equivalence, the think format, DAPO's soft overlong penalty."""

from __future__ import annotations

import pytest

from grimoire.rollout.rewards.answers import (
    AnswerMatch,
    answers_match,
    boxed,
    extract_answer,
    gsm8k_answer,
    last_number,
    parse_number,
)
from grimoire.rollout.rewards.calls import resolve_reward_funcs
from grimoire.rollout.rewards.scoring import score_completions
from grimoire.rollout.rewards.shaping import OverlongPenalty, ThinkFormat

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


def test_extraction_by_hand():
    assert last_number("So 3 apples, then 1,000 pears: -3.00.") == "-3.00"
    assert last_number("pages 5-3") == "3"  # a hyphen after a digit is not a sign
    assert last_number("half is 1/2") == "1/2"
    assert last_number("no digits") is None
    assert boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert boxed(r"\boxed{2^{10}}") == "2^{10}"
    assert boxed(r"\boxed{unclosed") is None
    assert gsm8k_answer(GSM8K_SOLUTION) == "72"
    assert extract_answer(r"7 or \boxed{8}, 9", "auto") == "8"  # boxed first
    assert extract_answer("7 then\n#### 8\nfinally 9", "auto") == "8"  # then ####
    assert extract_answer("7 then 9", "auto") == "9"  # then the last number
    assert extract_answer(r"7 or \boxed{8}, 9", "last_number") == "9"


@pytest.mark.parametrize(
    ("predicted", "reference", "same"),
    [
        ("1,000", "1000", True),
        ("1000.0", "1000", True),
        ("-3", "-3.00", True),
        ("1/2", "0.5", True),
        (r"\frac{1}{2}", "0.5", True),
        ("$1,000", "1000", True),
        ("0.30", "3/10", True),
        ("1,000", "100", False),
        ("0.333", "1/3", False),  # exact rationals: no tolerance
        ("x + 1", "x+1", True),  # not numbers: the texts without whitespace
        ("x+2", "x+1", False),
    ],
)
def test_numeric_equivalence_by_hand(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_parse_number_rejects_non_numbers():
    assert parse_number("12,34") is None  # not a thousands grouping
    assert parse_number("1/0") is None
    assert parse_number("two") is None


def test_answer_match_scores_by_hand():
    gsm8k = AnswerMatch()  # auto extraction, column "answer"
    completions = [
        "48/2 = 24 in May, 24 + 48 = 72 in all.\n#### 72",  # 72 == GSM8K's 72
        "So she sold 72.0 clips.",  # last number 72.0 == 72
        r"The total is \boxed{72}, not 48.",  # boxed beats the later 48
        "She sold 48 + 24 = 71.",  # wrong
        "I do not know.",  # nothing to extract
    ]
    assert gsm8k(completions=completions, answer=[GSM8K_SOLUTION] * 5) == [1, 1, 1, 0, 0]
    math = AnswerMatch(extract="boxed", answer_field="solution")
    out = math(
        completions=[r"\boxed{\frac{1}{2}}", r"0.5 but \boxed{0.25}", "0.5"],
        solution=[r"So the answer is $\boxed{0.5}$.", "1/2", "1/2"],
    )
    assert out == [1.0, 0.0, 0.0]  # boxed only: the bare 0.5 earns nothing


def test_think_format_by_hand():
    strict = ThinkFormat()
    texts = [
        "<think>2 + 2 is 4</think>\nThe answer is 4.",  # 1: the format
        "The answer is 4.",  # no block
        "<think>2 + 2</think>",  # no answer after the block
        "<think>2 + 2",  # block never closed
        "<think></think> 4",  # blank reasoning
        "Sure. <think>2 + 2</think> 4",  # text before the block
        "<think>a</think> 4 <think>b</think> 4",  # tags twice
    ]
    assert strict(completions=texts) == [1.0, 0, 0, 0, 0, 0, 0]
    partial = ThinkFormat(partial=True)
    # 0.5 * (tags exactly once) / 2 + 0.5 * [format]
    assert partial(completions=texts) == [1.0, 0.0, 0.5, 0.25, 0.5, 0.5, 0.0]
    opened = ThinkFormat(think_start="")  # the generation prompt already wrote <think>
    assert opened(completions=["2 + 2 is 4</think> 4", "2 + 2 is 4, so 4"]) == [1.0, 0.0]
    tagged = ThinkFormat(answer_start="<answer>", answer_end="</answer>", partial=True)
    assert tagged(
        completions=[
            "<think>r</think>\n<answer> 4 </answer>",  # 1.0
            "<think>r</think> 4",  # 2 of 4 tags: 0.5 * 2 / 4
            "<think>r</think><answer>4</answer> ok",  # text after the answer: 0.5 * 4 / 4
        ]
    ) == [1.0, 0.25, 0.5]
    with pytest.raises(ValueError, match="both tags or neither"):
        ThinkFormat(answer_start="<answer>")


def test_overlong_penalty_by_hand():
    # max 20, cache 5: free up to 15 tokens, then -1/5 per token, -1 from 20 on
    penalty = OverlongPenalty(max_completion_length=20, cache_length=5)
    lengths = [1, 15, 16, 18, 20, 25]
    got = penalty(completion_ids=[[7] * n for n in lengths])
    assert got == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_length \\(9\\) must be <= max_completion_length"):
        OverlongPenalty(max_completion_length=8, cache_length=9)
    with pytest.raises(ValueError, match="max_completion_length must be an int >= 1"):
        OverlongPenalty(max_completion_length=0, cache_length=1)


def test_builtins_from_config_entries_combine_with_weights():
    funcs = resolve_reward_funcs(
        [
            "answer_match",
            {"type": "think_format", "args": {"partial": True}},
            {"type": "overlong_penalty", "args": {"max_completion_length": 4, "cache_length": 2}},
        ],
        [1.0, 0.5, 1.0],
    )
    total, per = score_completions(
        funcs,
        ["q", "q"],
        ["<think>so</think> 12", "13"],
        {"answer": ["12", "12"]},
        completion_ids=[[1, 2, 3], [1, 2]],  # 3 tokens: -0.5; 2 tokens: 0
    )
    assert per["answer_match"].tolist() == [1.0, 0.0]
    assert per["think_format"].tolist() == [1.0, 0.0]
    assert per["overlong_penalty"].tolist() == [-0.5, 0.0]
    assert total.tolist() == [1.0 + 0.5 - 0.5, 0.0]
