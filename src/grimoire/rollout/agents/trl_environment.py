"""TRL's ``environment_factory`` classes, accepted as they are written for TRL's GRPOTrainer.

TRL's shape (``GRPOTrainer(environment_factory=MyEnv)``)::

    class MyEnv:
        def __init__(self): ...              # one instance per episode (no arguments)
        def reset(self, **row) -> str | None # the dataset row's columns; a string is appended
                                             # to the prompt's last message
        def some_tool(self, x: str) -> str:  # every public method is a tool: its schema from
            '''What it does.                 # its signature and Google-style docstring

            Args:
                x: what x is
            '''
        def get_reward(self) -> float: ...   # optional: the episode's reward from the state

:func:`trl_environment_factory` checks such a class once (before any model is loaded) and
returns the factory the agent calls per episode: a :class:`TRLEnvironment`, grimoire's
:class:`~grimoire.rollout.agents.environment.Environment`, around a fresh instance, whose tools
are that instance's bound methods. Tool calls run as a
:class:`~grimoire.rollout.agents.environment.ToolEnvironment` runs them (a raising tool is an
``error: ...`` tool message), and the episode ends at the first turn without a call.

``get_reward`` is read after every turn and each step's reward is its increase since the last
one, so the episode's summed environment reward is ``get_reward()`` after its last tool call
however the episode ends (done, ``max_turns``, the token budget), with the reward functions
added on top with their weights, as TRL adds it as a reward function of weight 1.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grimoire.errors import ConfigError
from grimoire.rollout.agents.environment import Message, Step, ToolEnvironment, append_to_last
from grimoire.rollout.agents.toolbox import Tool, tool_schema

#: The methods of a TRL environment that are not tools.
NOT_TOOLS = ("reset", "get_reward")


def tool_method_names(cls: type) -> list[str]:
    """The public methods of ``cls`` that are tools, as TRL lists them (functions on the
    class, not starting with ``_``, not ``reset`` / ``get_reward``)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    ]


def _method_schemas(cls: type, where: str) -> dict[str, dict[str, Any]]:
    """``name -> schema`` of the tool methods, from the functions bound to a placeholder (the
    schema needs the signature without ``self``, not an instance); problems in one error."""
    schemas: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for name in tool_method_names(cls):
        try:
            schemas[name] = tool_schema(types.MethodType(getattr(cls, name), object()))
        except ConfigError as exc:
            problems.extend(f"{where}: {cls.__name__}.{p}" for p in exc.problems)
    if problems:
        raise ConfigError(problems)
    return schemas


class TRLEnvironment(ToolEnvironment):
    """One episode of a TRL-shaped environment ``instance`` (module docstring): its tool
    methods are the tools, ``reset(**row)`` adds to the first prompt, ``get_reward`` rewards."""

    def __init__(
        self,
        instance: Any,
        schemas: Mapping[str, dict[str, Any]],
        extra_tools: Sequence[Callable[..., Any]] = (),
        **options: Any,
    ):
        methods = [Tool(name, getattr(instance, name), s) for name, s in schemas.items()]
        super().__init__([*extra_tools, *methods], **options)
        self.instance = instance
        self._rewarded = 0.0  # get_reward() as of the last step

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        has_prompt = "messages" in row or self.prompt_field in row
        # Without a prompt TRL starts from an empty user turn that ``reset`` fills in.
        messages = super().reset(row) if has_prompt else [{"role": "user", "content": ""}]
        observation = self.instance.reset(**row)
        self._rewarded = 0.0
        if observation is None:
            return messages
        if not isinstance(observation, str):
            raise TypeError(
                f"{type(self.instance).__name__}.reset returned a "
                f"{type(observation).__name__}; TRL's reset returns a string or None"
            )
        return append_to_last(messages, observation)

    def step(self, message: Message) -> Step:
        step = super().step(message)
        get_reward = getattr(self.instance, "get_reward", None)
        if get_reward is None:
            return step
        now = float(get_reward())
        step = Step(step.messages, now - self._rewarded, step.done)
        self._rewarded = now
        return step


def trl_environment_factory(
    cls: Any,
    extra_tools: Sequence[Callable[..., Any]] = (),
    where: str = "loss.args.environment_factory",
    **options: Any,
) -> Callable[[], TRLEnvironment]:
    """The per-episode factory of a TRL environment class ``cls`` (``extra_tools``: the
    method's standalone ``tools``, offered beside the methods; ``options``:
    :class:`~grimoire.rollout.agents.environment.ToolEnvironment`'s). Raises
    :class:`ConfigError` naming ``where`` and what is missing: not a class, no callable
    ``reset``, a tool method without hints or docstring, a ``get_reward`` that is not callable.
    """
    if not isinstance(cls, type):
        raise ConfigError(
            [f"{where}: {cls!r} is not a class (TRL's environment_factory takes the class)"]
        )
    problems = []
    if not callable(getattr(cls, "reset", None)):
        problems.append(f"{where}: {cls.__name__} has no reset method (reset(self, **row))")
    if hasattr(cls, "get_reward") and not callable(cls.get_reward):
        problems.append(f"{where}: {cls.__name__}.get_reward is not a method")
    if problems:
        raise ConfigError(problems)
    schemas = _method_schemas(cls, where)

    def make() -> TRLEnvironment:
        return TRLEnvironment(cls(), schemas, extra_tools, **options)

    make.__qualname__ = make.__name__ = f"{cls.__name__}_episode"
    return make


__all__ = ["NOT_TOOLS", "TRLEnvironment", "tool_method_names", "trl_environment_factory"]
