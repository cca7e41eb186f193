"""Run a real command the way a user does: a subprocess, in a folder of its own.

The subprocess imports the code under test (this checkout's ``src`` first on ``PYTHONPATH``,
whatever grimoire is installed), offline, and its output is shown when it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def grimoire_command() -> list[str]:
    """The ``grimoire`` console script installed with this Python (``python -m grimoire``, the
    same entry point, when the script is not installed)."""
    script = Path(sys.executable).with_name("grimoire")
    if script.is_file():
        return [str(script)]
    found = shutil.which("grimoire")
    return [found] if found else [sys.executable, "-m", "grimoire"]


def command_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def run(
    argv: Sequence[str], cwd: Path, timeout: float = 600, expect: int | None = 0, **env: str
) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``cwd``; with ``expect``, assert its exit status (output in the message)."""
    done = subprocess.run(
        list(argv),
        cwd=cwd,
        env=command_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect is not None and done.returncode != expect:
        raise AssertionError(
            f"`{' '.join(argv)}` in {cwd} exited {done.returncode} (expected {expect})\n"
            f"--- stdout (end)\n{done.stdout[-4000:]}\n--- stderr (end)\n{done.stderr[-6000:]}"
        )
    return done


def run_python(code: str, cwd: Path, timeout: float = 600, **env: str) -> str:
    """Write ``code`` to ``cwd/script.py``, run it with this Python, return its stdout."""
    script = cwd / "script.py"
    script.write_text(code, encoding="utf-8")
    return run([sys.executable, str(script)], cwd, timeout=timeout, **env).stdout


__all__ = ["ROOT", "command_env", "grimoire_command", "run", "run_python"]
