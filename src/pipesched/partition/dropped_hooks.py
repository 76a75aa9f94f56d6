"""The backward hooks a trace drops (a module's, a tensor's registered in forward), told."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pipesched.errors import PipeschedWarning, warn_user
from pipesched.runtime.compat.internals import global_backward_hooks, module_backward_hooks

__all__ = ["backward_hooked", "distributed_hook", "recording_tensor_hooks", "warn_dropped_hooks"]

_told: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models told (once each)
_lock = threading.Lock()
_TORCH = os.path.dirname(torch.__file__) + os.sep


def distributed_hook(hook: Any) -> bool:
    """Whether ``hook`` is torch.distributed's (FSDP2's, which a mesh's sharding adds)."""
    function = getattr(hook, "func", hook)  # a functools.partial's function
    function = getattr(function, "__func__", function)  # a bound method's
    return str(getattr(function, "__module__", "")).startswith("torch.distributed")


def backward_hooked(model: nn.Module) -> list[str]:
    """The modules of ``model`` (by name; ``model`` by its type) with backward hooks
    (``register_full_backward_hook``, ``register_full_backward_pre_hook``), and
    ``"every module"`` under a global one: torch.export records none of them."""
    names = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if any(not distributed_hook(h) for h in module_backward_hooks(module))
    ]
    if global_backward_hooks():
        names.append("every module (register_module_full_backward_hook)")
    return names


@contextlib.contextmanager
def recording_tensor_hooks() -> Iterator[list[str]]:
    """Records where this thread's code calls ``Tensor.register_hook`` inside the block
    (the export runs the model's forward on fake tensors: the hook never reaches the
    stages): ``file:line`` of each call site, in the list it yields."""
    sites: list[str] = []
    with _lock:  # one wrapper however many threads trace at once, removed by the last
        if not _recording.by_thread:
            _recording.original = torch.Tensor.register_hook
            torch.Tensor.register_hook = _recorded  # type: ignore[method-assign]
        _recording.by_thread[threading.get_ident()] = sites
    try:
        yield sites
    finally:
        with _lock:
            del _recording.by_thread[threading.get_ident()]
            if not _recording.by_thread:
                torch.Tensor.register_hook = _recording.original  # type: ignore[method-assign]


class _Recording:
    """Where each tracing thread records; torch's own ``register_hook`` while wrapped."""

    def __init__(self) -> None:
        self.by_thread: dict[int, list[str]] = {}
        self.original: Any = None


_recording = _Recording()


def _recorded(tensor: torch.Tensor, hook: Any) -> Any:
    sites = _recording.by_thread.get(threading.get_ident())
    if sites is not None:
        frame = traceback.extract_stack(limit=2)[0]
        if not frame.filename.startswith(_TORCH):  # (torch's own, tracing the user's)
            sites.append(f"{frame.filename}:{frame.lineno}")
    return _recording.original(tensor, hook)


def warn_dropped_hooks(model: nn.Module, modules: list[str], sites: list[str]) -> None:
    """Warns (once per ``model``) that the traced model's backward hooks (on
    ``modules``; registered on tensors at ``sites``) do not run in its stages."""
    if not modules and not sites:
        return
    with _lock:
        if model in _told:
            return
        _told.add(model)
    what = []
    if modules:
        what.append(f"backward hooks on {', '.join(modules[:5])}")
    if sites:
        what.append(f"tensor hooks registered in forward ({', '.join(dict.fromkeys(sites))})")
    warn_user(
        f"{type(model).__name__} has {' and '.join(what)}, which torch.export does not "
        "record: they do not run in the pipeline's stages, so their changes to gradients "
        "are not made and what they log is not logged. Fix: hook the parameters instead "
        "(p.register_hook runs once per micro-batch), or give the model as an "
        "nn.Sequential, whose layers run as modules with their hooks",
        PipeschedWarning,
    )
