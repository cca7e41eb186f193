"""An online method's agentic settings, and the rollout of one prompt micro-batch as episodes.

:func:`build_agent` turns the method arguments (``tools``, ``environment`` or TRL's
``environment_factory``, an OpenEnv server's ``openenv`` or a ``verifiers`` environment,
``mcp_servers``, ``tool_call_parser``, ``max_turns``, ``max_episode_tokens``, ``env_timeout``,
``failure_reward``, ``stop_tokens``) into an :class:`Agent`, checked once, before any model is
loaded (MCP servers are started or reached and list their tools then): every unimportable spec,
tool without a docstring or hint, unknown parser or bad limit
is listed in one :class:`~grimoire.errors.ConfigError` naming its ``loss.args`` key.

:func:`episode_rollout` lays a group's episodes out as a
:class:`~grimoire.rollout.engines.base.Rollout` whose ``completion_mask`` is the LOSS mask (1 on the
model's sampled tokens only) and whose ``completion_attention`` covers every real token after
the first prompt (tool results, environment messages, template tokens): the policy reads them,
the loss never trains them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch

from grimoire.config.registry import resolve
from grimoire.errors import ConfigError
from grimoire.rollout.agents.environment import Environment, ToolEnvironment
from grimoire.rollout.agents.episode_batches import pad_episodes
from grimoire.rollout.agents.episodes import Episode, EpisodeLimits
from grimoire.rollout.agents.mcp_tools import McpToolset, connect_mcp_tools, parse_mcp_servers
from grimoire.rollout.agents.openenv_environment import openenv_factory
from grimoire.rollout.agents.tool_parsers import ToolCallParser, resolve_tool_call_parser
from grimoire.rollout.agents.toolbox import build_tools
from grimoire.rollout.agents.trl_environment import trl_environment_factory
from grimoire.rollout.agents.verifiers_rubric import verifiers_parts
from grimoire.rollout.engines.base import Rollout
from grimoire.rollout.rewards.calls import RewardFunction

#: Where an episode ended before its model was done with it (counted as a clipped completion).
_CUT = ("max_turns", "token_budget", "truncated")


@dataclass(frozen=True)
class Agent:
    """How a method plays episodes: a fresh environment per episode from ``env_factory()``,
    the parser of its turns, the episode limits, and extra stop tokens (the chat template's
    end-of-turn token, when it is not the tokenizer's EOS); ``rewards``: reward functions the
    environment brings (a verifiers environment's rubric), scored before the method's own."""

    env_factory: Callable[[], Environment]
    parser: ToolCallParser
    limits: EpisodeLimits
    stop_tokens: tuple[str, ...] = field(default_factory=tuple)
    rewards: tuple[RewardFunction, ...] = ()
    #: What the agent holds open for the run (MCP connections), closed by :meth:`close`.
    resources: tuple[McpToolset, ...] = field(default_factory=tuple)

    def close(self) -> None:
        for resource in self.resources:
            resource.close()


def _resolved(spec: Any, kind: str, problems: list[str]) -> Any:
    if not isinstance(spec, str):
        return spec
    try:
        return resolve(spec, {}, kind)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


def _openenv(
    settings: Any, env_timeout: float | None, problems: list[str], others: dict[str, Any]
) -> Any:
    """The OpenEnv episode factory of ``loss.args.openenv`` (None, problems added, when it is
    wrong or given with one of ``others``: ``tools``, ``environment``, ``environment_factory``,
    ``verifiers``)."""
    given = [name for name, value in others.items() if value]
    if given:
        problems.append(f"loss.args: give openenv or {' / '.join(given)}, not both")
    try:
        return openenv_factory(settings, env_timeout, "loss.args.openenv")
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


def _limits(problems: list[str], failure_reward: Any, **limits: Any) -> EpisodeLimits | None:
    try:
        return EpisodeLimits(failure_reward=float(failure_reward), **limits)
    except (ValueError, TypeError) as exc:
        problems.append(f"loss.args: {exc}")
        return None


def build_agent(
    tools: Sequence[Any] | None,
    environment: Any,
    tool_call_parser: Any,
    *,
    environment_factory: Any = None,
    openenv: Any = None,
    verifiers: Any = None,
    mcp_servers: Any = None,
    max_turns: int,
    max_episode_tokens: int,
    max_new_tokens: int,
    env_timeout: float | None,
    failure_reward: float,
    stop_tokens: Sequence[str] = (),
) -> Agent | None:
    """The :class:`Agent` of these settings, or None when neither ``tools`` nor an
    ``environment`` is given (single-completion rollouts).

    ``tools``: functions or ``package.module:function`` specs (schemas from their signatures
    and docstrings); ``environment``: a factory (callable or spec) called once per episode,
    default a :class:`~grimoire.rollout.agents.environment.ToolEnvironment` over ``tools``;
    ``environment_factory``: instead, a class (or spec) written to TRL's ``environment_factory``
    interface (:mod:`grimoire.rollout.agents.trl_environment`), its methods the tools beside
    ``tools``; ``openenv``: instead, an OpenEnv server's settings
    (:mod:`grimoire.rollout.agents.openenv_environment`); ``verifiers``: instead, a verifiers
    environment (an instance or a loader spec,
    :func:`~grimoire.rollout.agents.verifiers_env.load_verifiers_environment`) whose rubric
    becomes :attr:`Agent.rewards`. ``openenv`` and ``verifiers`` exclude the others.
    ``mcp_servers``: MCP servers whose tools are offered beside ``tools``
    (:mod:`grimoire.rollout.agents.mcp_tools`), not with an environment of one's own.
    """
    sources = (environment, environment_factory, openenv, verifiers)
    if not tools and not mcp_servers and all(source is None for source in sources):
        return None
    where = "loss.args"
    problems: list[str] = []
    functions = _functions(tools, problems)
    # With openenv or verifiers the servers are refused (below), not started.
    servers = mcp_servers if openenv is None and verifiers is None else None
    held = _mcp_toolsets(servers, environment, functions, problems)
    functions = [*functions, *(tool for toolset in held for tool in toolset.tools)]
    given = {
        "tools": tools,
        "mcp_servers": mcp_servers or None,
        "environment": environment,
        "environment_factory": environment_factory,
    }
    factory, rewards = _episode_source(
        functions, given, openenv, verifiers, max_turns, env_timeout, problems
    )
    parser: ToolCallParser | None = None
    try:
        parser = resolve_tool_call_parser(tool_call_parser)
    except (ConfigError, TypeError) as exc:
        problems.extend(getattr(exc, "problems", None) or [f"{where}.tool_call_parser: {exc}"])
    limits = _limits(
        problems,
        max_turns=max_turns,
        max_tokens=max_episode_tokens,
        max_new_tokens=max_new_tokens,
        env_timeout=env_timeout,
        failure_reward=failure_reward,
    )
    if isinstance(stop_tokens, str) or not all(isinstance(s, str) for s in stop_tokens):
        problems.append(f"{where}.stop_tokens: a list of token strings, got {stop_tokens!r}")
    if problems or limits is None or parser is None:
        for toolset in held:
            toolset.close()
        raise ConfigError(problems, title="invalid agentic rollout settings")
    # Resolved and checked callable (a problem otherwise): the environment factory.
    env_factory = cast("Callable[[], Environment]", factory)
    return Agent(env_factory, parser, limits, tuple(stop_tokens), rewards, held)


def _functions(tools: Any, problems: list[str]) -> list[Any]:
    """The ``tools`` (functions or specs) resolved, their schemas built now (not at the first
    episode); their problems added to ``problems``."""
    if tools is not None and (isinstance(tools, str) or not isinstance(tools, Sequence)):
        tools = [tools]
    functions = [_resolved(t, f"loss.args.tools[{i}]", problems) for i, t in enumerate(tools or ())]
    if not problems and functions:
        try:
            build_tools(functions)
        except ConfigError as exc:
            problems.extend(f"loss.args.{p}" for p in exc.problems)
    return functions


def _mcp_toolsets(
    mcp_servers: Any, environment: Any, functions: list[Any], problems: list[str]
) -> tuple[McpToolset, ...]:
    """The tools of ``mcp_servers`` (started or reached now; none or one toolset), when the
    rest of the tool settings are sound; their problems added to ``problems``. (``openenv`` and
    ``verifiers``, which bring their own tools, refuse them in :func:`_episode_source`.)"""
    if not mcp_servers:
        return ()
    where = "loss.args.mcp_servers"
    if environment is not None:
        problems.append(
            f"{where}: offered by the default tool environment or an environment_factory "
            "class; a custom environment brings its own tools"
        )
    try:
        servers = parse_mcp_servers(mcp_servers, where)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return ()
    if problems:  # a broken config starts no server
        return ()
    try:
        return (connect_mcp_tools(servers, [getattr(f, "__name__", "") for f in functions], where),)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return ()


def _episode_source(
    functions: list[Any],
    given: dict[str, Any],
    openenv: Any,
    verifiers: Any,
    max_turns: int,
    env_timeout: float | None,
    problems: list[str],
) -> tuple[Any, tuple[RewardFunction, ...]]:
    """:func:`build_agent`'s per-episode environment factory (problems added to
    ``problems``) and the reward functions it brings: ``given``'s ``environment`` or TRL's
    ``environment_factory``, an ``openenv`` server, a ``verifiers`` environment, or a
    ToolEnvironment over ``given``'s tools. ``openenv`` and ``verifiers`` exclude ``given``."""
    where = "loss.args"
    environment, environment_factory = given["environment"], given["environment_factory"]
    factory = _resolved(environment, f"{where}.environment", problems)
    if environment is not None and factory is not None and not callable(factory):
        problems.append(f"{where}.environment: {environment!r} is not callable (a factory)")
    trl_class = _resolved(environment_factory, f"{where}.environment_factory", problems)
    if environment is not None and environment_factory is not None:
        problems.append(f"{where}: give environment or environment_factory (TRL's), not both")
    elif trl_class is not None and not problems:
        try:
            factory = trl_environment_factory(trl_class, functions)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if openenv is not None:
        others = {**given, "verifiers": verifiers}
        return _openenv(openenv, env_timeout, problems, others), ()
    if verifiers is not None:
        try:
            return verifiers_parts(verifiers, max_turns, given, f"{where}.verifiers")
        except ConfigError as exc:
            problems.extend(exc.problems)
    if environment is None and environment_factory is None and verifiers is None:
        factory = partial(ToolEnvironment, functions)
    return factory, ()


def episode_rollout(
    episodes: Sequence[Episode], pad_token_id: int, group_size: int, device: torch.device
) -> Rollout:
    """A group's episodes (prompt-major) as a :class:`Rollout` (module docstring): loss mask
    ``completion_mask [N, C]``, attention ``completion_attention [N, C]``, the sampler's
    per-token log-probs as ``sampler_logps`` (0 off the model's tokens), ``truncated`` where the
    episode was cut by a limit. Old log-probs are the engine's to score (over the whole
    episode)."""
    t = pad_episodes(episodes, pad_token_id)
    attention = t["attention_mask"]
    assert attention is not None and t["prompt_ids"] is not None
    width = t["prompt_ids"].shape[1]
    sampler = t["sampler_logps"]
    return Rollout(
        prompt_ids=t["prompt_ids"].to(device),
        prompt_mask=attention[:, :width].to(device),
        completion_ids=t["completion_ids"].to(device),  # type: ignore[union-attr]
        completion_mask=t["completion_mask"].to(device),  # type: ignore[union-attr]
        old_logps=None,
        group_size=group_size,
        truncated=torch.tensor([e.stop_reason in _CUT for e in episodes], device=device),
        sampler_logps=None if sampler is None else sampler.to(device),
        completion_attention=attention[:, width:].to(device),
    )


__all__ = ["Agent", "build_agent", "episode_rollout"]
