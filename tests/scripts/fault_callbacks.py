"""Callbacks that inject real faults into a ``grimoire train`` run (named in its YAML).

- ``LimitFileSize``: after the checkpoint of ``after_step`` is saved, the process may write no
  file larger than ``max_bytes`` (``RLIMIT_FSIZE``; ``SIGXFSZ`` ignored so the write fails with
  EFBIG, as a full disk fails with ENOSPC).
- ``KillDuringSave``: the checkpoint of step ``step`` is SIGKILLed after its model and optimizer
  state are written, before it is renamed into place.
- ``StopAt``: a stop request after step ``step`` (its checkpoint is written first).
- ``NaNForward``: the final norm's output is NaN in the training forwards of chosen steps.
"""

from __future__ import annotations

import os
import resource
import signal
import time

from grimoire import TrainerCallback
from grimoire.training import checkpoint


class LimitFileSize(TrainerCallback):
    def __init__(self, after_step: int, max_bytes: int):
        self.after_step, self.max_bytes = after_step, max_bytes

    def on_save(self, trainer, path):
        if trainer.global_step >= self.after_step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_bytes, hard))


class KillDuringSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, loss, metrics):
        if step != self.step:
            return
        write_state = checkpoint.write_state

        def write_then_die(folder, state, extra=None):
            write_state(folder, state, extra)
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.write_state = write_then_die


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, loss, metrics):
        if step == self.step:
            trainer.request_stop()


class SlowSteps(TrainerCallback):
    """Each step ends ``seconds`` later, so a signal sent after the first logged step arrives
    mid-run."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, trainer, step, loss, metrics):
        time.sleep(self.seconds)


class NaNForward(TrainerCallback):
    """The model's final norm returns NaN in the training forwards of the 1-based ``steps``
    (as an overflowing activation does): the loss and every gradient of those steps are NaN."""

    def __init__(self, steps: list[int]):
        self.steps = set(steps)

    def on_train_begin(self, trainer):
        def poison(module, args, output):
            if module.training and trainer.global_step + 1 in self.steps:
                return output * float("nan")
            return None

        trainer.unwrapped_model.get_decoder().norm.register_forward_hook(poison)
