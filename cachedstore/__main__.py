"""``python -m cachedstore``: the same as the ``cachedstore`` command."""

import sys

from cachedstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
