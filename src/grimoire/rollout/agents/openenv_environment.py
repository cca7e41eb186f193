"""OpenEnv environments: episodes played against an ``openenv-core`` server, over its client.

An OpenEnv environment runs as a server (``create_app(MyEnvironment, MyAction,
MyObservation)`` served by ``uvicorn``, locally or as a hub Space); ``loss.args.openenv`` names
it::

    openenv:
      base_url: http://127.0.0.1:8000  # the server (http:// or ws://)
      action_field: message            # the Action field the model's text goes into
      action: my_pkg.actions:to_action # or: assistant message -> the Action's fields (a dict)
      observation_field: text          # the Observation field shown to the model
      system_prompt: ...               # a system message before the first user turn
      timeout: 30                      # seconds per request (default: env_timeout)

Each episode opens its own connection (OpenEnv's WebSocket client, ``GenericEnvClient(...)
.sync()``: the server builds a fresh environment per connection) and closes it when the
episode ends, so the server's ``max_concurrent_envs`` must allow every episode of a rollout
step at once (``batch_size x num_generations`` per process).

* ``reset(row)``: the server's ``reset`` gets the row's columns as keywords (OpenEnv passes on
  only those its environment's ``reset`` takes, e.g. ``answer`` or ``seed``). The first
  messages are the row's prompt (``messages`` or ``prompt``) with the reset observation's text
  after it in the last user turn (``"\\n\\n"`` between); without a prompt column, the
  observation's text alone is the user turn; ``system_prompt`` (when given) comes first.
* ``step(message)``: the action is ``{action_field: message["content"]}`` (what the tool-call
  parser left of the turn) or ``action(message)``; the observation's text comes back as the
  next ``user`` message (none when it is empty), with the step's reward (``None`` is 0) and
  ``done``. The episode's reward is the sum of its steps' rewards.

The observation's text is its ``observation_field``; without one, the only field's value, or
every field as JSON. A server that is down, refuses a request or answers after ``timeout``
raises :class:`OpenEnvError` naming the server: the episode ends with ``failure_reward``
(:func:`~grimoire.rollout.agents.environment.guarded`), and the log names ``OpenEnv <url>``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from grimoire.config.registry import resolve
from grimoire.errors import ConfigError
from grimoire.rollout.agents.environment import Message, Step, append_to_last, row_prompt
from grimoire.rollout.agents.toolbox import TIMEOUT, call_with_timeout

logger = logging.getLogger(__name__)

INSTALL = "pip install 'grimoire[openenv]'"
#: The keys of ``loss.args.openenv``.
OPENENV_KEYS = (
    "base_url",
    "action_field",
    "action",
    "observation_field",
    "system_prompt",
    "timeout",
)
#: The keys whose value is a string, as given.
_TEXT_KEYS = ("action_field", "observation_field", "system_prompt")
#: Seconds per request when neither ``timeout`` nor ``env_timeout`` bounds it.
DEFAULT_TIMEOUT = 30.0


class OpenEnvError(RuntimeError):
    """A request to an OpenEnv server that failed (down, refused, too slow)."""


class OpenEnvTimeout(OpenEnvError, TimeoutError):
    """A request the server did not answer within ``timeout`` (a timeout failure)."""


@dataclass(frozen=True)
class OpenEnvSettings:
    """``loss.args.openenv``, checked (module docstring)."""

    base_url: str
    action_field: str = "message"
    action: Callable[[Message], Mapping[str, Any]] | None = None
    observation_field: str | None = None
    system_prompt: str | None = None
    timeout: float = DEFAULT_TIMEOUT


def observation_text(observation: Mapping[str, Any], field: str | None) -> str:
    """The text of an observation (its fields but ``reward`` / ``done`` / ``metadata``):
    ``field``'s value, else the only field's, else every field as JSON."""
    if field is not None:
        if field not in observation:
            raise OpenEnvError(
                f"the observation has no field {field!r} (observation_field); it has "
                f"{sorted(observation)}"
            )
        value = observation[field]
    elif len(observation) == 1:
        value = next(iter(observation.values()))
    else:
        value = json.dumps(dict(observation), sort_keys=True, default=str)
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _first_messages(row: Mapping[str, Any], text: str, system: str | None) -> list[Message]:
    prompt = row_prompt(row)
    if prompt is None:
        messages = [{"role": "user", "content": text}]
    else:
        messages = append_to_last(prompt, text, "\n\n") if text else prompt
    return messages if system is None else [{"role": "system", "content": system}, *messages]


class OpenEnvEnvironment:
    """One episode against an OpenEnv server (module docstring); ``client_class`` is OpenEnv's
    ``GenericEnvClient``. ``counters`` count the requests (``openenv/resets``, ``openenv/steps``)."""

    def __init__(self, settings: OpenEnvSettings, client_class: Any):
        self.settings = settings
        self.client_class = client_class
        self.client: Any = None
        self.broken = False  # a request on this connection failed, or has not answered yet
        self.counters: dict[str, int] = {}

    @property
    def log_name(self) -> str:
        """How the log names this environment when it fails (the server, not the class)."""
        return f"OpenEnv {self.settings.base_url}"

    def _request(self, what: str, call: Callable[[], Any]) -> Any:
        url = self.settings.base_url
        self.broken = True  # until it answers: guarded() may give up on it first
        try:
            result = call()
        except TimeoutError as exc:  # asyncio's wait_for, on the client's own clock
            detail = f"no answer within {self.settings.timeout}s"
            raise OpenEnvTimeout(f"OpenEnv server {url}: {what}: {detail}") from exc
        except Exception as exc:
            raise OpenEnvError(
                f"OpenEnv server {url}: {what}: {type(exc).__name__}: {exc}"
            ) from exc
        self.broken = False
        name = f"openenv/{what}s"
        self.counters[name] = self.counters.get(name, 0) + 1
        return result

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.close()  # a reused environment opens a new connection
        s = self.settings
        client = self.client_class(
            base_url=s.base_url, connect_timeout_s=s.timeout, message_timeout_s=s.timeout
        )
        self.client = client.sync()
        result = self._request("reset", lambda: self.client.reset(**row))
        text = observation_text(result.observation, s.observation_field)
        return _first_messages(row, text, s.system_prompt)

    def step(self, message: Message) -> Step:
        if self.client is None:
            raise OpenEnvError(f"OpenEnv server {self.settings.base_url}: step before reset")
        s = self.settings
        action = (
            dict(s.action(message))
            if s.action is not None
            else {s.action_field: message.get("content") or ""}
        )
        result = self._request("step", lambda: self.client.step(action))
        text = observation_text(result.observation, s.observation_field)
        reward = 0.0 if result.reward is None else float(result.reward)
        messages = [{"role": "user", "content": text}] if text else []
        return Step(messages, reward, bool(result.done))

    def close(self) -> None:
        """Closes the connection: at once when it is healthy (bounded by ``timeout``), in the
        background after a failed request (a server that did not answer a step does not answer
        the close handshake either; the episode is not held up for it)."""
        client, self.client = self.client, None
        if client is None:
            return
        if self.broken:
            threading.Thread(target=self._close, args=(client,), daemon=True).start()
        else:
            self._close(client)

    def _close(self, client: Any) -> None:
        try:
            if call_with_timeout(client.close, self.settings.timeout) is TIMEOUT:
                logger.debug("%s: the connection did not close within the timeout", self.log_name)
        except Exception as exc:  # the server died: the connection is gone with it
            logger.debug("%s: closing the connection: %s", self.log_name, exc)


def _openenv_client(where: str) -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise ConfigError(
            [f"{where}: OpenEnv environments need openenv-core: {INSTALL} ({exc})"]
        ) from exc
    return GenericEnvClient


def _settings(
    given: Any, env_timeout: float | None, where: str
) -> tuple[OpenEnvSettings | None, list[str]]:
    if not isinstance(given, Mapping):
        return None, [f"{where}: a mapping with base_url (and {', '.join(OPENENV_KEYS[1:])})"]
    problems = [
        f"{where}.{k}: unknown key (known: {', '.join(OPENENV_KEYS)})"
        for k in given
        if k not in OPENENV_KEYS
    ]
    url = given.get("base_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://", "ws://", "wss://")):
        problems.append(f"{where}.base_url: the server's URL (http://host:port), got {url!r}")
    for key in _TEXT_KEYS:
        if key in given and not (isinstance(given[key], str) and given[key]):
            problems.append(f"{where}.{key}: a non-empty string, got {given[key]!r}")
    if "action" in given and "action_field" in given:
        problems.append(f"{where}: give action_field or action (a function), not both")
    action = given.get("action")
    if isinstance(action, str):
        try:
            action = resolve(action, {}, f"{where}.action")
        except ConfigError as exc:
            problems.extend(exc.problems)
            action = None
    if action is not None and not callable(action):
        problems.append(f"{where}.action: {given['action']!r} is not callable")
    timeout = given.get("timeout", env_timeout)
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        problems.append(f"{where}.timeout: seconds > 0, got {timeout!r}")
    if problems or not isinstance(url, str):
        return None, problems
    options = {k: given[k] for k in _TEXT_KEYS if k in given}
    checked = cast("Callable[[Message], Mapping[str, Any]] | None", action)  # callable or None
    return OpenEnvSettings(url, action=checked, timeout=float(timeout), **options), []


def openenv_factory(
    given: Any, env_timeout: float | None, where: str = "loss.args.openenv"
) -> Callable[[], OpenEnvEnvironment]:
    """The per-episode factory of ``loss.args.openenv`` (module docstring); ``timeout``
    defaults to ``env_timeout``. Raises :class:`ConfigError` naming ``where.<key>`` for every
    problem, and the extra to install when openenv-core is missing. Nothing is connected
    here: each episode connects in its ``reset``."""
    settings, problems = _settings(given, env_timeout, where)
    client_class = None
    try:
        client_class = _openenv_client(where)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if problems or settings is None:
        raise ConfigError(problems)

    def make() -> OpenEnvEnvironment:
        return OpenEnvEnvironment(settings, client_class)

    make.__qualname__ = make.__name__ = "openenv_episode"
    return make


__all__ = [
    "OPENENV_KEYS",
    "OpenEnvEnvironment",
    "OpenEnvError",
    "OpenEnvSettings",
    "OpenEnvTimeout",
    "observation_text",
    "openenv_factory",
]
