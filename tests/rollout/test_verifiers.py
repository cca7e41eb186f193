"""verifiers environments (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv``) as the
episode source and reward: grimoire's sampler writes the turns, the environment's own methods
answer them and end the episode, and its rubric scores the finished episodes as verifiers
scores a group (``loss.args.verifiers``, in Python or YAML)."""

from __future__ import annotations

import sys

import pytest
import torch
import verifiers as vf
from datasets import Dataset
from tests.helpers.episodes import (
    add_call,
    assert_only_model_tokens_get_gradient,
    first_call_letters,
    grpo_advantages,
    one_episode_batch,
    scripted_call_trainer,
)

from grimoire.cli.main import main
from grimoire.collate.prompts import GRPOCollator
from grimoire.errors import ConfigError
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_tokenizer
from grimoire.rollout.agents.agent import build_agent
from grimoire.rollout.agents.episode_batches import play_groups, score_episodes
from grimoire.rollout.agents.tool_parsers import parse_tiny
from grimoire.rollout.agents.verifiers_env import verifiers_rows
from grimoire.rollout.stage import environment_rows
from grimoire.rows.prompts import tokenize_grpo

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|end|>")


def scripted(turns: dict[str, list[str]], cut: tuple[str, ...] = ()):
    """A ``generate_batch`` whose turn for an episode is the next of ``turns[q]``, ``q`` the
    question its prompt holds (a per-prompt counter, so a group's copies take the turns in
    order); each ends with the end token unless the text is in ``cut`` (a turn the limits cut)."""
    taken: dict[str, int] = {}

    def generate_batch(prompts, max_new_tokens):
        out = []
        for ids in prompts:
            text = TOK.decode(ids)
            q = next(q for q in turns if q in text)
            turn = turns[q][taken.get(q, 0)]
            taken[q] = taken.get(q, 0) + 1
            ids = TOK(turn, add_special_tokens=False)["input_ids"]
            out.append((ids if turn in cut else [*ids, END], None))
        return out

    return generate_batch


def agent_of(env, **limits):
    settings = dict(max_turns=3, max_episode_tokens=256, max_new_tokens=16, failure_reward=0.0)
    settings.update(limits)
    return build_agent(None, None, "tiny", verifiers=env, env_timeout=10.0, **settings)


def play(agent, rows, generate_batch, group_size):
    episodes = play_groups(
        rows, agent.env_factory, generate_batch, TOK, parse_tiny, group_size, agent.limits, [END]
    )
    repeated = [r for r in rows for _ in range(group_size)]
    total, per_func = score_episodes(agent.rewards, episodes, repeated, TOK)
    return episodes, total, per_func


# --------------------------------------------------------------------------- single turn


def correct(completion, answer) -> float:
    return float(completion[-1].content == answer)


def brevity(completion) -> float:
    return 1.0 / (1 + len(completion[-1].content))


def group_size(completions) -> list[float]:
    """A group reward function (verifiers: plural arguments): the size of the scored group."""
    return [float(len(completions))] * len(completions)


def bonus(info) -> float:
    return float(info["bonus"])


def single_turn_env() -> vf.SingleTurnEnv:
    data = Dataset.from_list(
        [
            {"question": "reverse ab=", "answer": "ba", "info": {"bonus": 0.5}},
            {"question": "reverse xyz=", "answer": "zyx", "info": {"bonus": 0.0}},
        ]
    )
    funcs = [correct, brevity, group_size, bonus]
    rubric = vf.Rubric(funcs=funcs, weights=[1.0, 0.5, 0.25, 1.0])
    return vf.SingleTurnEnv(dataset=data, system_prompt="answer briefly", rubric=rubric)


def test_verifiers_single_turn_rubric_scores_each_group_with_its_weights():
    env = single_turn_env()
    rows = verifiers_rows(env)
    # verifiers' own formatting of the dataset: the system prompt, then the question.
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "reverse ab="},
    ]
    assert (rows[1]["answer"], rows[1]["example_id"], rows[1]["info"]) == ("zyx", 1, {"bonus": 0.0})
    # The trainer's path: tokenized, collated, and back to rows for the episodes' reset.
    batch = GRPOCollator(pad_token_id=TOK.pad_token_id)(
        [tokenize_grpo(r, TOK, max_length=64) for r in rows]
    )
    rows = environment_rows(batch)
    agent = agent_of(env)
    turns = {"reverse ab=": ["ba", "b"], "reverse xyz=": ["zyx", "zy"]}
    episodes, total, per_func = play(agent, rows, scripted(turns), group_size=2)

    assert [e.stop_reason for e in episodes] == ["done"] * 4  # SingleTurnEnv: one turn
    assert [e.messages[0]["content"] for e in episodes] == ["answer briefly"] * 4
    states = [e.columns["verifiers_episode"].state for e in episodes]
    assert {s["stop_condition"] for s in states} == {"max_turns_reached"}
    assert [s["completion"][-1].content for s in states] == ["ba", "b", "zyx", "zy"]
    # By hand: 1 x correct + 0.5 / (1 + len) + 0.25 x 2 (the groups are a prompt's 2 episodes)
    # + the row's info bonus.
    expected = [1 + 0.5 / 3 + 0.5 + 0.5, 0.5 / 2 + 0.5 + 0.5, 1 + 0.5 / 4 + 0.5, 0.5 / 3 + 0.5]
    torch.testing.assert_close(total, torch.tensor(expected))
    torch.testing.assert_close(per_func["verifiers"], torch.tensor(expected))
    torch.testing.assert_close(per_func["verifiers/correct"], torch.tensor([1.0, 0, 1, 0]))
    torch.testing.assert_close(per_func["verifiers/group_size"], torch.tensor([2.0] * 4))
    torch.testing.assert_close(per_func["verifiers/num_turns"], torch.tensor([1.0] * 4))


# --------------------------------------------------------------------------- multi turn


class Guess(vf.MultiTurnEnv):
    """Says "no" to a wrong guess and ends with a final "correct" on the answer; counts the
    environment's answers in the state."""

    async def setup_state(self, state):
        state["answers"] = 0
        return state

    async def env_response(self, messages, state, **kwargs):
        state["answers"] += 1
        if messages[-1].content == "err":  # verifiers' own error: recorded, has_error stops
            raise vf.ToolCallError("err")
        if messages[-1].content == "die":  # any other exception: the environment failed
            raise RuntimeError("die")
        if messages[-1].content == state["answer"]:
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return []
        return [vf.UserMessage(content="no")]


def solved_quickly(state) -> float:
    solved = state.get("stop_condition") == "has_final_env_response"
    return 1.0 / state["answers"] if solved else 0.0


def test_verifiers_multi_turn_env_response_state_and_grimoire_limits():
    data = Dataset.from_list([{"question": f"guess {q}", "answer": "ok"} for q in "abcde"])
    env = Guess(dataset=data, rubric=vf.Rubric(funcs=[solved_quickly]), max_turns=10)
    turns = {"guess a": ["x", "ok"], "guess b": ["x", "y", "z"], "guess c": ["abcdefgh"]}
    turns |= {"guess d": ["err"], "guess e": ["die"]}
    agent = agent_of(env, max_new_tokens=4, failure_reward=-1.0)
    episodes, total, _ = play(agent, verifiers_rows(env), scripted(turns, cut=("abcdefgh",)), 1)
    a, b, c, d, e = episodes
    states = [e.columns["verifiers_episode"].state for e in episodes]

    # a: "no" after the first guess, the final "correct" after the second ends it.
    assert [m["content"] for m in a.messages] == ["guess a", "x", "no", "ok", "correct"]
    assert (a.stop_reason, states[0]["stop_condition"], states[0]["answers"]) == (
        "done",
        "has_final_env_response",
        2,
    )
    # b: grimoire's max_turns=3 stops it after the third turn, before a third env_response (as
    # verifiers' max_turns_reached does); the rubric still scores it.
    assert (b.stop_reason, states[1]["stop_condition"], states[1]["answers"]) == (
        "done",
        "grimoire_max_turns",
        2,
    )
    # c: the first turn is cut by max_new_tokens: no step saw it, it is scored as truncated.
    assert c.stop_reason == "truncated"
    assert states[2]["stop_condition"] == "grimoire_truncated" and states[2]["is_truncated"]
    assert states[2]["trajectory"][-1]["is_truncated"]
    assert [m.content for m in states[2]["completion"]] == ["abcd"]
    # d: a vf.Error ends the episode through verifiers' has_error; it is still scored.
    assert (d.stop_reason, d.failure, states[3]["stop_condition"]) == ("done", None, "has_error")
    # e: any other exception is an environment failure: failure_reward, not the rubric's.
    assert e.stop_reason == "environment_error" and "RuntimeError: die" in e.failure
    torch.testing.assert_close(total, torch.tensor([0.5, 0.0, 0.0, 0.0, -1.0]))


# --------------------------------------------------------------------------- tools


def add(letters: str) -> str:
    """Count the letters.

    Args:
        letters: the letters to count
    """
    return str(len(letters))


def letters_added(completion) -> float:
    """The tool's answers, summed: varies with the scripted calls."""
    return float(sum(int(m.content) for m in completion if m.role == "tool"))


def load_environment(num_rows: int = 8) -> vf.Environment:
    """A verifiers entry point (``tests.rollout.test_verifiers:load_environment``)."""
    from grimoire.model.tiny import reverse_rows

    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in reverse_rows(num_rows, 3)]
    rubric = vf.Rubric(funcs=[letters_added])
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=rubric, max_turns=2)


def test_verifiers_tool_env_grpo_step_trains_only_model_tokens(tiny_dir, tmp_path):
    # The trainer's rows are grimoire's reverse rows (text prompts): the environment formats
    # them as its own dataset's. The first turn of episode i adds 1 + i % 3 letters.
    trainer, rows, tok = scripted_call_trainer(
        tiny_dir, tmp_path, [], add_call, verifiers=load_environment()
    )
    try:
        batch, metrics = one_episode_batch(trainer, rows)
        # ToolEnv's answer is read (attended) but never trained (mask 0).
        r = first_call_letters(batch, tok)
        assert metrics["episode/turns_mean"] == 2.0
        assert metrics["rewards/verifiers/add_calls/mean"] == 1.0  # ToolEnv's own metric

        # The rubric's reward (the tool's answers); GRPO's group advantages by hand.
        assert metrics["rewards/verifiers/mean"] == pytest.approx(float(r.mean()))
        torch.testing.assert_close(batch["advantages"].float().cpu(), grpo_advantages(r))

        assert_only_model_tokens_get_gradient(trainer, trainer.context.unwrapped_model, batch)
    finally:
        trainer.close()


# --------------------------------------------------------------------------- configuration


def _yaml(tmp_path, args: str, extra: str = "") -> str:
    path = tmp_path / "vf.yaml"
    path.write_text(
        f"""
model: {{pretrained: "tiny:llama"}}
loss:
  type: grpo
  args:
    reward_funcs: []
    num_generations: 2
    max_new_tokens: 8
    tool_call_parser: tiny
{args}
training: {{output_dir: {tmp_path / "out"}, max_steps: 1, batch_size: 2}}
{extra}
"""
    )
    return str(path)


def test_verifiers_yaml_validates_and_reports_every_problem_at_once(tmp_path, capsys):
    good = _yaml(
        tmp_path,
        "    verifiers: {env: 'tests.rollout.test_verifiers:load_environment', args: {num_rows: 4}}",
        "eval_dataset: {verifiers: eval, max_samples: 2}",
    )
    assert main(["validate", "--config", good]) == 0
    assert "is valid" in capsys.readouterr().out

    bad = _yaml(
        tmp_path,
        "    verifiers: 'tests.rollout.test_verifiers:load_environment'\n"
        "    environment: 'tests.helpers.episodes:Narrator'",
        "eval_dataset: {verifiers: test, size: 2}",
    )
    assert main(["validate", "--config", bad]) != 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "eval_dataset.verifiers: one of ['train', 'eval'], got 'test'" in out
    assert "eval_dataset.size: unknown key beside verifiers:" in out

    both = _yaml(
        tmp_path,
        "    verifiers: 'tests.rollout.test_verifiers:load_environment'\n"
        "    environment: 'tests.helpers.episodes:Narrator'",
    )
    assert main(["validate", "--config", both]) != 0
    captured = capsys.readouterr()
    assert "loss.args.verifiers: give verifiers or environment, not both" in (
        captured.out + captured.err
    )


def test_verifiers_bad_environments_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError) as info:
        agent_of("tests.rollout.test_verifiers:no_such_loader")
    assert "loss.args.verifiers: cannot import" in str(info.value)
    with pytest.raises(ConfigError) as info:
        agent_of({"env": "tests.rollout.test_verifiers:load_environment", "args": {"rows": 2}})
    assert "loss.args.verifiers.env: loading" in str(info.value) and "rows" in str(info.value)
    with pytest.raises(ConfigError) as info:
        agent_of(not_an_environment)
    assert "loss.args.verifiers: got a int, not a vf.MultiTurnEnv" in str(info.value)


def not_an_environment() -> int:
    return 3


def test_verifiers_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ConfigError) as info:
        GRPOMethod([], verifiers="tests.rollout.test_verifiers:load_environment")
    assert "pip install 'grimoire[verifiers]'" in str(info.value)
    assert "loss.args.verifiers" in str(info.value)
