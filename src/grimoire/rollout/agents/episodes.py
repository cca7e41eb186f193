"""One multi-turn episode: the model samples a turn, the environment answers, until done.

:func:`run_episode` is a pure function of its parts::

    episode = run_episode(row, env, generate, tokenizer, parser, limits)

``generate(prompt_ids, max_new_tokens) -> (completion_ids, sampler_logps | None)`` samples ONE
turn (stopping at a stop token); :func:`engine_generate` makes one from a rollout engine.

The episode's tokens are built by appending, never by re-tokenizing the conversation: the
first prompt is the chat template's rendering of ``env.reset(row)`` (with the generation
prompt); each turn appends the sampled ids as they are (``completion_mask`` 1), then the ids of
the text the template writes after them: the rest of the assistant turn's closing that the model
did not sample (Qwen's newline after ``<|im_end|>``), the environment's messages and the next
generation prompt (``completion_mask`` 0). So turn k+1's prompt extends turn k's prompt plus its
sample token for token, and the model tokens of the episode are exactly those it sampled
(re-tokenizing the rendered conversation may split the sampled text differently, or render a
tool call with other spacing than the model wrote).

That text is what follows the sampled turn's stop token in ``render(messages + new)``: the
template closes every turn with the stop token (``<|im_end|>``, ``<|eot_id|>``), so the turn's
closing is its ``n``-th occurrence, ``n`` the count in ``render(messages)`` (the conversation
up to the parsed assistant message). Unlike ``render(messages + new)[len(render(messages)):]``
this holds for templates that render a turn differently once it is no longer the last (Qwen3
drops the empty ``<think>`` block). A template that never writes the sampled stop token falls
back to that difference (counted as ``episode/stop_token_not_rendered``; where the renderings
are not prefixes of each other, after their longest common prefix:
``episode/template_not_prefix``).

:class:`EpisodeRun` is the same episode as a state machine (``prompt_ids`` -> ``feed``), so a
driver may sample the turns of many episodes in one call (:func:`run_episodes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from grimoire.rollout.agents.environment import (
    Environment,
    EnvironmentFailure,
    Message,
    close_environment,
    environment_name,
    environment_tools,
    guarded,
)
from grimoire.rollout.agents.tool_parsers import ParsedTurn, ToolCall, ToolCallParser
from grimoire.rows.rendering import render_text

logger = logging.getLogger(__name__)

#: ``generate(prompt_ids, max_new_tokens) -> (completion_ids, sampler_logps or None)``.
Generate = Callable[[list[int], int], tuple[Sequence[int], Sequence[float] | None]]
#: The batched form: one call for the turns of several episodes.
GenerateBatch = Callable[[list[list[int]], int], list[tuple[Sequence[int], Sequence[float] | None]]]


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode.

    ``max_turns``: assistant turns; ``max_tokens``: every token of the episode (first prompt,
    samples, tool and environment messages); ``max_new_tokens``: one turn's sample;
    ``env_timeout``: seconds for each ``reset`` / ``step`` (``None``: no limit);
    ``failure_reward``: the episode's reward when its environment fails.
    """

    max_turns: int = 4
    max_tokens: int = 2048
    max_new_tokens: int = 256
    env_timeout: float | None = 30.0
    failure_reward: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EpisodeLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Episode:
    """A finished episode.

    ``input_ids`` are all its tokens; ``completion_mask[t]`` is 1 where the model sampled token
    ``t`` and 0 on the first prompt, tool and environment messages and template tokens;
    ``sampler_logps[t]`` the log-prob the sampler gave a sampled token (0 elsewhere; ``None``
    when ``generate`` gave none). ``reward`` is the sum of ``env_rewards``, or the limits'
    ``failure_reward`` when the environment failed (``failure`` says how).
    """

    input_ids: list[int]
    completion_mask: list[int]
    sampler_logps: list[float] | None
    prompt_length: int
    messages: list[Message]
    tool_calls: list[list[ToolCall]]
    env_rewards: list[float]
    reward: float
    #: done / max_turns / token_budget / truncated / environment_error / template_error
    stop_reason: str
    failure: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: Columns the environment gives the reward functions (its optional ``reward_columns()``).
    columns: dict[str, Any] = field(default_factory=dict)

    @property
    def turns(self) -> int:
        return len(self.tool_calls)

    @property
    def model_token_ids(self) -> list[int]:
        """The sampled tokens, in order (the ones the loss trains)."""
        return [t for t, m in zip(self.input_ids, self.completion_mask) if m]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer, messages: list[Message], tools, generation: bool) -> str:
    return render_text(tokenizer, messages, tools=tools, generation=generation)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


class EpisodeRun:
    """One episode as a state machine: read :attr:`prompt_ids` and :attr:`room`, sample, then
    :meth:`feed` the sample; repeat until :attr:`finished`; :meth:`result` gives the
    :class:`Episode`. ``episode_id`` names the episode in the log."""

    def __init__(
        self,
        row: Mapping[str, Any],
        env: Environment,
        tokenizer,
        parser: ToolCallParser,
        limits: EpisodeLimits,
        stop_token_ids: Sequence[int] | None = None,
        episode_id: str | int = 0,
    ):
        self.env, self.tokenizer, self.parser, self.limits = env, tokenizer, parser, limits
        self.episode_id = episode_id
        stops = stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id]
        self.stop_token_ids = {int(t) for t in stops if t is not None}
        self.counters_before = dict(getattr(env, "counters", None) or {})
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logps: list[float] | None = []
        self.calls: list[list[ToolCall]] = []
        self.rewards: list[float] = []
        self.metrics: dict[str, float] = {}
        self.stop_reason = ""
        self.failure: str | None = None
        self.prompt_length = 0
        self.tools = environment_tools(env)
        first = guarded(env, "reset", row, limits.env_timeout)
        if isinstance(first, EnvironmentFailure):
            self._fail(first)
            return
        self.messages = [dict(m) for m in first]  # type: ignore[union-attr]
        self.tools = environment_tools(env)  # again: an environment may pick them per row
        try:
            text = _render(tokenizer, self.messages, self.tools, True)
        except Exception as exc:  # jinja's TemplateError, or a template's raise_exception
            detail = f"the chat template refuses its messages: {type(exc).__name__}: {exc}"
            self._fail(EnvironmentFailure("reset", "bad_return", detail))
            return
        self.ids = _encode(tokenizer, text)
        self.mask = [0] * len(self.ids)
        self.logps = [0.0] * len(self.ids)
        self.prompt_length = len(self.ids)
        if len(self.ids) >= limits.max_tokens:
            self.stop_reason = "token_budget"

    @property
    def finished(self) -> bool:
        return bool(self.stop_reason)

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.ids)

    @property
    def room(self) -> int:
        """How many tokens the next sample may have (the turn limit and the episode's budget)."""
        return min(self.limits.max_new_tokens, self.limits.max_tokens - len(self.ids))

    def _count(self, name: str, n: float = 1.0) -> None:
        self.metrics[name] = self.metrics.get(name, 0.0) + n

    def _fail(self, failure: EnvironmentFailure) -> None:
        self.failure = str(failure)
        self.stop_reason = "environment_error"
        self._count("environment/failures")
        self._count(f"environment/failures/{failure.kind}")
        logger.warning(
            "episode %s: environment %s failed in %s (%s): %s; the episode ends with reward %s",
            self.episode_id,
            environment_name(self.env),
            failure.method,
            failure.kind,
            failure.detail,
            self.limits.failure_reward,
        )

    def feed(self, completion: Sequence[int], logps: Sequence[float] | None) -> None:
        """Take one turn's sample (cut at its first stop token and at :attr:`room`)."""
        if self.finished:
            raise RuntimeError(f"episode {self.episode_id} is finished; feed() takes no more")
        sample, stop = self._append_sample(completion, logps)
        body = sample[:-1] if stop is not None else sample
        parsed = self._parse(self.tokenizer.decode(body, skip_special_tokens=False))
        self.calls.append(parsed.tool_calls)
        self._count("tool_calls/count", len(parsed.tool_calls))
        self._count("tool_calls/parse_errors", len(parsed.errors))
        if parsed.errors:
            logger.debug("episode %s: tool-call parse errors: %s", self.episode_id, parsed.errors)
        assistant = parsed.as_message()
        self.messages.append(assistant)
        if stop is None:  # cut by the token limits: the turn is unfinished, its calls unsure
            self.stop_reason = "truncated"
            return
        step = guarded(self.env, "step", assistant, self.limits.env_timeout)
        if isinstance(step, EnvironmentFailure):
            self._fail(step)
            return
        new, reward, done = cast("tuple[list[Message], float, bool]", step)  # checked by guarded
        self.rewards.append(reward)
        before = list(self.messages)
        self.messages += [dict(m) for m in new]
        if done:
            self.stop_reason = "done"
        elif len(self.calls) >= self.limits.max_turns:
            self.stop_reason = "max_turns"
        else:
            self._append_continuation(before, sample[-1])

    def _append_sample(
        self, completion: Sequence[int], logps: Sequence[float] | None
    ) -> tuple[list[int], int | None]:
        """Append one turn's sampled ids (mask 1) and their log-probs, cut at the first stop
        token and at :attr:`room`; returns the sample and the stop token's index (None: cut)."""
        sample = [int(t) for t in completion[: self.room]]
        stop = next((i for i, t in enumerate(sample) if t in self.stop_token_ids), None)
        if stop is not None:
            sample = sample[: stop + 1]
        if logps is not None and len(logps) < len(sample):
            raise ValueError(
                f"generate returned {len(logps)} log-probs for {len(sample)} sampled tokens"
            )
        self.ids += sample
        self.mask += [1] * len(sample)
        if self.logps is not None and logps is not None:
            self.logps += [float(x) for x in logps[: len(sample)]]
        else:
            self.logps = None
        return sample, stop

    def _append_continuation(self, before: list[Message], stop_id: int) -> None:
        """Append (mask 0) what the template writes after the sampled stop token: the
        environment's messages and the next assistant header, or end the episode when the
        template refuses the conversation or the tokens would pass the episode's budget."""
        try:
            tail = _encode(self.tokenizer, self._continuation(before, stop_id))
        except Exception as exc:  # the template refuses the conversation as it now is
            self.stop_reason = "template_error"
            self._count("episode/template_errors")
            logger.warning(
                "episode %s: the chat template refuses the conversation after turn %d "
                "(%s: %s); the episode ends there",
                self.episode_id,
                len(self.calls),
                type(exc).__name__,
                exc,
            )
            return
        if len(self.ids) + len(tail) >= self.limits.max_tokens:
            self.stop_reason = "token_budget"
            return
        self.ids += tail
        self.mask += [0] * len(tail)
        if self.logps is not None:
            self.logps += [0.0] * len(tail)

    def _parse(self, text: str) -> ParsedTurn:
        """The parser's reading of ``text``; a user's parser that raises or returns something
        else than a :class:`ParsedTurn` is a parse error of the turn, like a malformed call."""
        try:
            parsed = self.parser(text)
        except Exception as exc:
            return ParsedTurn(
                text, [], [f"the tool-call parser raised {type(exc).__name__}: {exc}"]
            )
        if not isinstance(parsed, ParsedTurn):
            return ParsedTurn(
                text, [], [f"the tool-call parser returned a {type(parsed).__name__}"]
            )
        return parsed

    def _continuation(self, before: list[Message], stop_token: int) -> str:
        """The text the template writes after the sampled stop token, up to the end of the
        next generation prompt (see the module docstring)."""
        old = _render(self.tokenizer, before, self.tools, False)
        new = _render(self.tokenizer, self.messages, self.tools, True)
        stop_text = self.tokenizer.decode([stop_token], skip_special_tokens=False)
        if stop_text and old.rstrip().endswith(stop_text):
            n = old.count(stop_text)
            at = -1
            for _ in range(n):
                at = new.find(stop_text, at + 1)
                if at < 0:
                    break
            if at >= 0:
                return new[at + len(stop_text) :]
        # The template does not write the sampled stop token (it closes turns with another).
        self._count("episode/stop_token_not_rendered")
        if new.startswith(old):
            return new[len(old) :]
        self._count("episode/template_not_prefix")
        return new[_common_prefix(old, new) :]

    def result(self) -> Episode:
        if not self.finished:
            raise RuntimeError(f"episode {self.episode_id} is not finished")
        failed = self.failure is not None
        reward = self.limits.failure_reward if failed else float(sum(self.rewards))
        for name, n in (getattr(self.env, "counters", None) or {}).items():
            if n != self.counters_before.get(name, 0):
                self._count(name, n - self.counters_before.get(name, 0))
        self._count(f"episode/stop/{self.stop_reason}")
        self._count("episode/turns", len(self.calls))
        self._count("episode/tokens", len(self.ids))
        self._count("episode/model_tokens", sum(self.mask))
        return Episode(
            input_ids=self.ids,
            completion_mask=self.mask,
            sampler_logps=self.logps,
            prompt_length=self.prompt_length,
            messages=self.messages,
            tool_calls=self.calls,
            env_rewards=self.rewards,
            reward=reward,
            stop_reason=self.stop_reason,
            failure=self.failure,
            metrics=dict(self.metrics),
            columns=dict(getattr(self.env, "reward_columns", dict)()),
        )


def run_episode(
    row: Mapping[str, Any],
    env: Environment,
    generate: Generate,
    tokenizer,
    parser: ToolCallParser,
    limits: EpisodeLimits = EpisodeLimits(),
    stop_token_ids: Sequence[int] | None = None,
    episode_id: str | int = 0,
) -> Episode:
    """Play one episode to its end (see the module docstring); the environment is closed
    after it (``env.close()``, when it has one)."""
    try:
        run = EpisodeRun(row, env, tokenizer, parser, limits, stop_token_ids, episode_id)
        while not run.finished:
            completion, logps = generate(run.prompt_ids, run.room)
            run.feed(completion, logps)
        return run.result()
    finally:
        close_environment(env)


def run_episodes(
    rows: Sequence[Mapping[str, Any]],
    envs: Sequence[Environment],
    generate_batch: GenerateBatch,
    tokenizer,
    parser: ToolCallParser,
    limits: EpisodeLimits = EpisodeLimits(),
    stop_token_ids: Sequence[int] | None = None,
    episode_ids: Sequence[str | int] | None = None,
) -> list[Episode]:
    """Episodes of ``rows`` (one environment each) in lockstep: every sampling call takes the
    next turn of all unfinished episodes (``max_new_tokens``: the largest room among them; each
    sample is cut to its own episode's room). ``episode_ids`` name them in the log (default:
    their index). Every environment is closed after them (``env.close()``, when it has one)."""
    if len(rows) != len(envs):
        raise ValueError(f"{len(rows)} rows but {len(envs)} environments")
    ids = list(episode_ids) if episode_ids is not None else list(range(len(rows)))
    if len(ids) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(ids)} episode ids")
    try:
        runs = [
            EpisodeRun(row, env, tokenizer, parser, limits, stop_token_ids, episode_id=name)
            for row, env, name in zip(rows, envs, ids)
        ]
        while live := [r for r in runs if not r.finished]:
            samples = generate_batch([r.prompt_ids for r in live], max(r.room for r in live))
            if len(samples) != len(live):
                raise ValueError(
                    f"generate_batch returned {len(samples)} samples for {len(live)} prompts"
                )
            for run, (completion, logps) in zip(live, samples):
                run.feed(completion, logps)
        return [r.result() for r in runs]
    finally:
        for env in envs:
            close_environment(env)


def sum_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Every episode metric summed over ``episodes``, and the mean reward and turns."""
    out: dict[str, float] = {}
    for e in episodes:
        for name, value in e.metrics.items():
            out[name] = out.get(name, 0.0) + value
    if episodes:
        out["episode/reward_mean"] = sum(e.reward for e in episodes) / len(episodes)
        out["episode/turns_mean"] = sum(e.turns for e in episodes) / len(episodes)
    return out


__all__ = [
    "Episode",
    "EpisodeLimits",
    "EpisodeRun",
    "Generate",
    "GenerateBatch",
    "run_episode",
    "run_episodes",
    "sum_metrics",
]
