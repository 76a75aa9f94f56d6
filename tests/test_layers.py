"""The layering holds: the repository keeps its import contracts, and a wrong import breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def _contracts() -> dict[str, str]:
    """The contracts of pyproject.toml, id -> name."""
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {c["id"]: c["name"] for c in config["contracts"]}


def _lint_imports(config: Path, src: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the package under ``src``, with the contracts in ``config``."""
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"}  # one line per contract
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo", str(config)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _verdicts(output: str, names: dict[str, str]) -> dict[str, str]:
    """id -> "KEPT" or "BROKEN", read from the summary lines of ``lint-imports``."""
    verdicts = {}
    for line in output.splitlines():
        for cid, name in names.items():
            if line.startswith(f"{name} KEPT") or line.startswith(f"{name} BROKEN"):
                verdicts[cid] = line[len(name) :].split()[0]
    return verdicts


def test_every_intended_rule_has_a_contract():
    """One contract per rule of the design (its ids are what the tests below name)."""
    assert set(_contracts()) == {
        "layers",
        "runtime-layers",
        "stage-below-engine",
        "schedule-pure",
        "analysis-pure",
        "runtime-below-partition",
        "partition-below-planning",
        "planning-below-facade",
        "train-public",
        "viz-torch-free",
    }


def test_repository_keeps_its_contracts():
    result = _lint_imports(PYPROJECT, ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    names = _contracts()
    assert _verdicts(result.stdout, names) == dict.fromkeys(names, "KEPT")


# (file under src/pipesched, the wrong import, the contracts it must break). A forbidden
# contract counts indirect imports too: analysis and viz, reading the IR, reach what it reaches.
TORCH_FREE = {"schedule-pure", "analysis-pure", "viz-torch-free"}
WRONG_IMPORTS = [
    ("schedule/action.py", "import pipesched.runtime.engine", {"layers", *TORCH_FREE}),
    ("schedule/costs.py", "import torch", TORCH_FREE),
    (
        "runtime/mailbox.py",
        "from pipesched.partition.call import Call",
        {"layers", "runtime-below-partition"},
    ),
    ("runtime/stage/rng.py", "import pipesched.runtime.engine", {"stage-below-engine"}),
    ("train/window.py", "from pipesched.pipeline.facade import Pipeline", {"train-public"}),
    ("viz/gantt.py", "import pipesched.runtime.stage.tree", {"viz-torch-free"}),
    ("planning/search.py", "import pipesched.train", {"layers", "planning-below-facade"}),
    ("partition/cuts.py", "import pipesched.planning", {"layers", "partition-below-planning"}),
    (
        "runtime/compat/torch_floor.py",
        "import pipesched.runtime.stage.tree",
        {"runtime-layers", "stage-below-engine"},
    ),
]


@pytest.mark.parametrize(
    ("module", "line", "broken"), WRONG_IMPORTS, ids=[w[0] for w in WRONG_IMPORTS]
)
def test_a_wrong_import_breaks_its_contract(tmp_path, module, line, broken):
    """A copy of the package with one import added breaks exactly the contracts named."""
    shutil.copytree(ROOT / "src" / "pipesched", tmp_path / "src" / "pipesched")
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "pipesched" / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately wrong\n")

    result = _lint_imports(tmp_path / "pyproject.toml", tmp_path / "src")

    assert result.returncode != 0, result.stdout
    names = _contracts()
    verdicts = _verdicts(result.stdout, names)
    assert verdicts == {cid: "BROKEN" if cid in broken else "KEPT" for cid in names}
    importer = "pipesched." + module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout  # the report names the module that broke it
