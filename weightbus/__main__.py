"""``python -m weightbus``: the ``weightbus`` command, where the package is importable but not
installed (a checkout on a machine without the console script)."""

import sys

from weightbus.cli import main

sys.exit(main())
