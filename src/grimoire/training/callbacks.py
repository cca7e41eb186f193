"""Callbacks: hook into the training loop without touching it.

Hooks (all optional, all receive the trainer first):
``on_train_begin``, ``on_train_end``, ``on_epoch_begin(epoch)``, ``on_epoch_end(epoch)``,
``on_step_end(step, loss, metrics)``, ``on_log(metrics)``, ``on_evaluate(metrics)``,
``on_save(checkpoint_dir)``. Call ``trainer.request_stop()`` from any hook to stop gracefully
after the current step (synchronised across ranks).

A hook is found by its name, so a misspelt one would never run: :class:`CallbackList` refuses,
when a callback is registered, any ``on_*`` method that is not one of :data:`HOOKS`, naming it
and the hooks there are.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from grimoire.errors import ConfigError


class TrainerCallback:
    """Base class: override the hooks you need (only these: another ``on_*`` method is an error
    when the callback is registered)."""

    def on_train_begin(self, trainer) -> None: ...

    def on_train_end(self, trainer) -> None: ...

    def on_epoch_begin(self, trainer, epoch: int) -> None: ...

    def on_epoch_end(self, trainer, epoch: int) -> None: ...

    def on_step_end(self, trainer, step: int, loss: float, metrics: dict[str, float]) -> None: ...

    def on_log(self, trainer, metrics: dict[str, float]) -> None: ...

    def on_evaluate(self, trainer, metrics: dict[str, float]) -> None: ...

    def on_save(self, trainer, checkpoint_dir: str) -> None: ...


#: The hooks the loop calls: the ``on_*`` methods of :class:`TrainerCallback`.
HOOKS = tuple(sorted(name for name in vars(TrainerCallback) if name.startswith("on_")))


def hook_problems(callback: Any) -> list[str]:
    """Every ``on_*`` method of ``callback`` (an instance or a class) that is not a hook the loop
    calls (a misspelt hook would silently never run), each with the nearest hook name and the
    list of hooks."""
    cls = callback if isinstance(callback, type) else type(callback)
    problems = []
    for name in sorted(n for n in dir(callback) if n.startswith("on_") and n not in HOOKS):
        if not callable(getattr(callback, name, None)):
            continue
        near = difflib.get_close_matches(name, HOOKS, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        problems.append(
            f"callback {cls.__name__} defines {name}, which is not a hook{hint}; "
            f"the hooks are {', '.join(HOOKS)}"
        )
    return problems


class CallbackList:
    """Dispatches a hook to every callback in order. Registering a callback with an ``on_*``
    method that is not a hook is a :class:`~grimoire.errors.ConfigError` (:func:`hook_problems`,
    every callback's problems in one message)."""

    def __init__(self, callbacks: Sequence[TrainerCallback] = ()):
        problems = [p for cb in callbacks for p in hook_problems(cb)]
        if problems:
            raise ConfigError(problems)
        self.callbacks = list(callbacks)

    def add(self, callback: TrainerCallback) -> None:
        """Register one more callback, checked like those given at construction."""
        problems = hook_problems(callback)
        if problems:
            raise ConfigError(problems)
        self.callbacks.append(callback)

    def __call__(self, hook: str, trainer, *args: Any) -> None:
        if hook not in HOOKS:
            raise ValueError(f"no callback hook {hook!r}; the hooks are {', '.join(HOOKS)}")
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(trainer, *args)


class ProgressCallback(TrainerCallback):
    """One tqdm bar on the main process: step/total, loss, trained tokens/s, ETA, and the mean
    rollout reward of methods that generate.

    Off on the other processes. When ``stream`` (default: ``sys.stderr`` at train begin) is not
    a terminal (nohup, Slurm, CI logs) there is no bar, whose carriage returns are noise in a
    file: one plain line per logging step instead (``step 20/1000  loss 3.7057  lr ...``) and one
    per evaluation, flushed as they come. Loss and reward follow every step; tokens/s each
    logged window.
    """

    #: What a plain log line shows, in order: (metric key, label, format).
    PLAIN_KEYS = (
        ("loss", "loss", "{:.4f}"),
        ("rewards/mean", "reward", "{:.3f}"),
        ("lr", "lr", "{:.3g}"),
        ("grad_norm", "grad_norm", "{:.3g}"),
        ("tokens_per_sec", "tok/s", "{:.0f}"),
        ("elapsed", "elapsed", "{:.0f}s"),
    )

    #: The step metric shown as ``reward``: the rollout stage's mean over the step's completions.
    REWARD_KEY = "rewards/mean"

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream
        self.bar = None
        #: The stream plain log lines go to (not a terminal); None with a bar or on other ranks.
        self.plain: Any = None
        self.postfix: dict[str, str] = {}

    @staticmethod
    def is_terminal(stream: Any) -> bool:
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            return False

    def on_train_begin(self, trainer) -> None:
        import sys

        from tqdm.auto import tqdm

        stream = self.stream if self.stream is not None else sys.stderr
        others = [cb for cb in trainer.callbacks.callbacks if isinstance(cb, ProgressCallback)]
        self.plain = None
        if not trainer.accelerator.is_main_process or others[0] is not self:
            return  # a second ProgressCallback (passed in as well): one bar
        if not self.is_terminal(stream):
            self.plain = stream
            return
        self.postfix = {}
        self.bar = tqdm(
            total=trainer.max_steps,
            initial=trainer.global_step,
            desc="train",
            unit="step",
            file=stream,
            dynamic_ncols=True,
        )

    def on_step_end(self, trainer, step: int, loss: float, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.postfix["loss"] = f"{loss:.4f}"
        if self.REWARD_KEY in metrics:
            self.postfix["reward"] = f"{metrics[self.REWARD_KEY]:.3f}"
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def on_log(self, trainer, metrics: dict[str, float]) -> None:
        if self.plain is not None:
            shown = [
                f"{label} {fmt.format(metrics[key])}"
                for key, label, fmt in self.PLAIN_KEYS
                if isinstance(metrics.get(key), int | float)
            ]
            step = f"step {trainer.global_step}/{trainer.max_steps}"
            print("  ".join([step, *shown]), file=self.plain, flush=True)
        if self.bar is not None and "tokens_per_sec" in metrics:
            self.postfix["tok/s"] = f"{metrics['tokens_per_sec']:.0f}"
            self.bar.set_postfix(self.postfix, refresh=False)

    def on_evaluate(self, trainer, metrics: dict[str, float]) -> None:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))
        if self.bar is not None:
            self.bar.write(f"step {trainer.global_step}: {shown}", file=self.bar.fp)
        elif self.plain is not None:
            print(
                f"step {trainer.global_step}/{trainer.max_steps} eval: {shown}",
                file=self.plain,
                flush=True,
            )

    def on_train_end(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
