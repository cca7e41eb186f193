"""What the ``grimoire`` command prints besides its own output: other libraries' progress bars,
log messages and warnings, and Grimoire's own warnings.

On a normal run (no ``--log-level``, or ``WARNING``/``ERROR``) the libraries Grimoire drives are
quiet: no transformers "Loading weights" / "Writing model shards" bars, no datasets bars, no
library log lines below ERROR, no Python warnings raised by them. ``--log-level INFO`` or
``DEBUG`` leaves all of that as the libraries print it. Either way Grimoire's own warnings
(:class:`~grimoire.errors.GrimoireWarning`, deprecations included) are printed as one line each,
once, without Python's ``file:line`` and source-line echo; Grimoire's progress bar and summary
are its own output and stay.

Only the command line does this, for the duration of one command (everything is put back
after, so ``main([...])`` called from Python leaves no trace); the Python API prints what the
libraries print, as any library user expects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from huggingface_hub import utils as hub_utils

from grimoire.errors import GrimoireDeprecationWarning, GrimoireWarning

#: Read when transformers / datasets are imported (during the command): their log level.
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
#: Loggers of the libraries a run drives, kept to ERROR on a normal run.
LIBRARY_LOGGERS = ("transformers", "datasets", "huggingface_hub", "accelerate", "peft", "torch")


def is_verbose(level: str | None) -> bool:
    """``--log-level INFO`` or ``DEBUG``: the libraries print as they would on their own."""
    return level in ("INFO", "DEBUG")


@contextlib.contextmanager
def command_output(
    level: str | None, stream: Any = None, uses_datasets: bool = False
) -> Iterator[None]:
    """Quiet the libraries unless ``level`` is verbose; Grimoire's warnings go to ``stream``
    (default ``sys.stderr``) as ``grimoire: <message>``, each once.

    ``uses_datasets``: the command reads datasets (``train``), so their bars are switched off too.
    """
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        if not is_verbose(level):
            stack.enter_context(_quiet_libraries(uses_datasets))
            if not sys.warnoptions:  # an explicit -W / PYTHONWARNINGS is the user's choice
                warnings.simplefilter("ignore")
        # Inserted last, so checked first: ours are always shown (once each, by _show below).
        warnings.filterwarnings("always", category=GrimoireWarning)
        warnings.showwarning = _OwnWarnings(warnings.showwarning, stream)
        yield


class _OwnWarnings:
    """``warnings.showwarning`` for one command: Grimoire's warnings as one line each, once;
    the others (shown only on a verbose run) through the previous ``showwarning``."""

    def __init__(self, previous: Any, stream: Any) -> None:
        self.previous = previous
        self.stream = stream
        self.seen: set[str] = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, GrimoireWarning):
            self.previous(message, category, filename, lineno, file, line)
            return
        text = str(message)
        if text in self.seen:  # e.g. a deprecated key met by validation and again by the run
            return
        self.seen.add(text)
        kind = "" if issubclass(category, GrimoireDeprecationWarning) else "warning: "
        print(f"grimoire: {kind}{text}", file=self.stream or sys.stderr)


@contextlib.contextmanager
def _quiet_libraries(uses_datasets: bool) -> Iterator[None]:
    """Library log levels to ERROR and their progress bars off; all put back on exit.

    Progress bars: huggingface_hub's switch is programmatic (transformers reads it when it is
    imported, and follows it through ``disable_progress_bar``); transformers and datasets are
    switched directly when already imported; datasets is imported now when the command uses it
    (its switch would otherwise come from the environment at import, where it cannot be undone).
    """
    saved_env = {k: os.environ.get(k) for k in QUIET_ENV}
    saved_levels = {n: logging.getLogger(n).level for n in LIBRARY_LOGGERS}
    hub_bars = not hub_utils.are_progress_bars_disabled()
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)  # an explicit environment wins
    for name in LIBRARY_LOGGERS:
        if saved_env.get(f"{name.upper()}_VERBOSITY") is None:  # e.g. TRANSFORMERS_VERBOSITY
            logging.getLogger(name).setLevel(logging.ERROR)
    datasets_bars = False
    if uses_datasets or "datasets" in sys.modules:
        from datasets import utils as datasets_utils

        datasets_bars = not datasets_utils.are_progress_bars_disabled()
    _set_bars(False, hub_bars, datasets_bars)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
        _set_bars(True, hub_bars, datasets_bars)


def _set_bars(on: bool, hub: bool, datasets: bool) -> None:
    """Turn the libraries' progress bars on or off; only those that were on (``hub`` /
    ``datasets``) are touched, so a bar the user switched off stays off."""
    if hub:
        (hub_utils.enable_progress_bars if on else hub_utils.disable_progress_bars)()
        hf_logging = sys.modules.get("transformers.utils.logging")
        if hf_logging is not None:  # imported before (its own flag) or during the command
            (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    if datasets:
        from datasets import utils as datasets_utils

        (datasets_utils.enable_progress_bars if on else datasets_utils.disable_progress_bars)()


__all__ = ["LIBRARY_LOGGERS", "QUIET_ENV", "command_output", "is_verbose"]
