"""What of the model must stay as the Pipeline was built on it: its modules, and a trace's Python.

The stages hold the model's modules (an ``nn.Sequential``'s layers, a traced
stage's called layers), so a module put in another's place after the build
(``model[4] = nn.Linear(...)``, a LoRA layer swapped in) would never run: refused.
A traced stage runs the Python the export saw: a hook registered later, a
``forward`` replaced, an attribute or config setting its code reads changed
(``self.temperature``, a flag) would not run either: told, once per change (an
attribute the forward never reads changes nothing). Parameters and buffers are
looked up by name at every call, so replacing those is fine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipesched.errors import ConfigError
from pipesched.partition.dropped_hooks import distributed_hook

__all__ = ["ModelPrint"]

_SCALARS = (bool, int, float, str, type(None))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@dataclass(frozen=True)
class ModelPrint:
    """The model's modules by name and, where a trace fixed them, their hooks, forward
    and plain attributes (:meth:`of`); :meth:`check` tells what changed since.

    Args:
        modules: ``(name, id)`` of every module under each of its names.
        traced: per module whose code a trace fixed, by name: its hooks, its own
            ``forward`` (None: its class's) and its public scalar attributes.
    """

    modules: tuple[tuple[str, int], ...]
    traced: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, model: nn.Module, live: set[int] | None) -> ModelPrint:
        """``model`` now; ``live``: ids of the modules whose own code runs at every call
        (a traced stage's called layers); None: all do (an ``nn.Sequential``)."""
        modules = tuple((name, id(m)) for name, m in model.named_modules(remove_duplicate=False))
        traced: tuple[tuple[str, Any], ...] = ()
        if live is not None:
            read: dict[int, dict[str, Any]] = {}  # a config many modules hold: read once
            traced = tuple(
                (name, _python(m, read)) for name, m in model.named_modules() if id(m) not in live
            )
        return cls(modules, traced)

    def check(self, now: ModelPrint, doing: str) -> None:
        """Raises ConfigError naming the first module put in, taken out or replaced."""
        if now.modules == self.modules:
            return
        before, after = dict(self.modules), dict(now.modules)
        for name in (*before, *after):
            if before.get(name) != after.get(name):
                what = (
                    "was added" if name not in before
                    else "was removed" if name not in after
                    else "was replaced by another module"
                )  # fmt: skip
                raise ConfigError(
                    f"{doing}: module {name or '(the model)'!r} {what}; the Pipeline holds the "
                    "modules it was built with: build a new Pipeline over the model now (its "
                    "parameters are the model's, so an optimizer over them still works), or "
                    "make the change before building it"
                )

    def python_change(self, now: ModelPrint) -> str | None:
        """What of a trace's Python changed from this print to ``now``, or None.

        Why a warning and not an error: an attribute the forward never reads (an
        epoch counter, a name) changes nothing, and which ones it reads no trace says.
        """
        if now.traced == self.traced:
            return None
        is_ = dict(now.traced)
        for name, (hooks, forward, scalars) in self.traced:
            new_hooks, new_forward, new_scalars = is_.get(name, (hooks, forward, scalars))
            where = repr(name or "(the model)")
            if new_hooks != hooks:
                return f"module {where}'s hooks changed"
            if new_forward is not forward:
                return f"module {where}'s forward was replaced"
            if new_scalars != scalars:
                flat, new_flat = _flat(scalars), _flat(new_scalars)
                gone = object()  # (an attribute added as None differs from none at all)
                key = next(
                    k for k in {**flat, **new_flat} if flat.get(k, gone) != new_flat.get(k, gone)
                )
                if key not in flat:
                    return f"attribute {key!r} = {new_flat[key]!r} was added to module {where}"
                if key not in new_flat:
                    return f"attribute {key!r} was removed from module {where}"
                return (
                    f"attribute {key!r} of module {where} changed from {flat[key]!r} "
                    f"to {new_flat[key]!r}"
                )
        return None


def _python(module: nn.Module, read: dict[int, dict[str, Any]]) -> tuple[Any, ...]:
    """What a trace fixed of ``module``'s own Python: hooks, a ``forward`` of its own,
    public scalar attributes (its mode apart: the pipeline follows ``train()``/``eval()``;
    the hooks of torch.distributed apart: sharding data parallel registers them itself)."""
    hooks = tuple(
        tuple(id(f) for f in getattr(module, h).values() if not distributed_hook(f)) for h in _HOOKS
    )
    scalars = {}
    for k, v in vars(module).items():
        if k.startswith("_") or k == "training":
            continue
        if type(v) in _SCALARS:
            scalars[k] = v
        elif not isinstance(v, nn.Module | torch.Tensor) and hasattr(v, "__dict__"):
            # an object the code reads settings from (a Hugging Face config)
            settings = read.get(id(v))
            if settings is None:
                settings = read[id(v)] = {
                    a: w
                    for a, w in vars(v).items()
                    if not a.startswith("_") and type(w) in _SCALARS
                }
            scalars[k] = settings
    return hooks, vars(module).get("forward"), scalars


def _flat(scalars: dict[str, Any]) -> dict[str, Any]:
    """``scalars`` with a settings object's entries as ``"config.name"``."""
    flat: dict[str, Any] = {}
    for k, v in scalars.items():
        if isinstance(v, dict):
            flat.update((f"{k}.{a}", w) for a, w in v.items())
        else:
            flat[k] = v
    return flat
