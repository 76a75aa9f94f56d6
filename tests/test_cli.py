"""The pipesched command line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pipesched.cli import main


def test_simulate_prints_every_schedule(capsys):
    assert main(["simulate", "--stages", "4", "--chunks", "8"]) == 0
    out = capsys.readouterr().out
    for name, bubble in [
        ("gpipe", "27.3%"),
        ("1f1b", "27.3%"),
        ("interleaved-1f1b", "15.8%"),
        ("zb-h1", "11.1%"),
    ]:
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert bubble in line
    assert "4 3 2 1" in out  # 1F1B's peak activations per stage


def test_simulate_with_costs(capsys):
    assert main(["simulate", "--stages", "2", "--chunks", "4", "--costs", "1,2,1,0.5"]) == 0
    out = capsys.readouterr().out
    assert "F=1.0 B=2.0 W=1.0 send=0.5" in out


def test_show(capsys):
    assert main(["show", "--schedule", "1f1b", "--stages", "2", "--chunks", "3", "--order"]) == 0
    out = capsys.readouterr().out
    assert "worker 1:  . F0 B0 -- F1 B1 -- F2 B2 --  .  ." in out
    assert "worker 0: 0F0 0F1 0B0 0F2 0B1 0B2" in out


def test_errors_exit_2(capsys):
    assert main(["show", "--schedule", "nope", "--stages", "2", "--chunks", "3"]) == 2
    assert "unknown schedule 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--stages", "2", "--chunks", "3", "--costs", "1,2"])
    assert info.value.code == 2
    assert "F,B,W" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = shutil.which("pipesched") or str(
        __import__("pathlib").Path(sys.executable).parent / "pipesched"
    )
    result = subprocess.run(
        [exe, "simulate", "--stages", "2", "--chunks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "zb-v" in result.stdout
