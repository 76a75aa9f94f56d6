"""The schedule IR and the analysis over it import no torch: the one rule between layers."""

from __future__ import annotations

import subprocess
import sys


def test_schedule_layer_imports_no_torch():
    code = (
        "import sys, pipesched.schedule, pipesched.analysis, pipesched.cli.main; "
        "from pipesched.schedule import get_schedule; "
        "get_schedule('zb-v', 4, 4).simulate(); "
        "from pipesched.analysis import lower_bound, synthesize; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
