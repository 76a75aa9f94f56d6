"""The README's first snippet runs as printed, and prints nothing (issue 25: three warnings)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_first_snippet_runs_silently():
    pytest.importorskip("transformers")
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert snippet is not None, "README.md has no python snippet"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-c", snippet.group(1)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "" and done.stderr == "", (done.stdout + done.stderr)[-3000:]
