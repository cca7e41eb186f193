"""An OpenEnv environment, written as OpenEnv's own template writes one (nothing of grimoire's
in it): it grades the reverse task and gives a second try.

Serve it as OpenEnv serves its environments, then train against it
(examples/openenv_reverse.yaml)::

    uvicorn --app-dir examples openenv_reverse_env:app --host 127.0.0.1 --port 8000
"""

from __future__ import annotations

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class Answer(Action):
    message: str = Field(..., description="The model's answer")


class Feedback(Observation):
    text: str = Field(default="", description="What the grader says back")


class ReverseGrader(Environment):
    """``reverse abc=`` -> ``cba``. A right first answer earns 1.0; any other first turn is
    answered with ``result: cba`` (what the lookup tool answers, which the warm model learned
    to copy) and a second try worth 0.5; a wrong second answer ends the episode with 0. A turn
    that calls ``lookup`` arrives empty (grimoire's tool-call parser takes the call out of the
    message text), so it is answered like a wrong answer: with the lookup's result."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

    def __init__(self):
        super().__init__()
        self.target, self.tries = "", 0

    def reset(self, seed=None, episode_id=None, answer: str = "", **kwargs) -> Feedback:
        # The dataset row's columns arrive as keywords: `answer` is the reversed word.
        self.target, self.tries = answer, 0
        return Feedback(text="")  # nothing to add: the row's prompt is the task

    def step(self, action: Answer, timeout_s=None, **kwargs) -> Feedback:  # type: ignore[override]
        self.tries += 1
        if action.message.strip() == self.target:
            return Feedback(text="correct", reward=1.0 if self.tries == 1 else 0.5, done=True)
        if self.tries == 1:
            return Feedback(text=f"result: {self.target}", reward=0.0)
        return Feedback(text="wrong", reward=0.0, done=True)

    @property
    def state(self) -> State:
        return State(step_count=self.tries)


# Every episode of a step holds a session at once: batch_size x num_generations (4 x 8).
app = create_app(ReverseGrader, Answer, Feedback, env_name="reverse", max_concurrent_envs=64)
