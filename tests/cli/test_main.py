"""The pipesched command line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pipesched.cli.main import main


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


def test_python_dash_m_runs_the_command_and_passes_its_exit_status_on():
    """Before, `python -m pipesched.cli` had no __main__ and ran nothing."""
    command = [sys.executable, "-m", "pipesched.cli", "simulate", "--stages", "2", "--chunks"]
    result = subprocess.run([*command, "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "zb-v" in result.stdout, result.stderr
    refused = subprocess.run([*command, "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr


# The drawing commands: viz, compare, trace.


def _png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def test_viz_draws_one_schedule(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "zb-v.png"
    argv = ["viz", "--schedule", "zb-v", "--stages", "2", "--chunks", "3", "--costs", "1,2,1"]
    assert main([*argv, "-o", str(out)]) == 0
    _png(out)
    assert f"wrote {out}" in capsys.readouterr().out


def test_compare_draws_every_schedule(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "all.svg"
    assert main(["compare", "--workers", "2", "--chunks", "2", "-o", str(out)]) == 0
    text = out.read_text()
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"):
        assert name in text


def test_trace_draws_a_saved_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    from pipesched.schedule import Costs, get_schedule

    plan = get_schedule("1f1b", 2, 3).simulate(Costs(0.0012, 0.0021, 0.0))
    saved = plan.save(tmp_path / "r.json")
    assert main(["trace", str(saved), "-o", str(tmp_path / "run.png"), "--plan", "1f1b"]) == 0
    _png(tmp_path / "run.png")
    assert main(["trace", str(saved), "-o", str(tmp_path / "run.trace.json")]) == 0
    events = __import__("json").loads((tmp_path / "run.trace.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 12


def test_drawing_errors_exit_2(tmp_path, capsys):
    assert main(["trace", str(tmp_path / "none.json"), "-o", str(tmp_path / "x.png")]) == 2
    assert "none.json" in capsys.readouterr().err
    argv = ["viz", "--schedule", "1f1b", "--stages", "2", "--chunks", "2"]
    assert main([*argv, "-o", str(tmp_path / "x.jpg")]) == 2
    assert "must end in .png or .svg" in capsys.readouterr().err
    from pipesched.schedule import get_schedule

    saved = get_schedule("1f1b", 2, 2).simulate().save(tmp_path / "r.json")
    assert main(["trace", str(saved), "-o", str(tmp_path / "x.png"), "--plan", "zb-v"]) == 2
    assert "name the schedule the run used" in capsys.readouterr().err
    assert not list(tmp_path.glob("x.*"))


def test_batch_says_when_the_accumulation_steps_are_not_whole(capsys):
    argv = [
        "batch",
        "--nodes",
        "30",
        "--gpus-per-node",
        "8",
        "--micro-batch",
        "10",
        "--target",
        "3072",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3072 / 2400 = 1.28 accumulation steps is not whole" in out
    assert "accumulation_steps=1: effective batch 2400" in out
    assert "accumulation_steps=2: effective batch 4800" in out


def test_batch_pp_must_divide_the_gpus(capsys):
    assert (
        main(["batch", "--gpus-per-node", "8", "--pp", "3", "--micro-batch", "4", "--target", "64"])
        == 2
    )
    assert "--pp 3 must divide the 8 GPUs" in capsys.readouterr().err


# --- Bounds on the command's numbers (issue 11, item 7) -------------------------------------
# Non-positive counts are argparse errors (exit 2, one line after the usage); sizes over
# MAX_ACTIONS get the limit message and exit 2 before anything is built. Before the checks,
# `simulate --stages 0` printed "n/a" rows and exited 0, and `--chunks 1000000` ran into a
# MemoryError; the address space is capped here so that such a regression cannot eat the machine.

import resource  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from pipesched.schedule import MAX_ACTIONS  # noqa: E402


@pytest.fixture
def bounded_memory():
    """Caps the address space at its size now plus 2 GiB for the test, then restores it."""
    status = Path("/proc/self/status")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if not status.exists():
        yield
        return
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmSize:"))
    cap = int(line.split()[1]) * 1024 + 2 * 2**30
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _usage_error(argv, capsys):
    """``main(argv)`` exits 2 through argparse, fast; returns its one error line."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert time.perf_counter() - start < 1.0
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "n/a" not in captured.out
    lines = captured.err.strip().splitlines()
    assert lines[0].startswith("usage: pipesched")
    assert lines[-1].startswith(f"pipesched {argv[0]}: error: argument ")
    return lines[-1]


def _refused(argv, capsys):
    """``main(argv)`` returns 2 fast with one error line and prints nothing; returns the line."""
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 1.0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipesched: error: ")
    return lines[0]


_SCHEDULE_COMMANDS = [
    ["simulate"],
    ["show", "--schedule", "1f1b"],
    ["viz", "--schedule", "zb-v", "-o", "x.png"],
    ["compare", "-o", "x.png"],
]


@pytest.mark.parametrize("command", _SCHEDULE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize(
    ("flag", "value"), [("--stages", "0"), ("--workers", "-2"), ("--chunks", "0")]
)
def test_non_positive_counts_are_usage_errors(command, flag, value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = "--chunks" if flag != "--chunks" else "--stages"
    argv = [*command, flag, value, other, "4"]
    line = _usage_error(argv, capsys)
    assert f"must be a positive integer, got {value}" in line
    assert "--chunks" in line if flag == "--chunks" else "--stages/--workers" in line
    assert not list(tmp_path.glob("x.*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--stages", "4", "--chunks", "1000000"],
        ["show", "--schedule", "zb-v", "--stages", "4", "--chunks", "1000000"],
        ["viz", "--schedule", "1f1b", "--stages", "4", "--chunks", "1000000", "-o", "x.png"],
        ["compare", "--stages", "4", "--chunks", "1000000", "-o", "x.png"],
    ],
    ids=lambda argv: argv[0],
)
def test_huge_counts_give_the_limit_not_a_memory_error(
    argv, capsys, bounded_memory, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    line = _refused(argv, capsys)
    assert "a schedule of 1000000 micro-batches x " in line
    assert f"exceeds pipesched's limit of {MAX_ACTIONS} actions" in line


def test_absurd_counts_give_the_limit(capsys, bounded_memory):
    line = _usage_error(["simulate", "--stages", "4", "--chunks", "9" * 5000], capsys)
    assert f"limit of {MAX_ACTIONS} actions" in line
    assert len(line) < 500


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--target", "0", "must be a positive integer, got 0"),
        ("--micro-batch", "-4", "must be a positive integer, got -4"),
        ("--nodes", "0", "must be a positive integer, got 0"),
        ("--pp", "0", "must be a positive integer, got 0"),
        ("--target", str(10**400), "at most 9007199254740992"),
        ("--lr", "nan", "must be a finite number > 0, got 'nan'"),
        ("--lr", "-0.1", "must be a finite number > 0, got '-0.1'"),
    ],
)
def test_batch_numbers_are_checked(flag, value, says, capsys):
    argv = ["batch", "--target", "64", "--micro-batch", "4", flag, value]
    line = _usage_error(argv, capsys)
    assert flag in line and says in line


@pytest.mark.parametrize("costs", ["1e308,1e308,1e308", "1e-300,1,1,1e300", "1,1,1,1e308"])
def test_costs_outside_the_drawable_range_are_usage_errors(costs, capsys):
    # Before: OverflowError tracebacks from the time grid (an infinite makespan or column count).
    line = _usage_error(
        ["show", "--schedule", "1f1b", "--stages", "2", "--chunks", "2", "--costs", costs], capsys
    )
    assert "--costs" in line and "between 1e-09 and 1e+09" in line
