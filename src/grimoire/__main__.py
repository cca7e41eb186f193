"""``python -m grimoire [train|validate] ...``: the same entry point as the ``grimoire`` script."""

import sys

from grimoire.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
