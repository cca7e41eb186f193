"""Reward functions: built-ins, resolution from specs, weighting, and errors that name the culprit."""

from __future__ import annotations

import pytest
import torch

from grimoire.errors import ConfigError
from grimoire.rollout.rewards.scoring import (
    RewardFunctionError,
    char_match_reward,
    evaluate_rewards,
    exact_match_reward,
    resolve_reward_funcs,
    score_completions,
)


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_builtin_rewards():
    comps = ["cba", " cba\n", "cb", "cbax", ""]
    answers = ["cba"] * 5
    assert exact_match_reward(None, comps, answers) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # matches at equal positions / max(len(c), len(a)), after strip
    assert char_match_reward(None, comps, answers) == pytest.approx([1, 1, 2 / 3, 3 / 4, 0])
    assert char_match_reward(None, ["xbc"], ["abc"]) == pytest.approx([2 / 3])


def test_resolve_names_specs_callables_and_weights():
    funcs = resolve_reward_funcs(
        [
            "exact_match",
            "grimoire.rollout.rewards.scoring:char_match_reward",
            length_reward,
            length_reward,
        ],
        [2.0, 1.0, 0.5, 0.25],
    )
    assert [f.name for f in funcs] == [
        "exact_match_reward",
        "char_match_reward",
        "length_reward",
        "length_reward_2",
    ]
    assert funcs[0].required_columns() == ["answer"]
    assert funcs[2].required_columns() == []
    total, per = score_completions(
        funcs, ["p", "p"], ["cba", "ab"], {"answer": ["cba", "ba"], "extra": [1, 2]}
    )
    expected = [2 * 1 + 1 * 1 + 0.75 * 3, 2 * 0 + 0 + 0.75 * 2]
    assert total.tolist() == pytest.approx(expected)
    assert per["exact_match_reward"].tolist() == [1.0, 0.0]
    assert resolve_reward_funcs(length_reward)[0].weight == 1.0


def test_resolution_errors_are_collected_before_training():
    with pytest.raises(ConfigError) as err:
        resolve_reward_funcs(
            ["no_such_module_xyz:fn", "exact_mach", "grimoire.rollout.rewards.scoring:nope", 3],
            [1.0, 1.0, 1.0, float("nan")],
        )
    text = str(err.value)
    assert "no_such_module_xyz:fn" in text and "ModuleNotFoundError" in text
    assert 'did you mean "exact_match"' in text
    assert "nope" in text
    assert "reward_weights[3]" in text and "not callable" in text
    with pytest.raises(ConfigError, match="reward_weights has 1 entries"):
        resolve_reward_funcs([length_reward, length_reward], [1.0])
    with pytest.raises(ConfigError, match="at least one"):
        resolve_reward_funcs([])


def test_bad_reward_functions_are_named():
    def boom(prompts, completions, **kw):
        raise KeyError("answer")

    def short(prompts, completions, **kw):
        return [1.0]

    def nan(prompts, completions, **kw):
        return [float("nan")] * len(completions)

    def scalar(prompts, completions, **kw):
        return 1.0

    cases = [
        (boom, "'boom' raised KeyError"),
        (short, "'short' returned 1 rewards for 2 completions"),
        (nan, "'nan' returned nan at index 0"),
        (scalar, "'scalar' returned float"),
    ]
    for fn, message in cases:
        with pytest.raises(RewardFunctionError, match=message):
            score_completions(resolve_reward_funcs(fn), ["a", "b"], ["x", "y"], {})
    # tensors and bools are accepted
    ok = score_completions(
        resolve_reward_funcs(lambda prompts, completions, **k: torch.tensor([1.0, 0.0])),
        ["a", "b"],
        ["x", "y"],
        {},
    )
    assert ok[0].tolist() == [1.0, 0.0]


def test_evaluate_rewards_greedy_and_sampled(tiny_model, tokenizer):
    rows = [{"prompt": "reverse abc=", "answer": "cba"}, {"prompt": "reverse ab=", "answer": "ba"}]
    state = torch.get_rng_state()
    greedy = evaluate_rewards(
        tiny_model, tokenizer, rows, ["exact_match", "char_match"], max_new_tokens=6
    )
    assert set(greedy) == {"reward", "exact_match_reward", "char_match_reward"}
    kw = dict(greedy=False, num_samples=2, max_new_tokens=6, seed=3)
    a = evaluate_rewards(tiny_model, tokenizer, rows, [length_reward], **kw)
    b = evaluate_rewards(tiny_model, tokenizer, rows, [length_reward], **kw)
    assert a == b  # seeded: same stream
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
