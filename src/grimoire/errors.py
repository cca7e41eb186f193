"""Error types that collect every problem found, so users fix their input in one pass."""

from __future__ import annotations

from collections.abc import Iterable


class GrimoireError(Exception):
    """Base class for errors raised by Grimoire before or during training."""


class _ProblemsError(GrimoireError, ValueError):
    """An error carrying a list of independent problems, printed one per line."""

    title = "problems"

    def __init__(self, problems: Iterable[str], title: str | None = None):
        self.problems = list(problems)
        head = title or self.title
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head} ({len(self.problems)}):\n{lines}")


class ConfigError(_ProblemsError):
    """Invalid configuration: unknown keys, wrong types, impossible values, contradictions."""

    title = "invalid configuration"


class DataError(_ProblemsError):
    """Invalid training data: missing fields, empty responses, over-long rows, bad token ids."""

    title = "invalid data"


class GrimoireWarning(UserWarning):
    """A warning from Grimoire itself (not from a library it uses).

    The ``grimoire`` command prints these on one line each, once, on a normal run; other
    libraries' warnings only with ``--log-level INFO`` or ``DEBUG``. Python code sees them as
    ordinary warnings.
    """


class GrimoireDeprecationWarning(GrimoireWarning, FutureWarning):
    """An earlier spelling that still works for this release (a ``FutureWarning``, so it is shown
    to Python users by default)."""


class GrimoireRuntimeWarning(GrimoireWarning, RuntimeWarning):
    """Grimoire fell back to a slower path at run time (e.g. the fused log-prob head)."""


def raise_if(problems: list[str], error: type[_ProblemsError], title: str | None = None) -> None:
    """Raise ``error`` listing ``problems`` when there are any."""
    if problems:
        raise error(problems, title=title)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean "x"?)' suffix for the closest known name, or '' when none is close."""
    import difflib

    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{match[0]}"?)' if match else ""
