"""A verifiers environment's rubric as grimoire reward functions.

:class:`RubricReward` (logged as ``verifiers``) scores finished episodes of a
:class:`~grimoire.rollout.agents.verifiers_env.VerifiersEpisode` as verifiers scores a group of
rollouts: each episode's state is closed (``env.cleanup``: the completion rendered, the
environment's ``@vf.cleanup`` handlers run), the ``G`` episodes of a prompt are scored together
by ``env.rubric.score_group`` (group reward functions see the whole group), then
``env.rubric.cleanup`` runs on each. Its reward is the rubric's weighted sum
(``state["reward"]``). :class:`RubricMetric` reads one of the rubric's functions
(``state["metrics"][name]``, its own weight included or not) for the log, at weight 0: the
rubric's functions and metrics are logged as ``rewards/verifiers/<name>/mean``.

An episode that grimoire's limits ended before a stop condition fired is closed as verifiers
closes one cut short: a turn cut by the token limits is added as a truncated response
(``is_truncated``), and ``stop_condition`` is ``grimoire_<reason>`` (``grimoire_truncated``,
``grimoire_token_budget``, ``grimoire_max_turns``). An episode whose environment failed is not
scored (its reward is the method's ``failure_reward``); its state is still closed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from grimoire.errors import ConfigError
from grimoire.rollout.agents.environment import Message
from grimoire.rollout.agents.verifiers_env import (
    VerifiersEpisode,
    load_verifiers_environment,
    mark_stopped,
    run_async,
    vf_response,
)
from grimoire.rollout.rewards.calls import RewardFunction

#: The name the rubric's total is logged under (``rewards/verifiers/mean``).
NAME = "verifiers"


async def finish(episode: VerifiersEpisode, messages: Sequence[Message], stop_reason: str) -> None:
    """Close the episode's state once (module docstring): the last turn if no step saw it,
    grimoire's stop reason if no stop condition fired, then the environment's cleanup."""
    state, env = episode.state, episode.env
    if episode.finished or state is None:
        return
    episode.finished = True
    if stop_reason == "truncated" and messages and messages[-1].get("role") == "assistant":
        turn = len(state["trajectory"])
        cut = vf_response(episode.vf, messages[-1], turn, truncated=True)
        await env.add_model_response(state, episode.prompt, cut)
    if not state.get("is_completed"):
        mark_stopped(state, stop_reason)
        state["is_truncated"] = stop_reason in ("truncated", "token_budget") or any(
            t.get("is_truncated", False) for t in state["trajectory"]
        )
    await env.cleanup(state)


async def _score(
    episodes: Sequence[VerifiersEpisode | None],
    messages: Sequence[Sequence[Message]],
    stop_reasons: Sequence[str],
    failed: Sequence[bool],
) -> None:
    for episode, m, reason in zip(episodes, messages, stop_reasons):
        if episode is not None:
            await finish(episode, m, reason)
    scored = [e for e, bad in zip(episodes, failed) if e is not None and not bad]
    # play_groups resets a prompt's G episodes with the same row: one group per run of it.
    for _, group in itertools.groupby(scored, key=lambda e: id(e.row)):
        group = list(group)
        env, states = group[0].env, [e.state for e in group]
        if env.score_rollouts:
            await env.rubric.score_group(states)
        else:
            await env.rubric.dummy_score_group(states)
        for state in states:
            await env.rubric.cleanup(state)


class RubricReward:
    """The rubric's reward of each episode (module docstring); 0.0 for a failed one."""

    __name__ = NAME

    def __call__(
        self,
        verifiers_episode: Sequence[VerifiersEpisode | None] | None = None,
        messages: Sequence[Sequence[Message]] | None = None,
        stop_reason: Sequence[str] | None = None,
        episode_failed: Sequence[bool] | None = None,
        **columns: Any,
    ) -> list[float]:
        if verifiers_episode is None or messages is None or stop_reason is None:
            raise ValueError(
                "the verifiers rubric scores episodes of a verifiers environment "
                "(loss.args.verifiers), which give verifiers_episode, messages and stop_reason"
            )
        failed = list(episode_failed or [False] * len(verifiers_episode))
        run_async(_score(verifiers_episode, messages, stop_reason, failed))
        return [
            float(e.state["reward"]) if e is not None and not bad else 0.0
            for e, bad in zip(verifiers_episode, failed)
        ]


class RubricMetric:
    """One rubric function's score of each episode, as the rubric recorded it (after
    :class:`RubricReward`, which must come first); 0.0 where it did not score."""

    def __init__(self, name: str):
        self.name = name
        self.__name__ = f"{NAME}/{name}"

    def __call__(
        self, verifiers_episode: Sequence[VerifiersEpisode | None] | None = None, **columns: Any
    ) -> list[float]:
        return [
            float(((e.state.get("metrics") or {}) if e is not None else {}).get(self.name, 0.0))
            for e in verifiers_episode or []
        ]


def verifiers_parts(
    spec: Any, max_turns: int, others: dict[str, Any], where: str
) -> tuple[Callable[[], VerifiersEpisode], tuple[RewardFunction, ...]]:
    """The agent's episode factory and reward functions for ``loss.args.verifiers`` (``spec``,
    see :func:`~grimoire.rollout.agents.verifiers_env.load_verifiers_environment`), or one
    :class:`ConfigError` naming ``where``; ``others``: the agent's other environment settings,
    which a verifiers environment excludes."""
    given = [k for k, v in others.items() if v]
    if given:
        raise ConfigError(
            [
                f"{where}: give verifiers or {', '.join(given)}, not both (a verifiers "
                "environment brings its own tools and rewards)"
            ]
        )
    env = load_verifiers_environment(spec, where)
    return partial(VerifiersEpisode, env, max_turns), tuple(rubric_rewards(env))


def rubric_rewards(env: Any) -> list[RewardFunction]:
    """The rubric's total (weight 1) and each of its functions (weight 0, logged only)."""
    names = dict.fromkeys(env.rubric._get_reward_func_names())
    metrics = [RewardFunction(RubricMetric(n), f"{NAME}/{n}", 0.0) for n in names]
    return [RewardFunction(RubricReward(), NAME, 1.0), *metrics]


__all__ = [
    "NAME",
    "RubricMetric",
    "RubricReward",
    "finish",
    "rubric_rewards",
    "verifiers_parts",
]
