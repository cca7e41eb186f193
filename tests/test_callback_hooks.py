"""Callback hooks are found by name, so a misspelt one must be an error when the callback is
registered (from Python or from a YAML ``callbacks:`` entry), never a hook that silently does
not run."""

from __future__ import annotations

import pytest

from grimoire import TrainerCallback, TrainingConfig
from grimoire.cli.schema import validate_config
from grimoire.errors import ConfigError
from grimoire.training.callbacks import (
    HOOKS,
    CallbackList,
    ProgressCallback,
    hook_problems,
)
from grimoire.training.heldout import ExactMatchCallback
from grimoire.training.setup import build_callbacks


class Misspelt(TrainerCallback):
    """``on_step_ended`` instead of ``on_step_end``: the loop would never call it."""

    def on_step_ended(self, trainer, step, loss, metrics) -> None: ...


class Duck:
    """Not a TrainerCallback subclass (hooks are found by name): checked the same way."""

    def on_train_begin(self, trainer) -> None: ...

    def on_evalute(self, trainer, metrics) -> None: ...


def test_hooks_are_the_base_class_methods():
    assert HOOKS == (
        "on_epoch_begin",
        "on_epoch_end",
        "on_evaluate",
        "on_log",
        "on_save",
        "on_step_end",
        "on_train_begin",
        "on_train_end",
    )


def test_misspelt_hook_is_an_error_at_registration_naming_it_and_the_hooks():
    with pytest.raises(ConfigError) as info:
        CallbackList([ProgressCallback(), Misspelt(), Duck()])
    problems = info.value.problems
    assert len(problems) == 2  # both callbacks' problems in one message
    assert "Misspelt defines on_step_ended" in problems[0]
    assert "did you mean on_step_end?" in problems[0]
    assert "Duck defines on_evalute" in problems[1] and "did you mean on_evaluate?" in problems[1]
    assert all(", ".join(HOOKS) in p for p in problems)
    # The trainer's own build step, and a callback added later, are checked the same way.
    with pytest.raises(ConfigError, match="on_step_ended"):
        build_callbacks([Misspelt()], TrainingConfig(output_dir="unused"))
    callbacks = CallbackList([ProgressCallback()])
    with pytest.raises(ConfigError, match="on_evalute"):
        callbacks.add(Duck())
    assert len(callbacks.callbacks) == 1


def test_correct_callbacks_register_and_run():
    rows = [{"prompt": "a", "answer": "b"}]
    seen = []

    class Counter(TrainerCallback):
        on_label = "not a method: attributes are not hooks"

        def on_log(self, trainer, metrics) -> None:
            seen.append(metrics["loss"])

    callbacks = CallbackList([ProgressCallback(), ExactMatchCallback(rows), Counter()])
    callbacks("on_log", None, {"loss": 1.5})
    assert seen == [1.5]
    assert hook_problems(Counter) == []


def test_dispatching_an_unknown_hook_name_is_an_error():
    with pytest.raises(ValueError, match="no callback hook 'on_step_ended'"):
        CallbackList([])("on_step_ended", None)


def test_yaml_callback_with_a_misspelt_hook_is_a_config_problem():
    raw = {
        "model": "tiny:llama",
        "dataset": {"jsonl": "unused.jsonl"},
        "callbacks": [{"type": "tests.test_callback_hooks:Misspelt"}],
    }
    problems = [p for p in validate_config(raw) if p.startswith("callbacks[0]")]
    assert len(problems) == 1, problems
    assert problems[0].startswith("callbacks[0].type: callback Misspelt defines on_step_ended")
