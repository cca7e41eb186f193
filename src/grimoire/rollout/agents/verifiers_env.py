"""verifiers' environments (``vf.Environment``, the ``verifiers`` package's classic API) played by
grimoire's own episode loop.

A verifiers environment normally runs its rollouts itself, asking a model behind an OpenAI
client for each turn. Here grimoire's sampler writes the turns and the environment's own methods
do the rest, in the order ``MultiTurnEnv.rollout`` calls them::

    state = env.init_state(row)            # reset: the row as a RolloutInput
    env.setup_state(state)                 #        (a vf.Error there fails the episode)
    prompt = env.get_prompt_messages(state)
    # each sampled turn (step):
    env.add_model_response(state, prompt, response)    # the turn as a vf.Response
    env.is_completed(state)                # the environment's @vf.stop conditions
    prompt = env.get_prompt_messages(state)            # calls env.env_response (tools, ...)

:class:`VerifiersEpisode` is that sequence as grimoire's
:class:`~grimoire.rollout.agents.environment.Environment`: ``step`` returns the messages
``env_response`` added (or the ``final_env_response``) and ``done`` when a stop condition fired.
The finished episode is scored by the environment's rubric
(:mod:`grimoire.rollout.agents.verifiers_rubric`), to which ``reward_columns`` hands the episode.

verifiers' methods are coroutines: they run on one event loop in a background thread for the
whole process (:func:`run_async`), so an environment that keeps async resources between calls
(a client, a sandbox) finds them on the loop that made them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping
from contextlib import contextmanager
from functools import cache, partial
from typing import Any

from grimoire.config.registry import resolve
from grimoire.errors import ConfigError
from grimoire.rollout.agents.environment import Message, Step

#: How to install the missing package.
EXTRA = "pip install 'grimoire[verifiers]'"
WHERE = "loss.args.verifiers"
#: The keys of the mapping form ``{env: ..., args: {...}}``.
SPEC_KEYS = ("env", "args")


def import_verifiers(where: str = WHERE) -> Any:
    """The ``verifiers`` module, or one :class:`ConfigError` saying how to install it."""
    try:
        import verifiers
    except ImportError as exc:
        raise ConfigError(
            [f"{where}: the verifiers package is not installed ({EXTRA}; verifiers 0.2.x)"]
        ) from exc
    return verifiers


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def run_async(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coroutine`` on the process's verifiers event loop (started on first use, in a
    daemon thread) and wait for its result."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="verifiers-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coroutine, _loop).result()


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """``vf.Environment.__init__`` installs its own SIGINT / SIGTERM handlers (SIGTERM exits the
    process); the run's own handling of those signals (a checkpoint, then exit) stays."""
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def load_verifiers_environment(spec: Any, where: str = WHERE) -> Any:
    """The ``vf.MultiTurnEnv`` that ``spec`` names, or one :class:`ConfigError` naming ``where``.

    ``spec``: an environment instance; a ``package.module:load_environment`` spec or a function
    (called without arguments); an environment id without ``:`` (``vf.load_environment(id)``
    imports the module of that name and calls its ``load_environment``); or a mapping
    ``{env: <one of those>, args: {...}}`` whose ``args`` are the loader's keywords.
    """
    vf = import_verifiers(where)
    if isinstance(spec, vf.Environment):
        return _checked(vf, spec, where)
    args: Mapping[str, Any] = {}
    if isinstance(spec, Mapping):
        unknown = [k for k in spec if k not in SPEC_KEYS]
        if unknown or "env" not in spec or not isinstance(spec.get("args") or {}, Mapping):
            raise ConfigError(
                [f"{where}: expected {{env: <spec or id>, args: {{...}}}}, got {dict(spec)!r}"]
            )
        spec, args = spec["env"], spec.get("args") or {}
        where = f"{where}.env"
    if isinstance(spec, str) and ":" in spec:
        loader = resolve(spec, {}, where)
    elif isinstance(spec, str):
        loader = partial(vf.load_environment, spec)
    else:
        loader = spec
    if not callable(loader):
        raise ConfigError([f"{where}: {spec!r} is neither a vf.Environment nor a loader"])
    try:
        with _signal_handlers_kept():
            env = loader(**args)
    except Exception as exc:
        raise ConfigError(
            [f"{where}: loading {spec!r} raised {type(exc).__name__}: {exc}"]
        ) from exc
    return _checked(vf, env, where)


def _checked(vf: Any, env: Any, where: str) -> Any:
    if not isinstance(env, vf.MultiTurnEnv):
        raise ConfigError(
            [
                f"{where}: got a {type(env).__name__}, not a vf.MultiTurnEnv (SingleTurnEnv, "
                "ToolEnv, StatefulToolEnv, or a MultiTurnEnv with its env_response): grimoire "
                "plays episodes through those methods"
            ]
        )
    if env.dataset_source is None and env.dataset is None and env.eval_dataset is None:
        raise ConfigError([f"{where}: {type(env).__name__} has no dataset"])
    return env


def verifiers_rows(env: Any, split: str = "train") -> list[dict[str, Any]]:
    """The environment's dataset (``split`` "train": ``env.get_dataset()``, "eval":
    ``env.get_eval_dataset()``) as prompt rows: ``prompt`` is the chat message list verifiers
    formatted (its ``system_prompt`` and ``few_shot`` included), and ``answer``, ``info``,
    ``task``, ``example_id`` and every other column pass through to the episode's state and the
    rubric. Message keys the dataset's table added as empty (``tool_calls: None``) are dropped."""
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    rows = []
    for row in dataset:
        row = dict(row)
        if isinstance(row.get("prompt"), list):
            row["prompt"] = [
                {k: v for k, v in dict(m).items() if v is not None} for m in row["prompt"]
            ]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- messages


def from_vf_message(message: Any, names: Mapping[str, str]) -> Message:
    """One verifiers message as a chat-template dict: ``tool_calls`` in the OpenAI shape with
    their arguments as an object; a tool message gets its tool's ``name`` (``names``: call id ->
    tool name), which templates print."""
    out = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": _arguments(c["arguments"])},
            }
            for c in out["tool_calls"]
        ]
    if out.get("role") == "tool" and out.get("tool_call_id") in names:
        out.setdefault("name", names[out["tool_call_id"]])
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def vf_response(vf: Any, message: Message, turn: int, truncated: bool = False) -> Any:
    """The sampled assistant ``message`` as the ``vf.Response`` a client would have returned
    (its calls with ids ``call_<turn>_<i>``; no token data: grimoire keeps the tokens)."""
    from verifiers.types import ResponseMessage

    calls = [
        vf.ToolCall(
            id=f"call_{turn}_{i}",
            name=c["function"]["name"],
            arguments=json.dumps(c["function"].get("arguments") or {}),
        )
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    reason = "length" if truncated else ("tool_calls" if calls else "stop")
    reply = ResponseMessage(
        content=message.get("content"),
        reasoning_content=message.get("reasoning_content"),
        tool_calls=calls or None,
        finish_reason=reason,
        is_truncated=truncated,
    )
    return vf.Response(
        id=f"grimoire-{turn}", created=int(time.time()), model="grimoire", message=reply
    )


def tool_schema(tool: Any) -> dict[str, Any]:
    """A ``vf.Tool`` as the ``{"type": "function", "function": {...}}`` schema chat templates
    take."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


@cache
def _no_client() -> Any:
    """A ``vf.Client`` that refuses to sample: the state needs one, grimoire samples itself."""
    from verifiers.clients.client import Client

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "grimoire samples the model's turns itself; this environment asked its client for "
            "a response (a model call inside env_response or a rubric is not supported)"
        )

    methods = (
        "setup_client",
        "to_native_tool",
        "to_native_prompt",
        "get_native_response",
        "raise_from_native_response",
        "from_native_response",
        "close",
        "get_response",
    )
    cls = type("GrimoireNoClient", (Client,), dict.fromkeys(methods, refuse))
    return cls(None)


# --------------------------------------------------------------------------- one episode


class VerifiersEpisode:
    """One episode of a ``vf.MultiTurnEnv`` (module docstring). ``max_turns``: grimoire's
    bound, applied as one more stop condition (verifiers' own ``max_turns`` applies too)."""

    def __init__(self, env: Any, max_turns: int):
        self.vf = import_verifiers()
        self.env, self.max_turns = env, max_turns
        self.state: Any = None
        self.prompt: list[Any] = []  # the current turn's prompt, as verifiers' messages
        self.row: Mapping[str, Any] | None = None
        self.names: dict[str, str] = {}  # tool call id -> tool name
        self.finished = False  # scored: see verifiers_rubric.finish

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        defs = self.state["tool_defs"] if self.state is not None else self.env.tool_defs
        return [tool_schema(t) for t in defs or []] or None

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.row = row
        self.state = run_async(self._reset(dict(row)))
        return [from_vf_message(m, self.names) for m in self.prompt]

    async def _reset(self, row: dict[str, Any]) -> Any:
        state = await self.env.init_state(self._input(row), _no_client(), "grimoire")
        state["timing"].generation.start = time.time()
        setup = await self.env.setup_state(state)
        state = setup if setup is not None else state
        self.prompt = self._normalized(await self.env.get_prompt_messages(state))
        return state

    def _input(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row as a ``RolloutInput``: a text ``prompt`` (or a ``question`` without one) is
        formatted as verifiers formats its datasets (``system_prompt``, ``few_shot``, the text
        as the user turn)."""
        row.setdefault("example_id", 0)
        text = row.get("prompt", row.get("question"))
        if isinstance(text, str):
            system = [{"role": "system", "content": self.env.system_prompt}]
            row["prompt"] = [
                *(system if self.env.system_prompt else []),
                *(self.env.few_shot or []),
                {"role": "user", "content": text},
            ]
        return row

    def _normalized(self, messages: Any) -> list[Any]:
        from verifiers.utils.message_utils import maybe_normalize_messages

        return list(maybe_normalize_messages(messages, field_name="prompt_messages"))

    def step(self, message: Message) -> Step:
        return run_async(self._step(message))

    async def _step(self, message: Message) -> Step:
        state, turn = self.state, len(self.state["trajectory"])
        response = vf_response(self.vf, message, turn)
        self.names.update({c.id: c.name for c in response.message.tool_calls or []})
        await self.env.add_model_response(state, self.prompt, response)
        if await self.env.is_completed(state):
            return Step([], 0.0, True)
        if len(state["trajectory"]) >= self.max_turns:
            mark_stopped(state, "max_turns")
            return Step([], 0.0, True)
        before = [*self.prompt, *state["trajectory"][-1]["completion"]]
        try:
            prompt = self._normalized(await self.env.get_prompt_messages(state))
        except self.vf.Error as exc:  # verifiers records it and its has_error condition stops
            state["error"] = exc
            await self.env.is_completed(state)
            return Step([], 0.0, True)
        final = state.get("final_env_response")
        if final is not None:
            await self.env.is_completed(state)
            return Step(
                [from_vf_message(m, self.names) for m in self._normalized(final)], 0.0, True
            )
        if prompt[: len(before)] != before:
            raise ValueError(
                f"{type(self.env).__name__}.get_prompt_messages does not extend the conversation "
                "(grimoire appends each turn's messages to the episode's tokens)"
            )
        self.prompt = prompt
        return Step([from_vf_message(m, self.names) for m in prompt[len(before) :]], 0.0, False)

    def reward_columns(self) -> dict[str, Any]:
        """The episode itself, for the rubric's reward function."""
        return {"verifiers_episode": self}


def mark_stopped(state: Any, reason: str) -> None:
    """End a state as a verifiers stop condition would (``stop_condition`` names grimoire's
    limit)."""
    state["is_completed"] = True
    state["stop_condition"] = f"grimoire_{reason}"


__all__ = [
    "EXTRA",
    "VerifiersEpisode",
    "from_vf_message",
    "import_verifiers",
    "load_verifiers_environment",
    "mark_stopped",
    "run_async",
    "tool_schema",
    "verifiers_rows",
    "vf_response",
]
