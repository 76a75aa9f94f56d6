"""Checkpoint fit: everything a load would change is checked first, and undone if it fails.

Why not torch's own ``load_state_dict`` checks: they check one object at a time, so
a failing optimizer finds the parameters already overwritten. :func:`check_fits`
checks the whole checkpoint first, and :class:`LoadSnapshot` puts back what a load
wrote should applying still fail.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipesched.errors import CheckpointError
from pipesched.train.state import rng_state, set_rng_state

if TYPE_CHECKING:
    from pipesched.train.accumulator import GradientAccumulator

__all__ = ["LoadSnapshot", "check_fits", "describe", "refuse_sharded"]

KEYS = ("model", "optimizers", "schedulers", "loss_scale", "rng", "counters", "window")
WINDOW_KEYS = ("position", "items", "samples", "loss_sum", "scale", "grads")
# Per-parameter optimizer state shaped like its parameter (torch.optim's
# names); other tensors are compared with this optimizer's own state, if any.
PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
     "acc_delta", "sum", "ax", "prev", "step_size", "mu_product_buffer", "exp_inf"}
)  # fmt: skip
FIX = (
    "load it into an accumulator built like the one that saved it (the same model, as "
    "many optimizers and lr schedulers, a GradScaler or none), or load another checkpoint"
)


def refuse_sharded(pipe: nn.Module, call: str) -> None:
    """Raises CheckpointError where ``pipe``'s stages are sharded over its replicas (FSDP2).

    Why: a per-rank state dict holds this rank's tensors as they are; of sharded
    stages those are shards, which only the sharded checkpoint (a directory, any
    layout) gathers whole.
    """
    mesh = getattr(pipe, "mesh", None)
    if mesh is not None and mesh.shard_mesh is not None:
        raise CheckpointError(
            f"{call}: this pipeline's stages are sharded over their replicas "
            "(init_mesh(..., shard=dp)), and a per-rank state dict of them is not supported; "
            "nothing was read or written. Save with acc.save(directory) (the sharded "
            "checkpoint, the default on a mesh) and load with acc.load(directory)"
        )


def describe(source: str | None) -> str:
    """``checkpoint 'path'`` or ``the state dict``: how messages name what is loaded."""
    return "the state dict" if source is None else f"checkpoint {source!r}"


def check_fits(acc: GradientAccumulator, state: Any, source: str | None = None) -> None:
    """Raises if ``state`` does not fit ``acc``; changes nothing either way.

    Args:
        acc: the accumulator to load into.
        state: what :meth:`GradientAccumulator.state_dict` returned, or a file's contents.
        source: the file ``state`` was read from, named in the message.

    Raises:
        CheckpointError: listing every misfit found: model keys missing or
            unexpected, tensors of another shape or dtype, another number of
            optimizers, param groups, parameters per group or schedulers,
            optimizer state of another shape, a scaler on one side only,
            window gradients that do not fit, missing counters or window fields.
    """
    name = describe(source)
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{name} holds a {type(state).__name__}, not a GradientAccumulator checkpoint "
            f"(a dict of {', '.join(KEYS)}); load a file written by GradientAccumulator.save"
        )
    absent = [k for k in KEYS if k not in state]
    if absent:
        hint = (
            "; it looks like a model's state_dict: load it with pipe.load_state_dict"
            if state and all(isinstance(v, torch.Tensor) for v in state.values())
            else ""
        )
        raise CheckpointError(
            f"{name} lacks {', '.join(map(repr, absent))}: it is not a GradientAccumulator "
            f"checkpoint{hint}; load a file written by GradientAccumulator.save"
        )
    problems: list[str] = []
    names: dict[torch.Tensor, str] = {p: n for n, p in acc.pipe.named_parameters()}
    _check_model(acc, state["model"], problems)
    _check_optimizers(acc.optimizers, state["optimizers"], names, problems)
    _check_optimizer_kinds(acc.optimizers, state, problems)
    _check_schedulers(acc.schedulers, state["schedulers"], state.get("scheduler_types"), problems)
    _check_loss_scale(acc.loss_scale.scaler is not None, state["loss_scale"], problems)
    _check_rest(acc, state, problems)
    if problems:
        listed = "".join(f"\n  - {p}" for p in problems)
        raise CheckpointError(
            f"{name} does not fit this GradientAccumulator; nothing was loaded or changed:"
            f"{listed}\nfix: {FIX}"
        )


def _shape(t: torch.Tensor) -> str:
    return f"({', '.join(map(str, t.shape))})"


def _listed(keys: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(map(repr, keys[:limit]))
    return shown if len(keys) <= limit else f"{shown} and {len(keys) - limit} more"


def _check_model(acc: GradientAccumulator, saved: Any, problems: list[str]) -> None:
    if not isinstance(saved, Mapping):
        problems.append(f"'model' is a {type(saved).__name__}, not a state dict")
        return
    here = acc.pipe.state_dict()
    missing = [k for k in here if k not in saved]
    unexpected = [k for k in saved if k not in here]
    if missing:
        problems.append(f"model: missing from the checkpoint: {_listed(missing)}")
    if unexpected:
        problems.append(f"model: in the checkpoint but not in this model: {_listed(unexpected)}")
        if getattr(acc.pipe, "mesh", None) is not None:
            problems.append(
                "on a mesh a single-file checkpoint is one rank's own (its stages alone), and "
                "this rank holds other layers: a checkpoint of another layout (one process, "
                "another cut) loads only as a sharded one: save it with "
                "acc.save(directory, sharded=True) and load that directory on every rank"
            )
    for key, mine in here.items():
        theirs = saved.get(key)
        if not isinstance(mine, torch.Tensor) or key not in saved:
            continue
        if not isinstance(theirs, torch.Tensor):
            problems.append(f"model: {key!r} is a {type(theirs).__name__} in the checkpoint")
        elif theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            problems.append(
                f"model: {key!r} is {_shape(theirs)} {theirs.dtype} in the checkpoint, "
                f"{_shape(mine)} {mine.dtype} here"
            )


def _check_optimizers(
    optimizers: list[torch.optim.Optimizer],
    saved: Any,
    names: Mapping[torch.Tensor, str],
    problems: list[str],
) -> None:
    if not isinstance(saved, Sequence) or len(saved) != len(optimizers):
        count = len(saved) if isinstance(saved, Sequence) else type(saved).__name__
        problems.append(
            f"optimizers: {count} in the checkpoint, {len(optimizers)} here (one for the "
            "whole pipeline, or one per stage: build as many as the run that saved it)"
        )
        return
    n = len(optimizers)
    for i, (optimizer, theirs) in enumerate(zip(optimizers, saved, strict=True)):
        where = f"optimizer {i + 1} of {n}"
        if not isinstance(theirs, Mapping) or not ("state" in theirs and "param_groups" in theirs):
            problems.append(f"{where}: not an optimizer state dict")
            continue
        groups, mine = theirs["param_groups"], optimizer.param_groups
        if len(groups) != len(mine):
            problems.append(
                f"{where}: {len(groups)} param groups in the checkpoint, {len(mine)} here"
            )
            continue
        ids: dict[Any, torch.Tensor] = {}
        for g, (group, own) in enumerate(zip(groups, mine, strict=True)):
            params = group.get("params") if isinstance(group, Mapping) else None
            if not isinstance(params, Sequence):
                problems.append(f"{where}: param group {g} lists no parameters")
            elif len(params) != len(own["params"]):
                problems.append(
                    f"{where}: param group {g} has {len(params)} parameters in the "
                    f"checkpoint, {len(own['params'])} here"
                )
            else:
                ids.update(zip(params, own["params"], strict=True))
        if len(ids) == sum(len(own["params"]) for own in mine):  # every group fits
            _check_optimizer_state(where, theirs["state"], ids, optimizer, names, problems)


def optimizer_type(optimizer: Any) -> str:
    """An optimizer's (or scheduler's) class as a checkpoint records it:
    ``torch.optim.adam.Adam``."""
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def _check_optimizer_kinds(
    optimizers: list[torch.optim.Optimizer], state: Mapping[str, Any], problems: list[str]
) -> None:
    """Another optimizer class, or param groups lacking options this optimizer steps with.

    A checkpoint written before types were recorded has no ``optimizer_types``:
    its param groups are still checked.
    """
    saved = state["optimizers"]
    if not isinstance(saved, Sequence) or len(saved) != len(optimizers):
        return  # told already
    types = state.get("optimizer_types")
    n = len(optimizers)
    for i, (optimizer, theirs) in enumerate(zip(optimizers, saved, strict=True)):
        where = f"optimizer {i + 1} of {n}"
        mine = optimizer_type(optimizer)
        if isinstance(types, Sequence) and len(types) == n and types[i] != mine:
            problems.append(
                f"{where}: the checkpoint was saved from a {types[i]}, this one is a {mine} "
                "(its state and options would not fit: build the optimizer the run that "
                "saved it used)"
            )
            continue
        groups = theirs.get("param_groups") if isinstance(theirs, Mapping) else None
        if not isinstance(groups, Sequence) or len(groups) != len(optimizer.param_groups):
            continue  # told already
        for g, (group, own) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
            if not isinstance(group, Mapping):
                continue
            missing = sorted(set(own) - set(_as_loaded(optimizer, group)))
            if missing:
                problems.append(
                    f"{where} ({mine}): param group {g} in the checkpoint lacks "
                    f"{_listed(missing)}, which this optimizer steps with; it was saved from "
                    f"another kind of optimizer (its group has {_listed(sorted(group))}): "
                    "build the optimizer the run that saved it used"
                )


def _as_loaded(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> Mapping[str, Any]:
    """``group`` as ``optimizer.load_state_dict`` leaves it (its class fills options it knows)."""
    probe = object.__new__(type(optimizer))
    loaded = dict(group, params=[])
    try:
        probe.__setstate__(
            {"state": {}, "param_groups": [loaded], "defaults": dict(optimizer.defaults)}
        )
    except Exception:  # a class whose __setstate__ needs more: compare the group as saved
        return group
    return loaded


def _check_optimizer_state(
    where: str,
    state: Any,
    ids: dict[Any, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    names: Mapping[torch.Tensor, str],
    problems: list[str],
) -> None:
    if not isinstance(state, Mapping):
        problems.append(f"{where}: its 'state' is a {type(state).__name__}, not a dict")
        return
    for key, values in state.items():
        param = ids.get(key)
        if param is None or not isinstance(values, Mapping):
            continue  # torch keeps state of unknown ids as it is
        current = optimizer.state.get(param, {})
        for entry, value in values.items():
            if not isinstance(value, torch.Tensor):
                continue
            expected = current.get(entry)
            if isinstance(expected, torch.Tensor):
                shape = expected.shape
            elif entry in PARAM_SHAPED:
                shape = param.shape
            else:
                continue
            if value.shape != shape:
                label = names.get(param, f"parameter {key}")
                problems.append(
                    f"{where}: {entry} of {label!r} is {_shape(value)} in the checkpoint, "
                    f"({', '.join(map(str, shape))}) here"
                )


def _check_schedulers(
    schedulers: Sequence[Any], saved: Any, types: Any, problems: list[str]
) -> None:
    """Another count of schedulers, or (where the checkpoint records them) another class:
    a scheduler loads any state dict, mixing the other class's fields into its own."""
    count = len(schedulers)
    if isinstance(types, Sequence) and len(types) == count:
        for i, (scheduler, theirs) in enumerate(zip(schedulers, types, strict=True)):
            if theirs != (mine := optimizer_type(scheduler)):
                problems.append(
                    f"lr scheduler {i + 1} of {count}: the checkpoint was saved from a "
                    f"{theirs}, this one is a {mine} (build the scheduler the run that saved "
                    "it used)"
                )
    if not isinstance(saved, Sequence) or len(saved) != count:
        theirs = len(saved) if isinstance(saved, Sequence) else type(saved).__name__
        problems.append(
            f"lr schedulers: {theirs} in the checkpoint, {count} here (pass lr_scheduler= "
            "as the run that saved it did)"
        )
    elif not all(isinstance(s, Mapping) for s in saved):
        problems.append("lr schedulers: an entry is not a scheduler state dict")


def _check_loss_scale(has_scaler: bool, saved: Any, problems: list[str]) -> None:
    if not isinstance(saved, Mapping):
        problems.append(f"'loss_scale' is a {type(saved).__name__}, not a dict")
    elif saved and not has_scaler:
        problems.append(
            "GradScaler: the checkpoint holds a scaler's state, this accumulator has none "
            "(pass scaler=torch.amp.GradScaler(...) as the run that saved it did)"
        )
    elif has_scaler and not saved:
        problems.append(
            "GradScaler: this accumulator has one, the checkpoint was saved without "
            "(build the accumulator without scaler=, or with it disabled)"
        )
    elif saved and not (isinstance(saved.get("scaler"), Mapping) and "growth_tracker" in saved):
        problems.append("GradScaler: the checkpoint's entry lacks 'scaler' or 'growth_tracker'")


def _check_rest(acc: GradientAccumulator, state: Mapping[str, Any], problems: list[str]) -> None:
    rng = state["rng"]
    if not (isinstance(rng, Mapping) and isinstance(rng.get("torch"), torch.Tensor)):
        problems.append("'rng' lacks torch's generator state")
    elif "python" not in rng:
        problems.append("'rng' lacks Python's generator state")
    counters = state["counters"]
    for key in ("steps", "windows"):
        if not isinstance(counters, Mapping) or not _count(counters.get(key)):
            problems.append(f"counters: {key!r} is missing or not a count")
    window = state["window"]
    if not isinstance(window, Mapping):
        problems.append(f"'window' is a {type(window).__name__}, not a dict")
        return
    absent = [k for k in WINDOW_KEYS if k not in window]
    if absent:
        problems.append(f"window: lacks {', '.join(map(repr, absent))}")
        return
    position = window["position"]
    if not _count(position) or position >= acc.accumulation_steps:
        problems.append(
            f"window: {position!r} steps in, but this accumulator's windows are "
            f"{acc.accumulation_steps} steps long (build it with the accumulation_steps "
            "that saved it, or flush() before saving)"
        )
    grads = window["grads"]
    if not isinstance(grads, Mapping):
        problems.append(f"window: 'grads' is a {type(grads).__name__}, not a dict")
        return
    params = dict(acc.pipe.named_parameters())
    unknown = [k for k in grads if k not in params]
    if unknown:
        problems.append(f"window: gradients of parameters not in this model: {_listed(unknown)}")
    for key, grad in grads.items():
        param = params.get(key)
        if param is None:
            continue
        if not isinstance(grad, torch.Tensor):
            problems.append(f"window: the gradient of {key!r} is a {type(grad).__name__}")
        elif grad.shape != param.shape or grad.dtype != param.dtype:
            problems.append(
                f"window: the gradient of {key!r} is {_shape(grad)} {grad.dtype} in the "
                f"checkpoint, its parameter {_shape(param)} {param.dtype} here"
            )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class LoadSnapshot:
    """What loading a checkpoint changes in ``acc``, to put back if applying fails.

    Putting back goes around the load hooks (one of them may be what failed):
    parameters and buffers are cloned and copied back into the live tensors;
    each optimizer's state and param groups are kept as they are, since
    torch's optimizers replace them on load rather than write into them; the
    schedulers' state, small, is copied.

    Args:
        acc: the accumulator about to be loaded into.
    """

    def __init__(self, acc: GradientAccumulator) -> None:
        self.acc = acc
        self.model = {
            k: v.detach().clone()
            for k, v in acc.pipe.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor)
        }
        self.optimizers = [
            (copy.copy(o.state), list(o.param_groups), [dict(g) for g in o.param_groups])
            for o in acc.optimizers
        ]
        self.schedulers = [copy.deepcopy(s.state_dict()) for s in acc.schedulers]
        self.loss_scale = copy.deepcopy(acc.loss_scale.state_dict())
        self.growth_tracker = acc.loss_scale.growth_tracker
        self.grads = [(p, p.grad) for p in acc.pipe.parameters()]
        self.fields = {
            k: getattr(acc, k)
            for k in (
                "steps",
                "windows",
                "position",
                "_items",
                "_samples",
                "_loss_sum",
                "_scale",
                "_rows",
            )
        }
        self.rng = rng_state()

    def restore(self) -> None:
        """Puts back everything as it was when the snapshot was taken."""
        acc = self.acc
        with torch.no_grad():
            for key, value in acc.pipe.state_dict(keep_vars=True).items():
                if key in self.model:
                    value.copy_(self.model[key])
        for optimizer, saved in zip(acc.optimizers, self.optimizers, strict=True):
            state, groups, contents = saved
            for group, content in zip(groups, contents, strict=True):
                group.clear()
                group.update(content)
            optimizer.state = state
            optimizer.param_groups = groups
        for scheduler, saved in zip(acc.schedulers, self.schedulers, strict=True):
            scheduler.load_state_dict(saved)
        acc.loss_scale.load_state_dict(self.loss_scale)
        acc.loss_scale.growth_tracker = self.growth_tracker
        set_rng_state(self.rng)
        for param, grad in self.grads:
            param.grad = grad
        for key, value in self.fields.items():
            setattr(acc, key, value)
