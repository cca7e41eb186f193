"""Progress of the phases before the first step: reading and tokenizing the data, loading the
model, setting up the trainer, the reference log-prob pass.

On a real model these take minutes, before the progress bar (or the plain step lines off a
terminal) says anything. Each phase reports a line when it starts and one with its duration
when it ends; a long pass over rows (:meth:`Phase.advance`) adds ``n/N rows`` lines off a
terminal (every tenth of the pass, and at least every :data:`EVERY_S` seconds), or a tqdm bar
on one.

Where the lines go: ``grimoire train`` turns them on for the command (:func:`reporting`, the
stream its step lines use: stderr); elsewhere (the Python API) they are log records at
``INFO`` on this module's logger, as quiet as any library's by default. Only the main process
(``RANK`` 0 or unset) prints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: Off a terminal, the longest a pass over rows goes without an ``n/N rows`` line (when a batch
#: ends after it): a redirected log shows the run is alive.
EVERY_S = 30.0

#: Where phase lines are printed while :func:`reporting` is on; None: log records instead.
_stream: Any = None


def _main_process() -> bool:
    # The launcher's rank, read from the environment: asking accelerate would create its
    # process state, which the run builds itself with its own settings.
    return int(os.environ.get("RANK", "0")) == 0


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def say(text: str) -> None:
    """One phase line: printed (and flushed, so a redirected log has it now) while
    :func:`reporting` is on, else an INFO log record."""
    if _stream is None:
        logger.info(text)
    elif _main_process():
        print(text, file=_stream, flush=True)


@contextlib.contextmanager
def reporting(on: bool = True, stream: Any = None) -> Iterator[None]:
    """Print phase lines to ``stream`` (default: ``sys.stderr``, read now) inside the block,
    when ``on``; put back as it was after."""
    global _stream
    saved = _stream
    if on:
        _stream = stream if stream is not None else sys.stderr
    try:
        yield
    finally:
        _stream = saved


class Phase:
    """A running phase: :meth:`advance` counts rows (or another ``unit``) done of ``total``."""

    def __init__(self, name: str, total: int | None = None, unit: str = "rows") -> None:
        self.name, self.total, self.unit = name, total, unit
        self.done = 0
        self.started = self._said = time.monotonic()
        self._tenth = 0
        self._bar: Any = None
        if total and _stream is not None and is_terminal(_stream) and _main_process():
            from tqdm.auto import tqdm  # a bar only where one can redraw in place

            self._bar = tqdm(total=total, desc=name, unit=f" {unit}", file=_stream, leave=False)

    def advance(self, n: int) -> None:
        """``n`` more done; off a terminal, a line at each new tenth of ``total`` or after
        :data:`EVERY_S` seconds without one (never for the last: the end line says it)."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if not self.total or self.done >= self.total:
            return
        tenth, now = 10 * self.done // self.total, time.monotonic()
        if tenth > self._tenth or now - self._said >= EVERY_S:
            self._tenth, self._said = tenth, now
            say(f"{self.name}: {self.done}/{self.total} {self.unit} ({now - self.started:.0f}s)")

    def close(self) -> float:
        if self._bar is not None:
            self._bar.close()
        return time.monotonic() - self.started


@contextlib.contextmanager
def phase(name: str, total: int | None = None, unit: str = "rows") -> Iterator[Phase]:
    """``name ...`` now, ``name: done in 12.3s`` when the block ends (not when it raises: the
    error says what happened)."""
    say(f"{name} ...")
    running = Phase(name, total, unit)
    try:
        yield running
    except BaseException:
        running.close()
        raise
    seconds = running.close()
    count = f" ({running.done} {running.unit})" if total else ""
    say(f"{name}: done in {seconds:.1f}s{count}")


__all__ = ["EVERY_S", "Phase", "is_terminal", "phase", "reporting", "say"]
