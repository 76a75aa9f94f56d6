"""``python -m pipesched.cli``: the ``pipesched`` command, for an environment without its script."""

from __future__ import annotations

import sys

from pipesched.cli.main import main

sys.exit(main())
