"""``python -m grimoire.train``: the documented entry point, kept where users type it.

The command line lives in :mod:`grimoire.cli`; this module only hands its public names on.
"""

import sys

from grimoire.cli.main import main, summarize
from grimoire.cli.run import build_run

__all__ = ["build_run", "main", "summarize"]

if __name__ == "__main__":
    sys.exit(main())
