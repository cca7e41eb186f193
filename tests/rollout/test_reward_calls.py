"""Reward functions are called with keywords only, as TRL's GRPOTrainer calls them, and a
signature the call would not fit is rejected before training (``grimoire validate`` included)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from tests.helpers.train_utils import quiet_config

from grimoire import GrimoireTrainer
from grimoire.cli.main import main
from grimoire.errors import ConfigError
from grimoire.losses.grpo import GRPOMethod
from grimoire.rollout.rewards.answers import AnswerMatch
from grimoire.rollout.rewards.calls import (
    resolve_reward_funcs,
    reward_signature_problems,
)
from grimoire.rollout.rewards.scoring import score_completions
from grimoire.rows.prompts import tokenize_grpo

CALLS: list[dict] = []


def last_int(completions, answer, **kwargs):
    """TRL's style: no ``prompts`` parameter; it arrives in ``kwargs`` with the rest."""
    CALLS.append({"completions": completions, "answer": answer, **kwargs})
    out = []
    for text, a in zip(completions, answer):
        found = re.findall(r"\d+", text)
        out.append(float(bool(found) and found[-1] == str(a)))
    return out


def test_trl_style_reward_trains_a_step_through_the_rollout(tiny_dir, tokenizer, tmp_path):
    """``last_int(completions, answer, **kwargs)`` used to get ``prompts`` as ``completions`` and
    fail with 'got multiple values for argument answer'; now it scores a real GRPO step."""
    from transformers import AutoModelForCausalLM

    CALLS.clear()
    raw = [{"prompt": f"add {i}+1=", "answer": i + 1, "source": "toy"} for i in range(4)]
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in raw]
    method = GRPOMethod([last_int], num_generations=2, max_new_tokens=5)
    assert method.validate_dataset(rows) == []
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer=tokenizer,
        config=quiet_config(tmp_path, max_steps=1, batch_size=2),
        loss_fn=method,
        train_dataset=rows,
    )
    trainer.train()
    assert trainer.global_step == 1
    call = CALLS[0]
    # Two prompts x G=2 completions, every list one entry per completion, prompt-major.
    assert sorted(call) == ["answer", "completion_ids", "completions", "prompts", "source"]
    assert len(call["completions"]) == len(call["completion_ids"]) == 4
    assert call["prompts"][0] == call["prompts"][1] and call["prompts"][0].startswith("add ")
    assert call["answer"][0] == call["answer"][1] and call["source"] == ["toy"] * 4
    # completion_ids are the sampled tokens: at most max_new_tokens, decoding to the text.
    for ids, text in zip(call["completion_ids"], call["completions"]):
        assert 1 <= len(ids) <= 5 and all(isinstance(t, int) for t in ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_call_is_by_keyword_and_a_function_without_kwargs_gets_what_it_names():
    seen = {}

    def named_only(completions, answer):  # no **kwargs: never handed a keyword it cannot take
        seen["named_only"] = (completions, answer)
        return [1.0] * len(completions)

    def kw_only(*, prompts, completion_ids, **kwargs):
        seen["kw_only"] = (prompts, completion_ids, sorted(kwargs))
        return [float(len(ids)) for ids in completion_ids]

    funcs = resolve_reward_funcs([named_only, kw_only, last_int])
    cols = {"answer": ["7", "8"], "id": [1, 2]}
    total, per = score_completions(
        funcs, ["p1", "p2"], ["is 7", "is 9"], cols, completion_ids=[[4, 5, 6], [7]]
    )
    assert seen["named_only"] == (["is 7", "is 9"], ["7", "8"])
    assert seen["kw_only"] == (["p1", "p2"], [[4, 5, 6], [7]], ["answer", "completions", "id"])
    assert per["kw_only"].tolist() == [3.0, 1.0]
    assert per["last_int"].tolist() == [1.0, 0.0]
    assert total.tolist() == [1 + 3 + 1, 1 + 1 + 0]


def test_signature_problems_name_the_function_the_parameter_and_the_columns():
    def positional(p, c, **kwargs):  # TRL passes keywords: p and c are never supplied
        return [0.0] * len(c)

    def ranked(prompts, completions, rank):
        return [0.0] * len(completions)

    def only_positional(prompts, completions, /, **kwargs):
        return [0.0] * len(completions)

    funcs = resolve_reward_funcs([positional, ranked, last_int, only_positional])
    columns = ["prompt_input_ids", "prompt_attention_mask", "prompt", "answer"]
    problems = reward_signature_problems(funcs, columns, "train dataset")
    assert problems[0] == (
        "train dataset: reward function 'positional' needs 'p', which the call does not "
        "supply: it passes prompts, completions, completion_ids and the train dataset's "
        "columns ['answer'] as keywords (name the parameters so, or give the column)"
    )
    assert "'positional' needs 'c'" in problems[1]
    assert "'ranked' needs 'rank'" in problems[2]
    assert "'only_positional': parameter 'prompts' is positional-only" in problems[3]
    assert len(problems) == 5  # ... and 'completions'; last_int fits
    assert reward_signature_problems(funcs[2:3], columns) == []


def _write_run(tmp_path, reward_funcs, rows):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(data)},
        "loss": {
            "type": "grpo",
            "args": {"reward_funcs": reward_funcs, "num_generations": 2, "max_new_tokens": 4},
        },
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "batch_size": 2},
    }
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def test_validate_rejects_a_reward_the_call_would_not_fit(tmp_path, capsys):
    rows = [{"prompt": "add 1+1=", "solution": "2"}, {"prompt": "add 2+1=", "solution": "3"}]
    # last_int needs 'answer'; the data calls it 'solution'
    cfg = _write_run(tmp_path, ["tests.rollout.test_reward_calls:last_int"], rows)
    assert main(["validate", "--config", str(cfg)]) != 0
    err = capsys.readouterr().err
    assert "reward function 'last_int' needs 'answer'" in err
    assert "columns ['solution']" in err
    # the built-in's option names the column: valid as it is
    entry = {"type": "answer_match", "args": {"answer_field": "solution"}}
    cfg = _write_run(tmp_path, [entry, "tests.rollout.test_reward_calls:last_int"], rows)
    assert main(["validate", "--config", str(cfg)]) != 0
    assert "'answer_match'" not in capsys.readouterr().err
    cfg = _write_run(tmp_path, [entry], rows)
    assert main(["validate", "--config", str(cfg)]) == 0


def test_entries_with_options_are_checked_and_named():
    funcs = resolve_reward_funcs(
        [{"type": "answer_match", "args": {"extract": "boxed"}}, "think_format", AnswerMatch()]
    )
    assert [f.name for f in funcs] == ["answer_match", "think_format", "answer_match_2"]
    assert funcs[0].fn.extract == "boxed"  # type: ignore[attr-defined]
    assert funcs[0].required_columns() == ["answer"]

    def scaled(completions, scale=1.0, **kwargs):
        return [scale * len(c) for c in completions]

    (bound,) = resolve_reward_funcs([{"type": scaled, "args": {"scale": 0.5}}])
    assert bound.name == "scaled"
    assert score_completions([bound], ["p"], ["abcd"], {})[0].tolist() == [2.0]
    # a column named like a bound option does not override it
    assert score_completions([bound], ["p"], ["abcd"], {"scale": [9.0]})[0].tolist() == [2.0]
    with pytest.raises(ConfigError) as err:
        resolve_reward_funcs(
            [
                {"type": "answer_match", "args": {"extrct": "boxed"}},
                {"type": "answer_match", "args": {"extract": "last"}},
                {"type": "overlong_penalty", "args": {"max_completion_length": 8}},
                {"name": "think_format"},
            ]
        )
    text = str(err.value)
    assert "reward_funcs[0]: answer_match: " in text and "'extrct'" in text
    assert "reward_funcs[1]: answer_match: extract must be one of" in text
    assert "reward_funcs[2]: overlong_penalty: " in text and "cache_length" in text
    assert "reward_funcs[3]: expected {type: <name or spec>, args: {...}}" in text
