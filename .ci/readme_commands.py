"""Print the README's two set-up commands, one per line, so that CI runs exactly what it says.

They are the first two command lines (not blank, not comments) of the first code block under
"## Set-up": the same rule as the shared readme-fresh check. Fails if there are not two.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def readme_commands(readme: Path) -> list[str]:
    text = readme.read_text(encoding="utf-8")
    start = text.find("## Set-up")
    if start < 0:
        raise SystemExit(f"{readme}: no '## Set-up' section")
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", text[start:], re.S)
    lines = [
        line.strip()
        for line in (block.group(1) if block else "").splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    if len(lines) < 2:
        raise SystemExit(f"{readme}: the Set-up code block has {len(lines)} command(s), not 2")
    return lines[:2]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "README.md"
    print("\n".join(readme_commands(path)))
