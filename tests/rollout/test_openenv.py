"""OpenEnv environments (``loss.args.openenv``): episodes step a real ``openenv-core`` server
(``uvicorn`` serving ``create_app(...)`` in its own process, on 127.0.0.1), its rewards are the
episode's reward, a GRPO step trains only the model's tokens, and a server that dies or is too
slow ends its episode with the failure reward and a warning naming it, never a hang.
"""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch
from tests.helpers import episodes as helpers
from tests.helpers.openenv_envs import SLEEP
from tests.helpers.openenv_server import serving

from grimoire.errors import ConfigError
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_tokenizer
from grimoire.rollout.agents.episodes import EpisodeLimits, run_episode, run_episodes
from grimoire.rollout.agents.openenv_environment import (
    OpenEnvEnvironment,
    observation_text,
    openenv_factory,
)
from grimoire.rollout.agents.tool_parsers import parse_tiny
from grimoire.rollout.engines.hf import HFGenerateEngine

APP = "tests.helpers.openenv_envs:app"
LOG = "grimoire.rollout.agents.episodes"


@pytest.fixture(scope="module")
def servers():
    """Two servers started side by side: one shared, one the fault test terminates."""
    with serving(APP, APP) as both:
        yield both


@pytest.fixture(scope="module")
def url(servers):
    return servers[0].url


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def scripted(tok, turns):
    """A sampler that writes ``turns`` in order, each closed with the template's end token."""
    end = tok.convert_tokens_to_ids("<|end|>")
    texts = list(turns)

    def generate(prompt_ids, max_new_tokens):
        ids = tok(texts.pop(0), add_special_tokens=False)["input_ids"] + [end]
        return ids, [-0.5] * len(ids)

    return generate, [end]


def play(tok, url, row, turns, **limits):
    generate, stops = scripted(tok, turns)
    env = openenv_factory({"base_url": url}, limits.pop("env_timeout", 10.0))()
    limits = EpisodeLimits(**{"max_turns": 4, "max_new_tokens": 16, **limits})
    return run_episode(row, env, generate, tok, parse_tiny, limits, stops), env


def zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def test_openenv_episode_steps_the_server_and_its_rewards_are_the_episode_reward(tok, url):
    episode, env = play(tok, url, {"prompt": "count", "letter": "b"}, ["abba", "bob b"])
    # The row's column reached the server's reset (letter=b); the reset observation follows
    # the prompt in the first user turn; each step's observation is the next user turn.
    assert [m["content"] for m in episode.messages] == [
        "count\n\nsay b",
        "abba",
        "heard 2",
        "bob b",
        "heard 3",
    ]
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user"] * 1 + [
        "assistant",
        "user",
    ]
    # LetterCount rewards the letter's count in each message, by hand: 2 then 3.
    assert episode.env_rewards == [2.0, 3.0] and episode.reward == 5.0
    assert episode.stop_reason == "done"  # the server said done after its 2 steps
    assert episode.metrics["openenv/resets"] == 1 and episode.metrics["openenv/steps"] == 2
    # The observation is read by the model, never trained: its tokens have mask 0.
    text = tok.decode([t for t, m in zip(episode.input_ids, episode.completion_mask) if not m])
    model = tok.decode([t for t, m in zip(episode.input_ids, episode.completion_mask) if m])
    assert "heard 2" in text and "heard" not in model
    assert env.client is None  # the session was closed when the episode ended


def test_openenv_episodes_in_lockstep_one_session_each(tok, url):
    end = tok.convert_tokens_to_ids("<|end|>")
    said = iter([["a", "aa", "aaa"], ["b", "a", "ab"]])

    def generate_batch(prompts, room):
        return [(tok(t, add_special_tokens=False)["input_ids"] + [end], None) for t in next(said)]

    factory = openenv_factory({"base_url": url}, 10.0)
    envs = [factory() for _ in range(3)]
    episodes = run_episodes(
        [{"prompt": "p"}] * 3, envs, generate_batch, tok, parse_tiny, EpisodeLimits(), [end]
    )
    # Each episode its own server session: the rewards are each one's own 'a' counts.
    assert [e.env_rewards for e in episodes] == [[1.0, 0.0], [2.0, 1.0], [3.0, 1.0]]
    assert all(e.stop_reason == "done" for e in episodes)
    assert all(env.client is None for env in envs)


def open_on_server(url) -> int:
    """The environments the server has open, by its own count, this probe's not included."""
    from openenv.core.generic_client import GenericEnvClient

    with GenericEnvClient(base_url=url, message_timeout_s=5.0).sync() as probe:
        return probe.state()["open"] - 1


def test_openenv_every_episode_closes_its_connection(tok, url):
    before = open_on_server(url)
    end = tok.convert_tokens_to_ids("<|end|>")
    said = iter([["a", "crash", "b"]])

    def generate_batch(prompts, room):
        return [(tok(t, add_special_tokens=False)["input_ids"] + [end], None) for t in next(said)]

    factory = openenv_factory({"base_url": url}, 10.0)
    episodes = run_episodes(
        [{"prompt": "p"}] * 3,
        [factory() for _ in range(3)],
        generate_batch,
        tok,
        parse_tiny,
        EpisodeLimits(max_turns=1),
        [end],
    )
    # Cut by max_turns (the server never said done) or failed: closed all the same.
    assert [e.stop_reason for e in episodes] == ["max_turns", "environment_error", "max_turns"]
    deadline = time.monotonic() + 5.0  # the server ends its side after the client's close
    while (now := open_on_server(url)) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now == before


def test_openenv_action_function_and_observation_field(tok, url):
    env = openenv_factory(
        {
            "base_url": url,
            "action": "tests.rollout.test_openenv:shout",
            "observation_field": "text",
        },
        10.0,
    )()
    assert env.reset({"messages": [{"role": "user", "content": "hi"}]}) == [
        {"role": "user", "content": "hi\n\nsay a"}
    ]
    step = env.step({"role": "assistant", "content": "A"})
    assert step.messages == [{"role": "user", "content": "heard 2"}] and step.reward == 2.0
    env.close()
    # No prompt column: the reset observation is the first user turn.
    assert env.reset({}) == [{"role": "user", "content": "say a"}]
    env.close()


def shout(message):
    """An ``action`` function: the content, lowered and doubled."""
    return {"message": message["content"].lower() * 2}


def test_openenv_observation_text():
    assert observation_text({"text": "x"}, None) == "x"
    assert observation_text({"b": 1, "a": "y"}, None) == '{"a": "y", "b": 1}'
    assert observation_text({"b": [1], "a": "y"}, "b") == "[1]"
    assert observation_text({"a": None}, None) == ""
    with pytest.raises(RuntimeError, match=r"no field 'c' \(observation_field\); it has \['a'\]"):
        observation_text({"a": 1}, "c")


def test_openenv_slow_server_times_out_with_failure_reward(tok, url, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOG):
        episode, env = play(
            tok, url, {"prompt": "p"}, ["sleep"], env_timeout=1.0, failure_reward=-1.0
        )
    took = time.monotonic() - start
    assert episode.reward == -1.0 and episode.stop_reason == "environment_error"
    assert episode.metrics["environment/failures/timeout"] == 1
    assert took < SLEEP - 1, f"waited {took:.1f}s for a server that sleeps {SLEEP}s"
    assert f"environment OpenEnv {url} failed in step (timeout)" in caplog.text
    assert env.client is None


def test_openenv_server_error_is_a_failure_naming_the_server(tok, url, caplog):
    with caplog.at_level(logging.WARNING, logger=LOG):
        episode, _ = play(tok, url, {"prompt": "p"}, ["crash"], failure_reward=-2.0)
    assert episode.reward == -2.0 and episode.metrics["environment/failures/exception"] == 1
    assert f"OpenEnv server {url}: step: RuntimeError" in episode.failure
    assert "the environment crashed" in caplog.text


def test_openenv_server_killed_mid_episode_fails_the_episode_not_the_run(tok, servers, caplog):
    doomed = servers[1]
    end = tok.convert_tokens_to_ids("<|end|>")
    turns = iter(["a", "aa"])

    def generate(prompt_ids, max_new_tokens):
        text = next(turns)
        if text == "aa":  # after the first step: the server process is terminated
            doomed.stop()
        return tok(text, add_special_tokens=False)["input_ids"] + [end], None

    env = openenv_factory({"base_url": doomed.url}, 5.0)()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOG):
        episode = run_episode(
            {"prompt": "p"},
            env,
            generate,
            tok,
            parse_tiny,
            EpisodeLimits(failure_reward=-3.0),
            [end],
        )
        assert doomed.process.poll() is not None
        assert episode.env_rewards == [1.0]  # the step before the fault was played
        assert episode.reward == -3.0 and episode.stop_reason == "environment_error"
        assert f"environment OpenEnv {doomed.url} failed in step" in caplog.text
        # A new episode against the dead server fails at its reset, as fast.
        again, _ = play(tok, doomed.url, {"prompt": "p"}, [], failure_reward=-3.0)
    assert again.reward == -3.0 and "reset" in again.failure and doomed.url in again.failure
    assert time.monotonic() - start < 5.0


class Scripted(HFGenerateEngine):
    """Scripted turns, each closed with the template's end token: an episode's first turn says
    ``a`` ``1 + i % 3`` times (``i``: its place in the sampling call), its later turns ``b``."""

    end_id = 0
    tok = None

    def _sample(self, prompts, n, greedy):
        out = []
        for i in range(len(prompts) * n):
            first = "heard" not in self.tok.decode(prompts[i // n])
            text = "a" * (1 + i % 3) if first else "b"
            out.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.end_id])
        return out


def test_openenv_grpo_step_trains_only_model_tokens(tiny_dir, tmp_path, url):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    engine = Scripted(max_new_tokens=8)
    engine.end_id, engine.tok = tok.convert_tokens_to_ids("<|end|>"), tok
    trainer, rows = helpers.episode_trainer(
        tiny_dir, tmp_path, [zero_reward], openenv={"base_url": url}, engine=engine
    )
    try:
        batch, metrics = helpers.one_episode_batch(trainer, rows)
        for model_text, context_text in helpers.model_and_context_texts(tok, batch):
            # The server's observations are read (attended) but never trained (mask 0).
            assert "heard" in context_text and "heard" not in model_text
        assert metrics["episode/turns_mean"] == 2.0 and metrics["openenv/steps"] == 16.0

        # The server's rewards (the 'a's said: 1 + i % 3, then 0) are the episode rewards;
        # GRPO's group advantages by hand.
        r = torch.tensor([1.0 + i % 3 for i in range(8)]).view(2, 4)
        expected = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
        torch.testing.assert_close(batch["advantages"].float().cpu(), expected)

        helpers.assert_only_model_tokens_get_gradient(
            trainer, trainer.context.unwrapped_model, batch
        )
    finally:
        trainer.close()


def test_openenv_config_errors_name_their_keys():
    def build(**args):
        return GRPOMethod([zero_reward], num_generations=2, **args)

    with pytest.raises(ConfigError) as err:
        build(openenv={"base_url": "localhost:8000", "bogus": 1, "timeout": 0})
    text = str(err.value)
    assert "loss.args.openenv.bogus: unknown key" in text
    assert "loss.args.openenv.base_url: the server's URL" in text
    assert "loss.args.openenv.timeout: seconds > 0, got 0" in text
    with pytest.raises(ConfigError, match=r"give action_field or action"):
        build(openenv={"base_url": "http://h:1", "action_field": "m", "action": str})
    with pytest.raises(ConfigError, match=r"openenv.action: cannot import"):
        build(openenv={"base_url": "http://h:1", "action": "no_such.module:f"})
    with pytest.raises(ConfigError, match=r"loss.args.openenv: a mapping"):
        build(openenv="http://h:1")
    with pytest.raises(ConfigError, match=r"give openenv or environment, not both"):
        build(openenv={"base_url": "http://h:1"}, environment=dict)
    with pytest.raises(ConfigError, match=r"give openenv or environment_factory, not both"):
        build(openenv={"base_url": "http://h:1"}, environment_factory=dict)
    with pytest.raises(ConfigError, match=r"give openenv or tools, not both"):
        build(openenv={"base_url": "http://h:1"}, tools=[shout])
    method = build(openenv={"base_url": "http://h:1"}, env_timeout=7.0)
    assert method.agent is not None
    env = method.agent.env_factory()
    assert isinstance(env, OpenEnvEnvironment)
    assert env.settings.timeout == 7.0 and env.settings.action_field == "message"
    assert env.client is None  # nothing connects before an episode's reset


def test_openenv_missing_extra_names_it(monkeypatch):
    for name in ("openenv", "openenv.core", "openenv.core.generic_client"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError) as err:
        GRPOMethod([zero_reward], num_generations=2, openenv={"base_url": "http://h:1"})
    assert err.value.problems == [
        "loss.args.openenv: OpenEnv environments need openenv-core: "
        "pip install 'grimoire[openenv]' (import of openenv.core.generic_client halted; None "
        "in sys.modules)"
    ]


def test_openenv_yaml_validates(tmp_path, capsys):
    good = helpers.episode_yaml(tmp_path, "openenv: {base_url: 'http://127.0.0.1:8000'}")
    bad = helpers.episode_yaml(
        tmp_path, "openenv: {base_url: 'http://127.0.0.1:8000', action_feild: t}"
    )
    helpers.assert_validates(capsys, good, bad, "loss.args.openenv.action_feild: unknown key")
