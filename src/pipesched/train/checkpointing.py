"""A GradientAccumulator's checkpoint: its state as saved, and the save and the all-or-nothing load.

The accumulator's checkpoint methods delegate here; what they read and
write of it goes through its public names, and its window is written back
only by the accumulator itself (``restore_window``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipesched.errors import CheckpointError
from pipesched.train.checkpoint_check import (
    FIX,
    LoadSnapshot,
    check_fits,
    describe,
    optimizer_type,
    refuse_sharded,
)
from pipesched.train.dtensors import like_live, optimizer_like_live
from pipesched.train.integrity import CHECKSUM, digest, verified
from pipesched.train.sharded import load_sharded, save_sharded
from pipesched.train.state import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from pipesched.train.store import is_sharded

if TYPE_CHECKING:
    from pipesched.train.accumulator import GradientAccumulator

__all__ = ["accumulator_state", "apply_state", "load_file", "load_state", "save_file"]


def accumulator_state(acc: GradientAccumulator) -> dict[str, Any]:
    """``acc``'s state, as :meth:`GradientAccumulator.state_dict` gives it."""
    refuse_sharded(acc.pipe, "GradientAccumulator.state_dict()")
    sums = acc.window_sums
    return {
        "model": acc.pipe.state_dict(),
        "optimizers": [o.state_dict() for o in acc.optimizers],
        "optimizer_types": [optimizer_type(o) for o in acc.optimizers],
        "schedulers": [s.state_dict() for s in acc.schedulers],
        "scheduler_types": [optimizer_type(s) for s in acc.schedulers],
        "loss_scale": acc.loss_scale.state_dict(),
        "rng": rng_state(),
        "counters": {"steps": acc.steps, "windows": acc.windows},
        "window": {
            "position": acc.position,
            "items": sums.items,
            "samples": sums.samples,
            "loss_sum": sums.loss_sum,
            "scale": sums.scale,
            "step_rows": list(sums.step_rows),
            "grads": {
                n: p.grad.detach().clone()
                for n, p in acc.pipe.named_parameters()
                if p.grad is not None
            },
        },
    }


def save_file(acc: GradientAccumulator, path: str, *, sharded: bool) -> None:
    """Writes ``acc``'s checkpoint to ``path`` atomically: sharded, or one checked file."""
    if sharded:
        save_sharded(acc, path)
    else:
        state = accumulator_state(acc)
        check_fits(acc, state, path)  # never replace a good file with one load refuses
        save_checkpoint({**state, CHECKSUM: digest(state)}, path)


def load_file(acc: GradientAccumulator, path: str) -> None:
    """Loads the checkpoint at ``path`` (a file, or a sharded directory) into ``acc``."""
    if is_sharded(path):
        load_sharded(acc, path)
    else:
        load_state(acc, load_checkpoint(path), path)


def load_state(acc: GradientAccumulator, state: Any, source: str | None) -> None:
    """Checks ``state`` (read from ``source``, None: given) and applies it; on failure, puts back.

    Raises:
        CheckpointError: ``state`` is not what was saved, does not fit, or
            could not be applied; nothing was changed.
    """
    refuse_sharded(acc.pipe, "GradientAccumulator.load_state_dict()")
    state = verified(state, describe(source))
    check_fits(acc, state, source)
    snapshot = LoadSnapshot(acc)
    try:
        apply_state(acc, state)
    except BaseException as err:
        snapshot.restore()
        if not isinstance(err, Exception):
            raise
        raise CheckpointError(
            f"{describe(source)} passed the checks but could not be applied "
            f"({type(err).__name__}: {err}); everything it changed was put back. Fix: "
            f"{FIX}"
        ) from err


def apply_state(acc: GradientAccumulator, state: dict[str, Any]) -> None:
    """Writes a checkpoint's state into ``acc``, already checked to fit; no check, no undo."""
    live = acc.pipe.state_dict(keep_vars=True)  # sharded stages: their parts of each
    acc.pipe.load_state_dict({k: like_live(v, live.get(k)) for k, v in state["model"].items()})
    for optimizer, saved in zip(acc.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(optimizer_like_live(optimizer, saved))
    for scheduler, saved in zip(acc.schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    acc.loss_scale.load_state_dict(state["loss_scale"])
    set_rng_state(state["rng"])
    window = state["window"]
    acc.restore_window(
        state["counters"]["steps"],
        state["counters"]["windows"],
        window["position"],
        window["items"],
        window["samples"],
        window["loss_sum"],
        window["scale"],
        tuple(window.get("step_rows", ())),  # older checkpoints have none
    )
    for name, p in acc.pipe.named_parameters():
        grad = window["grads"].get(name)
        p.grad = None if grad is None else like_live(grad.to(p.device).clone(), p)
