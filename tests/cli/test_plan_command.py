"""``pipesched plan``: a user's model profiled, every candidate printed, errors named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipesched.cli.main import main
from pipesched.cli.plan_command import memory_size

MODEL = """
import torch
from torch import nn

def make():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 256)), torch.randn(16, 8)

def keywords():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        def forward(self, x, scale):
            return self.b(torch.relu(self.a(x))) * scale
    return Net(), {"x": torch.randn(8, 8), "scale": torch.ones(8, 1)}

def wrong():
    return 3
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.py"
    path.write_text(MODEL)
    return path


def test_plan_prints_every_candidate_of_each_chunk_count_and_the_pick(model_file, capsys):
    code = main(
        [
            "plan",
            f"{model_file}:make",
            "--workers",
            "2",
            "--chunks",
            "2",
            "4",
            "--schedule",
            "1f1b",
            "zb-h1",
            "--checkpoint",
            "never",
            "always",
            "--no-synthesize",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [r for r in out.splitlines() if re.match(r"[ *]\s+(1f1b|zb-h1)\s+(never|always)\s", r)]
    # 2 schedules x 2 modes x 2 chunk counts, the pick marked once
    assert len(rows) == 8 and sum(r.lstrip().startswith("*") for r in rows) == 1
    assert "2/4 micro-batches" in out and "picked" in out and "schedule='auto'" in out


def test_plan_takes_keyword_batches_and_a_budget(model_file, capsys):
    code = main(
        [
            "plan",
            f"{model_file}:keywords",
            "--chunks",
            "2",
            "--workers",
            "1",
            "--memory-budget",
            "1GiB",
            "--no-synthesize",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "memory budget 1.00 GiB per worker" in out
    assert "memory_budget=1073741824)" in out  # to paste: exact, not 1.074e+09


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nocolon", "FILE.py:FUNCTION"),
        ("missing.py:make", "no such file"),
        ("{file}:absent", "has no function 'absent'"),
        ("{file}:wrong", r"must return \(model, batch\)"),
    ],
)
def test_plan_names_what_is_wrong_with_the_model_argument(model_file, capsys, target, message):
    assert main(["plan", target.format(file=model_file)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_refuses_more_chunks_than_rows(model_file, capsys):
    assert main(["plan", f"{model_file}:make", "--chunks", "32", "--no-synthesize"]) == 2
    assert "has only 16 rows" in capsys.readouterr().err


def test_memory_sizes_read_with_units_and_refuse_nonsense():
    assert memory_size("2GiB") == 2 * 2**30
    assert memory_size("512 MiB") == 512 * 2**20
    assert memory_size("1.5e9") == 1.5e9
    for bad in ("-1", "0", "2 parsecs", "lots"):
        with pytest.raises(Exception, match="positive size"):
            memory_size(bad)


@pytest.mark.parametrize(
    ("device", "message"), [("banana", "not a device torch knows"), ("cuda:99", "cuda:99")]
)
def test_plan_names_a_device_it_cannot_use(model_file, capsys, device, message):
    """Before, torch's RuntimeError (or AssertionError without CUDA) came back as a traceback."""
    assert main(["plan", f"{model_file}:make", "--device", device, "--no-synthesize"]) == 2
    err = capsys.readouterr().err
    assert "--device is" in err and message in err
