"""``python -m usp ...`` runs the ``usp`` command line."""

import sys

from usp.cli import main

if __name__ == "__main__":
    sys.exit(main())
