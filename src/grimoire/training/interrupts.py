"""How a run stopped by a signal ends: at a step boundary, with a checkpoint, and an exit code.

The signals in ``checkpoint_signals`` (default SIGTERM and SIGINT, i.e. Ctrl-C) stop every
process at the next step boundary that all agree on; a checkpoint is written and ONE message
names it and the resume command. A second Ctrl-C aborts at once (no checkpoint), through
:class:`KeyboardInterrupt`, which the ``grimoire`` command turns into one line.

Exit codes of the ``grimoire`` command (so ``&&`` chains and schedulers' requeue logic see
that training did not finish): 128 + the signal's number after a signal stop with a checkpoint
(130 for Ctrl-C, 143 for SIGTERM, 138 for SIGUSR1; 143 when the signal came to another
process), the shell's convention; 130 after a second Ctrl-C; 1 for any error, a diverged run
included.
"""

from __future__ import annotations

import logging
import signal

logger = logging.getLogger(__name__)

#: The exit code when the stopping signal was delivered to another process.
OTHER_PROCESS_EXIT = 128 + signal.SIGTERM


class SecondInterrupt(KeyboardInterrupt):
    """A second Ctrl-C while the run was already stopping: abort now, without a checkpoint."""


def on_signal(name: str, earlier: str | None, main: bool = True) -> None:
    """Called when ``name`` arrives (``earlier``: the signal that already asked for a stop, if
    any): a second SIGINT aborts now; the first says what will happen (on the ``main``
    process only: Ctrl-C reaches every process of a launch)."""
    if name == "SIGINT" and earlier is not None:
        raise SecondInterrupt
    if name == "SIGINT" and main:
        logger.warning(
            "Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again aborts now)"
        )


def exit_code(stopped_by: str | None) -> int:
    """The ``grimoire`` command's exit code after a run stopped by ``stopped_by`` (a signal
    name, or a description of a signal another process received); 0 when None."""
    if stopped_by is None:
        return 0
    number = getattr(signal, stopped_by, None) if stopped_by.startswith("SIG") else None
    return 128 + int(number) if number is not None else OTHER_PROCESS_EXIT


__all__ = ["OTHER_PROCESS_EXIT", "SecondInterrupt", "exit_code", "on_signal"]
