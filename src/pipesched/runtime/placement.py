"""Which stages a rank keeps, which parameters it shares with other ranks, and freeing the rest."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipesched.errors import ConfigError

__all__ = [
    "check_not_freed",
    "is_traced",
    "keep_own_stages",
    "record_replacement",
    "replaced_parameters",
    "replacement",
    "stage_holders",
    "stage_parameters",
]

_freed: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Modules whose tensors :func:`keep_own_stages` moved to meta from real memory."""

_replaced: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
"""``id`` of each Parameter :func:`keep_own_stages` replaced by a meta one: (it, its replacement).

By ``id``, not a WeakKeyDictionary: that compares keys with ``==``, elementwise for tensors.
"""
_generation = [0]  # how many times parameters were replaced


def replacement(p: torch.Tensor) -> torch.Tensor | None:
    """The Parameter that replaced ``p`` on this rank, or None.

    A meta one where ``p`` is another rank's; a shard where this rank's stages
    are sharded over their replicas (:func:`record_replacement`).
    """
    entry = _replaced.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def replaced_parameters() -> int:
    """How many parameters :func:`keep_own_stages` has replaced so far (see :func:`replacement`).

    Why: an optimizer built before a traced model's first call on a mesh
    holds the Parameter objects the model had; the first cut moves other
    ranks' layers to meta, which gives them new Parameter objects (a real
    tensor cannot become a meta one in place). Whoever holds the old ones
    (the accumulator's optimizers) swaps them for these, and lets go of
    their memory (:func:`replacement`). The count grows with each
    replacement, so that a holder need only look again when it changed.
    """
    return _generation[0]


def record_replacement(old: torch.Tensor, new: torch.Tensor) -> None:
    """Records that ``new`` replaced ``old`` (a sharded stage's parameter by its shard)."""
    _forget(id(old))
    _replaced[id(old)] = (weakref.ref(old, _forget_later(id(old))), new)
    _generation[0] += 1


def keep_own_stages(
    stages: Sequence[nn.Module], placement: Sequence[int], pp_rank: int, device: torch.device
) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """Moves this rank's stages to ``device`` and frees every other stage's tensors.

    Every rank builds the whole model (the usual torchrun script); each keeps
    only its stages. The layers of other stages move to the "meta" device,
    which holds no memory (a layer one of this rank's stages also uses stays).

    Returns:
        ``(own stage indices, tied)``, where ``tied`` maps ``id(parameter)`` of
        each of this rank's parameters that stages on other pp ranks use too,
        to the sorted pp ranks that use it (this one included).
    """
    users: dict[int, set[int]] = {}
    for s, stage in enumerate(stages):
        for p in stage_parameters(stage):
            users.setdefault(id(p), set()).add(placement[s])
    own = [s for s in range(len(stages)) if placement[s] == pp_rank]
    for s in own:
        stages[s].to(device)
    own_modules = {id(m) for s in own for m in _layers(stages[s], recurse=True)}
    own_params = {id(p) for s in own for p in stage_parameters(stages[s])}
    for s, stage in enumerate(stages):
        if s not in own:
            for layer in _layers(stage, recurse=False):
                if id(layer) not in own_modules:
                    recurse = not is_traced(stage)
                    modules = list(layer.modules() if recurse else [layer])
                    _freed.update(m for m in modules if any(not t.is_meta for t in _own_tensors(m)))
                    before = [
                        (m, n, p)
                        for m in modules
                        for n, p in m._parameters.items()
                        if p is not None
                    ]
                    # Module.to gives the layer new (meta) tensors: a Parameter object
                    # that an own stage shares stays where it is, with its data.
                    layer._apply(lambda t: t.to("meta"), recurse=recurse)  # type: ignore[no-untyped-call]
                    for m, n, old in before:
                        new = m._parameters.get(n)
                        if new is not None and new is not old and id(old) not in own_params:
                            record_replacement(old, new)
    tied = {
        id(p): tuple(sorted(users[id(p)]))
        for s in own
        for p in stage_parameters(stages[s])
        if len(users[id(p)]) > 1
    }
    return own, tied


def _forget(key: int) -> None:
    _replaced.pop(key, None)


def _forget_later(key: int) -> Callable[[object], None]:
    """A weakref callback: the entry goes with the parameter (its id may be reused)."""

    def forget(ref: object) -> None:
        entry = _replaced.get(key)
        if entry is not None and entry[0] is ref:
            del _replaced[key]

    return forget


def check_not_freed(module: nn.Module) -> None:
    """Refuses a model whose layers an earlier mesh Pipeline freed on this rank.

    Why: those layers' weights are gone from this process (other ranks hold
    them); a new Pipeline would see meta tensors and either fail in its first
    step or, taking them for a model built on meta, initialize them afresh:
    trained weights silently replaced.

    Raises:
        ConfigError: naming the freed layers and the fix.
    """
    names = [name or "(the model)" for name, m in module.named_modules() if m in _freed]
    if names:
        shown = ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")
        raise ConfigError(
            f"module: {len(names)} of {type(module).__name__}'s layers ({shown}) were freed on "
            "this rank by an earlier Pipeline(..., mesh=...), which keeps only its rank's "
            "stages and moves the others to the meta device: their weights are no longer in "
            "this process. Give each mesh Pipeline its own model: copy.deepcopy(model) before "
            "the first Pipeline takes it, or build the model again"
        )


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` holds directly."""
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def stage_parameters(stage: nn.Module) -> list[nn.Parameter]:
    """The Parameters a stage computes with: its own, or the model's for a traced stage."""
    return stage.used_parameters() if is_traced(stage) else list(stage.parameters())  # type: ignore[operator]


def stage_holders(stage: nn.Module) -> list[nn.Module]:
    """The modules that register a stage's parameters: itself, or a traced stage's owners."""
    return _layers(stage, recurse=False) if is_traced(stage) else [stage]


def is_traced(stage: nn.Module) -> bool:
    """Whether ``stage`` is a traced one: a graph computing with the model's parameters."""
    return hasattr(stage, "used_parameters")


def _layers(stage: nn.Module, *, recurse: bool) -> list[nn.Module]:
    """What moves with a stage: its layers, or a traced stage's owners of state (not recursed)."""
    if is_traced(stage):  # its own constants are small: they stay
        owners: tuple[nn.Module, ...] = stage.owners  # type: ignore[assignment]
        return list(owners)
    return list(stage.modules()) if recurse else list(stage.children())
