"""The schedule layer imports no torch (../shared/DESIGN.md: the one rule between layers)."""

from __future__ import annotations

import subprocess
import sys


def test_schedule_layer_imports_no_torch():
    code = (
        "import sys, pipesched.schedule, pipesched.cli; "
        "from pipesched.schedule import get_schedule; "
        "get_schedule('zb-v', 4, 4).simulate(); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
