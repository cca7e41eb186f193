"""A tiny OpenEnv environment, written as OpenEnv's own template writes one (an ``Action``, an
``Observation``, an ``Environment`` and ``create_app``), served by ``uvicorn`` in its own
process for tests/rollout/test_openenv.py (``uvicorn tests.helpers.openenv_envs:app``)."""

from __future__ import annotations

import threading
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

#: Seconds a ``sleep`` message keeps the server's step busy (past the tests' timeout).
SLEEP = 3.0
#: Steps to an episode.
TURNS = 2


class Say(Action):
    message: str


class Heard(Observation):
    text: str = ""


class LetterCount(Environment):
    """Rewards each message with how often it says the episode's letter (the row's ``letter``
    column, default ``a``) and answers ``heard <n>``; done after :data:`TURNS` steps. A
    ``sleep`` message answers after :data:`SLEEP` seconds, a ``crash`` message raises. Its
    ``state`` tells how many instances the server has open (one per connection; OpenEnv calls
    ``close`` when a connection ends)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    open = 0
    lock = threading.Lock()

    def __init__(self):
        super().__init__()
        self.letter = "a"
        self.steps = 0
        with LetterCount.lock:
            LetterCount.open += 1

    def close(self) -> None:
        with LetterCount.lock:
            LetterCount.open -= 1

    def reset(self, seed=None, episode_id=None, letter: str = "a", **kwargs) -> Heard:
        self.letter, self.steps = letter, 0
        return Heard(text=f"say {letter}")

    def step(self, action: Say, timeout_s=None, **kwargs) -> Heard:  # type: ignore[override]
        self.steps += 1
        if action.message == "sleep":
            time.sleep(SLEEP)
        if action.message == "crash":
            raise ValueError("the environment crashed")
        n = action.message.count(self.letter)
        return Heard(text=f"heard {n}", reward=float(n), done=self.steps >= TURNS)

    @property
    def state(self) -> State:
        return State(step_count=self.steps, open=LetterCount.open)


app = create_app(LetterCount, Say, Heard, env_name="letter_count", max_concurrent_envs=16)
