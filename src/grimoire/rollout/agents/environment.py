"""The environment of a multi-turn episode: what the model talks to between its turns.

An environment follows :class:`Environment`::

    messages = env.reset(row)                      # the first messages, from a dataset row
    new_messages, reward, done = env.step(message) # after each assistant message

``step`` answers the parsed assistant message (``{"role": "assistant", "content": ...,
"tool_calls": [...]}``) with the messages to append (``tool`` results, a ``user`` turn), a
reward contribution (summed over the episode), and whether the episode is over.
``env.tools`` (optional) are the tool schemas the chat template shows the model (read after
``reset``); ``env.reward_columns()`` (optional) gives the reward functions columns of its own for
the episode, read once when the episode ends; ``env.close()`` (optional) is called once the
episode is over, however it ended (a connection with a server to end); ``env.log_name``
(optional) names it in the log instead of its class.

:class:`ToolEnvironment` is the default: built from plain Python functions, it runs the calls
of each assistant turn and ends the episode at the first turn without a call.

:func:`guarded` calls an environment's method with a timeout and checks what it returned: an
environment that raises, returns the wrong types or never finishes gives an
:class:`EnvironmentFailure` (the episode names it in the log and ends), never an exception.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from grimoire.rollout.agents.toolbox import (
    TIMEOUT,
    Tool,
    ToolResult,
    build_tools,
    call_with_timeout,
    run_tool,
)

logger = logging.getLogger(__name__)

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")


class Step(NamedTuple):
    """What :meth:`Environment.step` returns."""

    messages: list[Message]
    reward: float
    done: bool


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment (see the module docstring)."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]: ...

    def step(self, message: Message) -> Step | tuple[list[Message], float, bool]: ...


def row_prompt(row: Mapping[str, Any], prompt_field: str = "prompt") -> list[Message] | None:
    """A row's first messages: its ``messages``, else its ``prompt_field`` (a string is one user
    turn, a list is messages); None when it has neither."""
    first = row["messages"] if "messages" in row else row.get(prompt_field)
    if first is None:
        return None
    return [{"role": "user", "content": first}] if isinstance(first, str) else list(first)


def append_to_last(messages: list[Message], text: str, sep: str = "") -> list[Message]:
    """``messages`` with ``text`` added to the last message's content after ``sep`` (no ``sep``
    next to an empty side); the last message is copied, not changed in place."""
    last = dict(messages[-1])
    last["content"] = sep.join(part for part in (last.get("content") or "", text) if part)
    return [*messages[:-1], last]


class ToolEnvironment:
    """Runs the tool calls of each assistant turn; the episode ends at a turn without calls.

    ``reset`` takes the row's ``messages`` (a list of messages) or its ``prompt`` (a string, one
    user turn, or a list of messages), after an optional ``system_prompt``. Each call's result
    (or its ``error: ...`` message) is a ``tool`` message, cut to ``max_output_chars`` (counted
    as ``tools/output_cut``) so one verbose tool cannot fill the episode's token budget. ``step`` gives no reward: the reward
    functions score the finished episode. :attr:`counters` counts the calls by outcome
    (``tools/<outcome>``, see ``tools.TOOL_OUTCOMES``), cumulatively; an episode reports the
    increase of an environment's ``counters`` during it as its metrics.
    """

    def __init__(
        self,
        tools: Iterable[Callable[..., Any] | Tool],
        *,
        timeout: float | None = 10.0,
        system_prompt: str | None = None,
        prompt_field: str = "prompt",
        max_output_chars: int | None = None,
    ):
        if max_output_chars is not None and max_output_chars <= 0:
            raise ValueError(f"max_output_chars must be > 0 or None, got {max_output_chars}")
        self.toolbox = build_tools(tools)
        self.max_output_chars = max_output_chars
        self.timeout = timeout
        self.system_prompt = system_prompt
        self.prompt_field = prompt_field
        self.counters: dict[str, int] = {}

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.toolbox.values()]

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        messages = row_prompt(row, self.prompt_field)
        if messages is None:
            raise KeyError(self.prompt_field)
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def call(self, call: Mapping[str, Any]) -> ToolResult:
        function = call.get("function", call)
        result = run_tool(
            self.toolbox, function.get("name", ""), function.get("arguments") or {}, self.timeout
        )
        counted = ["tools/calls", f"tools/{result.outcome}"]
        cap = self.max_output_chars
        if cap is not None and len(result.content) > cap:
            cut = f"{result.content[:cap]}... ({len(result.content) - cap} characters cut)"
            result = ToolResult(result.name, cut, result.outcome)
            counted.append("tools/output_cut")
        for name in counted:
            self.counters[name] = self.counters.get(name, 0) + 1
        return result

    def step(self, message: Message) -> Step:
        calls = message.get("tool_calls") or []
        if not calls:
            return Step([], 0.0, True)
        results = [self.call(c) for c in calls]
        return Step(
            [{"role": "tool", "name": r.name, "content": r.content} for r in results], 0.0, False
        )


@dataclass(frozen=True)
class EnvironmentFailure:
    """An environment call that raised, timed out or returned the wrong types."""

    method: str  # "reset" or "step"
    kind: str  # "exception", "timeout" or "bad_return"
    detail: str

    def __str__(self) -> str:
        return f"{self.method} {self.kind}: {self.detail}"


def _message_problems(messages: Any, method: str) -> list[str]:
    if not isinstance(messages, list):
        return [f"{method} returned {type(messages).__name__} messages, not a list"]
    problems = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            problems.append(f"message {i} is not a dict with a role in {ROLES}: {m!r:.80}")
        elif not isinstance(m.get("content", ""), str | list | type(None)):
            problems.append(f"message {i}: content is a {type(m['content']).__name__}")
    return problems


def _check_step(value: Any) -> Step | str:
    if not isinstance(value, tuple) or len(value) != 3:
        return f"step returned {type(value).__name__}, not (messages, reward, done)"
    messages, reward, done = value
    problems = _message_problems(messages, "step")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        problems.append(f"reward is a {type(reward).__name__}, not a number")
    elif not math.isfinite(reward):
        problems.append(f"reward is {reward}")
    if not isinstance(done, bool):
        problems.append(f"done is a {type(done).__name__}, not a bool")
    return "; ".join(problems) if problems else Step(list(messages), float(reward), done)


def guarded(
    env: Environment, method: str, arg: Any, timeout: float | None
) -> Step | list[Message] | EnvironmentFailure:
    """``env.reset(arg)`` or ``env.step(arg)`` under ``timeout`` seconds, checked: the messages
    (``reset``) or the :class:`Step`, or the :class:`EnvironmentFailure` (a ``TimeoutError``
    the environment raises is a timeout too)."""
    try:
        value = call_with_timeout(getattr(env, method), timeout, arg)
    except TimeoutError as exc:  # the environment's own clock (a client's request timeout)
        return EnvironmentFailure(method, "timeout", f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return EnvironmentFailure(method, "exception", f"{type(exc).__name__}: {exc}")
    if value is TIMEOUT:
        return EnvironmentFailure(method, "timeout", f"did not return within {timeout}s")
    if method == "reset":
        problems = _message_problems(value, "reset")
        if not problems and not value:
            problems = ["reset returned no messages"]
        return EnvironmentFailure(method, "bad_return", "; ".join(problems)) if problems else value
    step = _check_step(value)
    return EnvironmentFailure(method, "bad_return", step) if isinstance(step, str) else step


def environment_tools(env: Any) -> Sequence[Mapping[str, Any]] | None:
    """The schemas an environment offers the chat template (``env.tools``), if any."""
    tools = getattr(env, "tools", None)
    return list(tools) if tools else None


def environment_name(env: Any) -> str:
    """How the log names an environment: its ``log_name`` (e.g. its server), else its class."""
    return str(getattr(env, "log_name", None) or type(env).__name__)


def close_environment(env: Any) -> None:
    """``env.close()`` when it has one; its exception is logged, not raised (the episode is
    already played)."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as exc:
        logger.warning(
            "closing environment %s: %s: %s", environment_name(env), type(exc).__name__, exc
        )


__all__ = [
    "Environment",
    "EnvironmentFailure",
    "Message",
    "Step",
    "ToolEnvironment",
    "close_environment",
    "environment_name",
    "environment_tools",
    "guarded",
]
