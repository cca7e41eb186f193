"""An online method's rollout, assembled on the rollout side from the method's settings.

What a method is given about its rollout (``loss.args``: the reward functions, how completions
are sampled, by which engine, how stale they may be, and the multi-turn episode settings) is one
typed :class:`RolloutSettings`; :meth:`RolloutSettings.assemble` checks it and builds the
:class:`RolloutParts` the rollout stage runs with: the engine, the reward functions, the sampling
settings and the agent. :class:`grimoire.losses.online.OnlineMethod` hands its rollout settings
here whole and builds none of these parts itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grimoire.rollout.agents.agent import Agent, build_agent
from grimoire.rollout.async_rollouts import checked_staleness
from grimoire.rollout.engines.backends import EngineSpec, build_engine
from grimoire.rollout.engines.base import RolloutEngine
from grimoire.rollout.engines.sampler import SamplerConfig
from grimoire.rollout.rewards.calls import RewardFunction, RewardSpec, resolve_reward_funcs
from grimoire.rollout.stage import SamplingConfig


@dataclass(frozen=True)
class RolloutParts:
    """What an online method's rollout stage runs with (the parts of a
    :class:`~grimoire.contract.method.GeneratingMethod`): the engine that samples, the reward
    functions that score, the sampling settings (``G`` and the engine's sampler), the agent when
    samples are multi-turn episodes, and how many optimizer steps old a rollout may be."""

    engine: RolloutEngine
    reward_funcs: list[RewardFunction]
    sampling: SamplingConfig
    agent: Agent | None
    max_staleness: int


@dataclass(frozen=True)
class RolloutSettings:
    """An online method's rollout settings, as the user gives them (``loss.args``).

    Args:
        reward_funcs: reward callables, built-in short names (``"exact_match"``,
            ``"answer_match"``, ...), ``package.module:function`` specs (importing a spec runs its
            module's code) or ``{"type": name, "args": {...}}`` entries
            (:mod:`grimoire.rollout.rewards.calls`); called with keywords, as in TRL.
        reward_weights: one weight per reward function (default 1.0 each).
        num_generations: completions sampled per prompt (``G``).
        temperature, top_p, top_k, max_new_tokens: sampling (``top_k=0``, ``top_p=1``: off).
        generation_batch_size: max sequences per sampling / scoring call (memory only).
        engine: what samples (:func:`grimoire.rollout.engines.backends.build_engine`): ``"hf"``
            (the default, ``model.generate`` on the policy), ``"vllm"`` (colocated,
            :class:`~grimoire.rollout.engines.vllm_engine.VLLMEngine`), ``"vllm-server"`` (a
            ``grimoire vllm-serve`` process), a mapping ``{"type": "vllm", "args": {...}}`` (the
            sampling arguments above are passed to it), or an engine object, whose own sampler
            settings (``engine.sampler``) then override the arguments above.
        max_staleness: 0 (default) samples each step's rollouts with the step's own weights;
            ``k >= 1`` samples them in a background producer with weights at most ``k``
            optimizer steps old, while the learner trains
            (:mod:`grimoire.rollout.async_rollouts`; the hf engine, or vllm-server).
        tools, environment, environment_factory, openenv, mcp_servers, tool_call_parser,
            max_turns, max_episode_tokens, env_timeout, failure_reward, stop_tokens: multi-turn
            episodes (:func:`~grimoire.rollout.agents.agent.build_agent`).
        verifiers: instead of ``environment``, a verifiers environment (``vf.Environment`` or a
            loader spec, :mod:`grimoire.rollout.agents.verifiers_env`): it plays the episodes
            and its rubric scores them, before ``reward_funcs`` (which may then be ``[]``).
    """

    reward_funcs: RewardSpec | Sequence[RewardSpec]
    reward_weights: Sequence[float] | None = None
    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    generation_batch_size: int | None = None
    engine: EngineSpec = None
    max_staleness: int = 0
    tools: Sequence[Any] | None = None
    environment: Any = None
    environment_factory: Any = None
    openenv: Any = None
    verifiers: Any = None
    mcp_servers: Sequence[Any] | None = None
    tool_call_parser: Any = "hermes"
    max_turns: int = 4
    max_episode_tokens: int = 2048
    env_timeout: float | None = 30.0
    failure_reward: float = 0.0
    stop_tokens: Sequence[str] = ()

    @classmethod
    def of(cls, owner: str, given: Mapping[str, Any]) -> RolloutSettings:
        """The settings of ``given`` (keyword arguments); a TypeError naming ``owner``'s
        constructor for a key that is none of them, as Python's own for a bad call."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in given if k not in names]
        if unknown:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**given)

    def assemble(self, owner: str) -> RolloutParts:
        """The parts, each checked once and in the user's terms (``owner`` names the method):
        the staleness, the reward functions, the engine (an engine object keeps its own sampler
        settings, which the sampling settings then hold) and the agent."""
        max_staleness = checked_staleness(owner, self.max_staleness)
        rubric_only = self.verifiers is not None and _empty(self.reward_funcs)
        rubric_only = rubric_only and not self.reward_weights
        reward_funcs = (
            [] if rubric_only else resolve_reward_funcs(self.reward_funcs, self.reward_weights)
        )
        requested = SamplerConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            generation_batch_size=self.generation_batch_size,
        )
        engine = build_engine(self.engine, requested)
        agent = build_agent(
            self.tools,
            self.environment,
            self.tool_call_parser,
            environment_factory=self.environment_factory,
            openenv=self.openenv,
            verifiers=self.verifiers,
            mcp_servers=self.mcp_servers,
            max_turns=self.max_turns,
            max_episode_tokens=self.max_episode_tokens,
            max_new_tokens=engine.sampler.max_new_tokens,
            env_timeout=self.env_timeout,
            failure_reward=self.failure_reward,
            stop_tokens=self.stop_tokens,
        )
        if agent is not None:
            reward_funcs = [*agent.rewards, *reward_funcs]
        sampling = SamplingConfig.of(engine.sampler, self.num_generations)
        return RolloutParts(engine, reward_funcs, sampling, agent, max_staleness)


def _empty(reward_funcs: Any) -> bool:
    """``reward_funcs: []``, allowed beside a verifiers environment (its rubric rewards)."""
    return (
        isinstance(reward_funcs, Sequence)
        and not isinstance(reward_funcs, str)
        and not reward_funcs
    )


__all__ = ["RolloutParts", "RolloutSettings"]
