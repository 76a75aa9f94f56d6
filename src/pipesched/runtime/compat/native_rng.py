"""The C++ kernel for random operations (``rng_kernel.cpp``): built once per torch, then loaded.

Why built on first use: it is one small file against torch's headers, so it is
compiled where it runs, with the torch that runs it (``torch.utils.cpp_extension``,
as DeepSpeed builds its ops), instead of shipping a wheel per torch and platform.
The library is kept under ``$PIPESCHED_CACHE`` (default ``~/.cache/pipesched``),
keyed by the source, torch and Python, and later processes only load it. Each
build happens in a directory of its own and is moved into place whole, so
processes building at once never wait on one another's lock. Where it cannot be
built (no C++ compiler or ninja) or ``PIPESCHED_NATIVE_RNG=0``, random operations
take the Python kernel: the same numbers, slower (docs/guide.md, "Randomness").
``python -m pipesched.runtime.compat.native_rng`` builds it ahead of time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["SOURCE", "library_path", "load"]

SOURCE = Path(__file__).with_name("rng_kernel.cpp")
_NAME = "pipesched_rng"
_loaded: dict[str, ModuleType | None] = {}


def library_path() -> Path:
    """Where the built library is kept for this source, torch and Python."""
    key = hashlib.blake2b(digest_size=8)
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode()):
        key.update(part)
    root = os.environ.get("PIPESCHED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pipesched"
    )
    return Path(root) / f"rng-{key.hexdigest()}" / f"{_NAME}.so"


def load() -> ModuleType | None:
    """The kernel's module, built first where it is not yet; None with
    ``PIPESCHED_NATIVE_RNG=0``. A failure is not retried in this process.

    Raises:
        Exception: whatever building or loading it raised (no compiler, a failed compile).
    """
    if "module" in _loaded:
        return _loaded["module"]
    if os.environ.get("PIPESCHED_NATIVE_RNG", "1") == "0":
        _loaded["module"] = None
        return None
    path = library_path()
    try:
        if not (3, 11) <= sys.version_info[:2] <= (3, 13):
            raise RuntimeError(  # (rng_kernel.cpp reads frames as those versions lay them out)
                f"it reads Python's frames as CPython 3.11 to 3.13 lay them out, not "
                f"{sys.implementation.name} {sys.version.split()[0]}"
            )
        module = _build(path) if not path.exists() else _import(path)
    except Exception:
        _loaded["module"] = None  # (an interrupt is not a failure: the next call builds)
        raise
    _loaded["module"] = module
    return module


def _build(path: Path) -> ModuleType:
    """Compiles the kernel in a fresh directory beside ``path``, moves it into place whole
    (whoever builds at once) and returns the module."""
    from torch.utils.cpp_extension import load as build

    path.parent.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="build-", dir=path.parent)
    # A ninja installed by pip into this environment is found even where the environment's
    # scripts directory is not on PATH (the interpreter run by its full path).
    path_was = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([path_was, os.path.dirname(sys.executable)])
    try:
        print(
            "pipesched: compiling its kernel for random operations, once per torch (about 30 s)",
            file=sys.stderr,
        )
        module = build(
            name=_NAME,
            sources=[str(SOURCE)],
            build_directory=work,
            extra_cflags=["-O2"],
            with_cuda=False,
            verbose=False,
        )
        os.replace(module.__file__, path)
        return module  # type: ignore[no-any-return]
    finally:
        os.environ["PATH"] = path_was
        shutil.rmtree(work, ignore_errors=True)


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":  # `make` builds it at install; a failure only means the Python kernel
    try:
        built = load() is not None
    except Exception as error:
        print(f"pipesched: its C++ kernel for random operations was not built: {error}")
    else:
        print(library_path() if built else "pipesched: PIPESCHED_NATIVE_RNG=0, nothing built")
