"""The C++ kernel's twin of :class:`~pipesched.runtime.stage.draw_keys.DrawContext`: its table.

The C++ kernel (``compat/rng_kernel.cpp``) keys a CPU draw without calling Python,
by ``Keys``: the same walk up the call stack as :meth:`DrawContext.seed_for`, over the
thread's own frames, with the same counts and mix. This module gives it a stage's
names as it reads them (:func:`native_table`), once its walk has passed a probe
against the Python one (:func:`_walks_agree`): it reads CPython's frames as laid out
in the Python it was built for.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from pipesched.runtime.compat.random_routing import walking_native
from pipesched.runtime.stage.draw_keys import (
    _CHECKPOINT,
    DrawContext,
    StepSeed,
    _hash,
    module_names,
)

__all__ = ["NativeNames", "native_table"]


@dataclass(frozen=True)
class NativeNames:
    """A stage's names (:func:`module_names`) as the C++ kernel's ``Keys`` read them.

    Attributes:
        module: the C++ kernel's module (``compat.random_routing.native_module``).
        names: its ``Names``: each module's name as an index, the names' hashes.
    """

    module: Any
    names: Any


def native_table(names: dict[int, str]) -> NativeNames | None:
    """``names`` for the C++ kernel, which then keys draws without Python (see
    :class:`DrawContext`); None where it does not route, or where its walk of the call
    stack does not find what :meth:`DrawContext.seed_for` finds (its probe, once per
    process: it reads CPython's frames as laid out in the Python it was built for)."""
    native = walking_native(_walks_agree)
    return None if native is None else _table(native, names)


def _table(native: Any, names: dict[int, str]) -> NativeNames:
    strings: dict[str, int] = {}  # every name counted apart -> its index
    pairs = [(ident, strings.setdefault(name, len(strings))) for ident, name in names.items()]
    nameless = strings.setdefault("", len(strings))
    user = {  # each name's draws from a user's generator are counted apart
        i: strings.setdefault(f"{name}#generator", len(strings))
        for name, i in list(strings.items())
    }
    return NativeNames(
        native,
        native.Names(
            pairs,
            [_hash(name) for name in strings],
            [user.get(i, i) for i in range(len(strings))],
            nameless,
            _CHECKPOINT,
        ),
    )


def _walks_agree(native: Any) -> bool:
    """The C++ walk and :meth:`DrawContext.seed_for` key alike from a stack with what the
    walk must tell apart: a module's method called directly, a ``self`` a closure holds,
    a function, a checkpoint, a module outside the names, the pass's entry frame."""
    model = _Outer()
    root = nn.Sequential(model)  # (a model's root is not named: its children are)
    names = module_names(root)
    table = _table(native, names)
    entry = sys._getframe()
    onlys = [None, frozenset(), frozenset({id(model)}), frozenset({id(model.inner)})]
    answers: list[tuple[bool, bool, bool]] = []  # (alike, checkpointed, seeded)

    def look(frame: FrameType) -> None:
        for only in onlys:
            for user in (None, StepSeed(11)):
                contexts = [
                    DrawContext(names, StepSeed(5), 2, "p", entry, t) for t in (None, table)
                ]
                for context in contexts:
                    context.only, context.learns = only, False
                got = [[c.seed_for(frame, user), c.seed_for(frame, user)] for c in contexts]
                in_python, in_cpp = (c.checkpointed for c in contexts)
                alike = got[0] == got[1] and in_python == in_cpp
                answers.append((alike, in_python, got[0][0] is not None))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(look)
    return (
        len(answers) == 4 * 8
        and all(alike for alike, _, _ in answers)
        and any(checkpointed for _, checkpointed, _ in answers)
        and sum(seeded for _, _, seeded in answers) > len(answers) // 2
    )


class _Inner(nn.Module):
    def helper(self, look: Callable[[FrameType], None]) -> None:  # called directly
        _plain(look)


def _plain(look: Callable[[FrameType], None]) -> None:  # a function, not a method
    look(sys._getframe())


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, look: Callable[[FrameType], None]) -> None:
        def closure() -> None:  # holds self in a cell
            self.inner.helper(look)

        look(sys._getframe())
        closure()
        _Free()(look)  # a module outside the names
        torch.utils.checkpoint.checkpoint(closure, use_reentrant=False)


class _Free(nn.Module):
    def forward(self, look: Callable[[FrameType], None]) -> None:
        look(sys._getframe())
