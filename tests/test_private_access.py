"""No module reads another's private names: privates stay inside their class or package.

Read from the AST of every module under ``src/pipesched``. An attribute ``x._name`` (not a
dunder) is the module's own when ``x`` is ``self`` or ``cls``, or when ``_name`` is defined (a
def, a class, an assignment, a ``self._name = ...``) by a module or class of the same package
directory. Any other read is of another package's private or of torch's: torch's only in the
torch shims (``runtime/compat/``) and, name by name, in the modules of :data:`TORCH_PRIVATES`.
``getattr(x, "_name")`` and ``import``/``from`` of a private name or module count as reads.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pipesched"
COMPAT = "runtime/compat"

# Documented public APIs despite their underscore: the caller's frame, a namedtuple's fields.
PUBLIC_UNDERSCORE = {"sys._getframe", "_fields"}

# The modules that use torch's private names in place, as torch's own modules do (see
# runtime/compat/internals.py, "Not routed here"), or a namedtuple's documented methods:
# module -> the names it may read, and why.
TORCH_PRIVATES: dict[str, tuple[set[str], str]] = {
    "schedule/simulate.py": ({"_make"}, "namedtuple API: an Event from its fields"),
    "partition/materialize.py": (
        {"_parameters", "_buffers", "_non_persistent_buffers_set", "_version"},
        "swaps a module's own tensors in place; a tensor's version tells it was written",
    ),
    "partition/split.py": (
        {"_parameters", "_buffers", "_BatchNorm"},
        "a stage holds its owners' tensor dicts; BatchNorm layers are deferred",
    ),
    "pipeline/checks/micro_batch_norm.py": ({"_BatchNorm"}, "finds every BatchNorm layer"),
    "pipeline/checks/buffer_updates.py": (
        {"_BatchNorm", "_version"},
        "leaves BatchNorms to their own warning; a buffer's version tells a forward wrote it",
    ),
    "partition/traced_stage.py": ({"_buffers"}, "a stage writes its owners' buffers back"),
    "partition/sequential.py": (
        {"_modules", "_BatchNorm"},
        "a Sequential's layers in order, repeats kept; a BatchNorm's statistics in one stage",
    ),
    "partition/trace.py": (
        {"_assert_tensor_metadata", "_assert_scalar"},
        "drops the ATen checks torch.export inserts",
    ),
    "runtime/placement.py": ({"_apply"}, "moves a layer's tensors as Module.to does"),
    "runtime/stage/recompute.py": (
        {"_buffers", "_version"},
        "restores a recomputed layer's own buffers; a buffer's version tells a forward wrote it",
    ),
    "runtime/stage/seeding.py": ({"_modules"}, "walks children without Module's dedup"),
    "runtime/stage/draw_free.py": ({"_modules"}, "walks a stage's modules per step, without dedup"),
    "runtime/stage/draw_keys.py": (
        {"_DropoutNd", "_cdata"},
        "names the layers that draw, tells generators apart",
    ),
    "runtime/stage/batchnorm.py": ({"_BatchNorm"}, "DeferredBatchNorm is a _BatchNorm"),
    "runtime/engine.py": ({"_BatchNorm"}, "a step puts back every BatchNorm's statistics"),
    "runtime/transaction.py": (
        {"_BatchNorm", "_signal"},
        "snapshots every BatchNorm; _signal skips signal.py's enum conversion under a held Ctrl-C",
    ),
    "pipeline/shadowing.py": (
        {"_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"},
        "registers a model's entries straight into Module's dicts, names it shadows included",
    ),
    "runtime/passes.py": (
        {"_version"},
        "a handed-over stage input's version tells it was written in place",
    ),
}

# issue 26: lead. Violations in the files the lead is rewriting: (module, expression) -> the
# public name proposed. Each entry fails the test once it no longer occurs: remove it then.
LEAD: dict[tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(), str(path))


def _package(module: str) -> str:
    return module.rpartition("/")[0]


def _scope_names(body: list[ast.stmt]) -> Iterator[str]:
    """The names a module's or a class's own statements bind."""
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield stmt.name
        elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name):
                        yield node.id
        elif isinstance(stmt, ast.If | ast.Try):  # TYPE_CHECKING, fallbacks
            yield from _scope_names(stmt.body + getattr(stmt, "orelse", []))


def _defines(tree: ast.Module) -> set[str]:
    """Every name the module defines: at its top, in its classes, on ``self``/``cls``."""
    names = set(_scope_names(tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names.update(_scope_names(node.body))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return names


MODULES = dict(_modules())
DEFINED: dict[str, set[str]] = defaultdict(set)  # package directory -> names
for _module, _tree in MODULES.items():
    DEFINED[_package(_module)] |= _defines(_tree)


def _reads(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, expression, private name) of each ``x._name``, ``getattr(x, "_name")`` and
    ``from m import _name``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            owner = node.args[0]
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                yield node.lineno, f"{ast.unparse(owner)}.{node.args[1].value}", node.args[1].value
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            yield node.lineno, ast.unparse(node), node.attr
        elif isinstance(node, ast.Import):
            for alias in node.names:
                hidden = [part for part in alias.name.split(".") if _private(part)]
                if hidden and not alias.name.startswith("pipesched."):
                    yield node.lineno, alias.name, hidden[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if _private(alias.name) and not node.module.startswith("pipesched."):
                    yield node.lineno, f"{node.module}.{alias.name}", alias.name


def _private_imports(tree: ast.Module, package: str) -> Iterator[tuple[int, str]]:
    """(line, path) of each ``from pipesched.x import _y`` (or of ``x._mod``) of another package."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        parts = node.module.split(".")
        if parts[0] != "pipesched":
            continue
        here = "/".join(parts[1:])
        source = here if (SRC / here / "__init__.py").exists() else here.rpartition("/")[0]
        for alias in node.names:
            if source != package and any(map(_private, [*parts, alias.name])):
                yield node.lineno, f"{node.module}.{alias.name}"


def _violations(modules: dict[str, ast.Module] = MODULES) -> list[tuple[str, int, str, str]]:
    """(module, line, expression, why) of every read outside its owner."""
    found = []
    for module, tree in modules.items():
        package = _package(module)
        for line, expression, name in _reads(tree):
            if {expression, name} & PUBLIC_UNDERSCORE or name in DEFINED[package]:
                continue
            if package == COMPAT or name in TORCH_PRIVATES.get(module, (set(), ""))[0]:
                continue
            found.append((module, line, expression, "read outside its class or package"))
        for line, path in _private_imports(tree, package):
            found.append((module, line, path, "another package's private"))
    return found


def test_no_module_reads_another_owners_private():
    found = [v for v in _violations() if (v[0], v[2]) not in LEAD]
    assert not found, "\n".join(f"{m}:{line}: {e} ({why})" for m, line, e, why in found)


def test_the_lead_list_holds_only_what_still_occurs():
    """An entry of :data:`LEAD` that no longer occurs is removed (the list only shrinks)."""
    occurring = {(m, e) for m, _, e, _ in _violations()}
    assert set(LEAD) <= occurring, sorted(set(LEAD) - occurring)


def test_torch_private_allow_list_is_exact():
    """Every module of :data:`TORCH_PRIVATES` still reads each name it lists, and is no shim."""
    for module, (names, why) in TORCH_PRIVATES.items():
        assert module in MODULES and why, module
        assert not module.startswith(COMPAT), module
        read = {name for _, _, name in _reads(MODULES[module])}
        assert names <= read, (module, sorted(names - read))


def test_the_rule_bites():
    """Reads planted in a copy of the modules are reported; the same reads at home are not."""
    planted = {
        # another package's private: the Schedule's cache, read by the runtime
        "runtime/mailbox.py": (
            "from pipesched.viz import _draw\ndef f(schedule):\n    return schedule._cache\n"
        ),
        # a torch private outside the shims
        "viz/gantt.py": (
            "import torch.utils._pytree\n"
            'def f(t):\n    return t._base, torch._C, getattr(t, "_cdata")\n'
        ),
        # at home: the schedule package reads its own class's private
        "schedule/text.py": (
            "from pipesched.schedule.schedule import _x\n"
            "def f(schedule):\n    return schedule._cache\n"
        ),
    }
    modules = MODULES | {m: ast.parse(code) for m, code in planted.items()}
    found = {(m, e) for m, _, e, _ in _violations(modules) if m in planted}
    assert found == {
        ("runtime/mailbox.py", "schedule._cache"),
        ("runtime/mailbox.py", "pipesched.viz._draw"),
        ("viz/gantt.py", "t._base"),
        ("viz/gantt.py", "torch._C"),
        ("viz/gantt.py", "t._cdata"),
        ("viz/gantt.py", "torch.utils._pytree"),
    }


# -- train/ reaches the Pipeline through public names only -----------------------------------


def _public(path: str) -> set[str] | None:
    """The names a public module path offers (its ``__all__``); None if it is not public."""
    parts = path.split(".")
    if parts[0] != "pipesched" or len(parts) > 2:
        return None
    file = SRC / "__init__.py" if len(parts) == 1 else SRC / parts[1] / "__init__.py"
    if len(parts) == 2 and not file.exists():
        file = SRC / f"{parts[1]}.py"  # pipesched.errors
    if not file.exists():
        return None
    for stmt in ast.parse(file.read_text()).body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets
        ):
            return set(ast.literal_eval(stmt.value))
    return None


def _train_imports(modules: dict[str, ast.Module]) -> list[str]:
    """Each import in train/ of a pipesched path or name that is not public."""
    found = []
    for module, tree in modules.items():
        if not module.startswith("train/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                path, names = node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                path, names = "", [a.name for a in node.names]
            else:
                continue
            for name in names:
                full = f"{path}.{name}" if path else name
                if not full.startswith("pipesched") or full.startswith("pipesched.train"):
                    continue
                offered = _public(path) if path else None
                if offered is None or name not in offered:
                    found.append(f"{module}:{node.lineno}: {full}")
    return found


def _train_reads(modules: dict[str, ast.Module]) -> list[str]:
    """Each ``x._name`` in train/ (x not self/cls) for a name not train/'s alone."""
    elsewhere = set().union(*(names for pkg, names in DEFINED.items() if pkg != "train"))
    return [
        f"{module}:{line}: {expression}"
        for module, tree in modules.items()
        if module.startswith("train/")
        for line, expression, name in _reads(tree)
        if name not in DEFINED["train"] or name in elsewhere
    ]


def test_train_imports_only_public_names():
    found = _train_imports(MODULES)
    assert not found, "train/ imports what is not public:\n" + "\n".join(found)


def test_train_reads_no_private_of_another_owner():
    found = _train_reads(MODULES)
    assert not found, "\n".join(found)


def test_the_train_rules_bite():
    """A planted module of train/ that reaches past the public names is reported, line by line."""
    planted = {
        "train/planted.py": (
            "from pipesched.pipeline.facade import Pipeline\n"
            "from pipesched.runtime import deferred_interrupts, Engine\n"
            "from pipesched import Pipeline, _LAZY\n"
            "import pipesched.runtime.transaction\n"
            "def f(acc):\n    return acc.pipe._built().tied, acc._items\n"
        )
    }
    modules = {m: ast.parse(code) for m, code in planted.items()}
    assert _train_imports(modules) == [
        "train/planted.py:1: pipesched.pipeline.facade.Pipeline",
        "train/planted.py:2: pipesched.runtime.Engine",
        "train/planted.py:3: pipesched._LAZY",
        "train/planted.py:4: pipesched.runtime.transaction",
    ]
    # acc._items is the accumulator's own (train/ defines it); pipe._built is the Pipeline's
    assert _train_reads(modules) == [
        "train/planted.py:3: pipesched._LAZY",
        "train/planted.py:6: acc.pipe._built",
    ]
