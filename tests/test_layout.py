"""The package's layout explains its architecture: few top-level entries, one meaning per name."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pipesched"
MAX_TOP_LEVEL = 10  # the facade, errors, the CLI and one package per layer


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def top_level(root: Path) -> set[str]:
    """The modules and packages at the top of ``root`` besides ``__init__.py``."""
    return {
        p.name
        for p in root.iterdir()
        if p.name != "__init__.py"
        and (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }


def shared_file_names(root: Path) -> list[str]:
    """Module file names that occur more than once under ``root``."""
    names = collections.Counter(p.name for p in _modules(root) if p.name != "__init__.py")
    return sorted(n for n, count in names.items() if count > 1)


def shared_class_names(root: Path) -> dict[str, list[str]]:
    """Public class names defined in more than one module under ``root``."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in _modules(root):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_at_most_ten_entries_at_the_top_besides_init_and_py_typed():
    entries = top_level(PACKAGE)
    assert len(entries) <= MAX_TOP_LEVEL, sorted(entries)


def test_no_two_modules_share_a_file_name():
    assert shared_file_names(PACKAGE) == []


def test_no_two_public_classes_share_a_name():
    assert shared_class_names(PACKAGE) == {}


def test_the_checks_find_a_clash(tmp_path: Path):
    for package in ("a", "b"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "plan.py").write_text("class Plan:\n    pass\n")
    (tmp_path / "tool.py").write_text("class _Private:\n    pass\n")
    assert top_level(tmp_path) == {"a", "b", "tool.py"}
    assert shared_file_names(tmp_path) == ["plan.py"]
    assert shared_class_names(tmp_path) == {"Plan": ["a/plan.py", "b/plan.py"]}
