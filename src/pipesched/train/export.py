"""A checkpoint's model as the plain model's state dict, and a plain state dict into a pipeline.

Why a reader of our own for the second: ``pipe.load_state_dict(torch.load(f))``
reads the whole model on every rank, which is what a model larger than one
rank cannot afford. :func:`load_model` reads only the loading rank's own
stages' tensors, from a ``torch.save`` file (memory-mapped: the other
tensors' pages are never read) or from a sharded checkpoint.
"""

from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipesched.errors import CheckpointError
from pipesched.train import store
from pipesched.train.dtensors import like_live
from pipesched.train.integrity import checked_zip
from pipesched.train.sharded import agree
from pipesched.train.state import save_checkpoint

if TYPE_CHECKING:
    from pipesched.pipeline import Pipeline

__all__ = ["describe", "export_model", "import_model", "load_model", "model_state"]

_PREFIX = "model/"


def model_state(checkpoint: str) -> dict[str, torch.Tensor]:
    """The plain model's ``state_dict`` held by a sharded checkpoint (read whole, on the CPU).

    Raises:
        FileNotFoundError: nothing is at ``checkpoint``.
        CheckpointError: it is not a sharded checkpoint, or cannot be read.
    """
    _check_sharded(checkpoint)
    directory = store.resolve(checkpoint)
    metadata = store.read_metadata(directory)
    keys = [k for k in metadata if k.startswith(_PREFIX)]
    return {k[len(_PREFIX) :]: v for k, v in store.read(directory, keys, metadata).items()}


def describe(checkpoint: str) -> str:
    """A few lines on a sharded checkpoint: its version, the layout and point that saved it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # see store

    _check_sharded(checkpoint)
    directory = store.resolve(checkpoint)
    metadata = store.read_metadata(directory)
    tensors = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    model = [v for k, v in tensors.items() if k.startswith(_PREFIX)]
    size = sum(v.size.numel() * v.properties.dtype.itemsize for v in model)
    lines = [
        f"{checkpoint}: version {os.path.basename(directory)}",
        f"model: {len(model)} tensors, {_size(size)}",
    ]
    if "accumulator" in metadata:
        extra = store.read(directory, ["accumulator"], metadata)["accumulator"]
        layout, counters, window = extra["layout"], extra["counters"], extra["window"]
        optim = sum(k.startswith("optim/") for k in tensors)
        lines += [
            f"saved at pp={layout['pp']} x dp={layout['dp']}, balance {layout['balance']}",
            f"step {counters['steps']}, window {counters['windows']} done, "
            f"{window['position']} of {extra['accumulation_steps']} steps into the next",
            f"optimizer: {optim} state tensors; schedulers: {len(extra['schedulers'])}",
        ]
    else:
        lines.append("model weights only (load with pipesched.train.load_model)")
    return "\n".join(lines)


def _check_sharded(checkpoint: str) -> None:
    """Raises FileNotFoundError (nothing there) or CheckpointError (a one-process file)."""
    if store.is_sharded(checkpoint):
        return
    if not os.path.exists(checkpoint):
        raise FileNotFoundError(f"no checkpoint at {checkpoint!r}")
    raise CheckpointError(
        f"{checkpoint!r} is a file, not a sharded checkpoint directory: a one-process "
        "GradientAccumulator.save file holds the model's state dict already, under "
        "'model' (torch.load(path, weights_only=False)['model'])"
    )


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def export_model(checkpoint: str, out: str) -> None:
    """Writes the model of a sharded checkpoint to ``out`` as its plain ``state_dict``.

    The file loads into the plain model with ``load_state_dict(torch.load(out),
    strict=True)`` (or ``from_pretrained(..., state_dict=...)``); written
    atomically, like every checkpoint.
    """
    save_checkpoint(model_state(checkpoint), out)


def import_model(state_dict_file: str, checkpoint: str) -> None:
    """Writes a plain ``state_dict`` file as a sharded checkpoint holding only the model.

    :func:`load_model` reads either; the sharded one lets each rank read its
    shards only, without memory-mapping the whole file.
    """
    state = _read_file(state_dict_file)
    store.write({f"{_PREFIX}{k}": v for k, v in state.items()}, checkpoint, distributed=False)


def load_model(pipe: Pipeline, source: str, *, strict: bool = True) -> None:
    """Loads the model's weights into ``pipe``, each rank reading only its own stages' tensors.

    All or nothing: on a mesh every rank calls it, and should any rank find
    a tensor missing or of another shape or dtype, every rank raises before
    any weight changes.

    Args:
        pipe: the pipeline (e.g. built on the meta device, then materialized).
        source: the plain model's ``state_dict`` saved with ``torch.save``
            (read memory-mapped), or a sharded checkpoint directory
            (:meth:`GradientAccumulator.save` on a mesh, or :func:`import_model`).
        strict: entries of ``source`` that no rank's stages hold are an error.

    Raises:
        FileNotFoundError: nothing is at ``source``.
        CheckpointError: what does not fit, on every rank that found it.
    """
    mesh = pipe.mesh
    live = {k: v for k, v in pipe.state_dict(keep_vars=True).items() if not v.is_meta}
    names = set(pipe.state_dict(keep_vars=True))
    if mesh is not None:  # a Sequential's pipeline names only this rank's layers
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = set().union(*gathered)
    problem: str | None = None
    loaded: dict[str, Any] = {}
    try:
        loaded, available = _read_own(source, list(live))
        problem = _misfit(source, live, loaded)
        if problem is None and strict:
            problem = _unexpected(source, available, names)
    except (CheckpointError, FileNotFoundError) as err:
        if mesh is None:
            raise
        problem = str(err)
    if mesh is not None:
        agree(problem)
    elif problem is not None:
        raise CheckpointError(problem)
    with torch.no_grad():
        for key, value in loaded.items():
            live[key].copy_(like_live(value, live[key]))


def _read_own(source: str, keys: list[str]) -> tuple[dict[str, Any], set[str]]:
    """``source``'s tensors of ``keys`` (those it has), and every key it holds."""
    if store.is_sharded(source):
        directory = store.resolve(source)
        metadata = store.read_metadata(directory)
        held = {k[len(_PREFIX) :] for k in metadata if k.startswith(_PREFIX)}
        wanted = [f"{_PREFIX}{k}" for k in keys if k in held]
        data = store.read(directory, wanted, metadata)
        return {k[len(_PREFIX) :]: v for k, v in data.items()}, held
    state = _read_file(source)
    return {k: state[k] for k in keys if k in state}, set(state)


def _read_file(path: str) -> dict[str, Any]:
    try:
        with checked_zip(path) as checked:  # a damaged file is refused before it is unpickled
            state = torch.load(checked, map_location="cpu", mmap=True, weights_only=True)
    except (FileNotFoundError, CheckpointError):
        raise
    except pickle.UnpicklingError as err:  # objects beyond tensors: not read unchecked
        raise CheckpointError(
            f"{path!r} holds Python objects beyond tensors, which a model's weights are "
            "read without: a GradientAccumulator.save file (its model is under 'model': "
            "resume it with GradientAccumulator.load, or save "
            "torch.load(path, weights_only=False)['model'] on its own and give that), or "
            "another pickle; give a file written by torch.save(model.state_dict(), path)"
        ) from err
    except Exception as err:
        raise CheckpointError(
            f"{path!r} cannot be read as a state dict ({type(err).__name__}: {err}); give "
            "a file written by torch.save(model.state_dict(), path)"
        ) from err
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        raise CheckpointError(
            f"{path!r} is a GradientAccumulator checkpoint, not a model's state dict: resume "
            "it with GradientAccumulator.load, or pass torch.load(path)['model'] to "
            "pipe.load_state_dict"
        )
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path!r} holds a {type(state).__name__}, not a state dict; give a file "
            "written by torch.save(model.state_dict(), path)"
        )
    return state


def _misfit(source: str, live: dict[str, torch.Tensor], loaded: dict[str, Any]) -> str | None:
    problems = [f"{k!r} is missing" for k in live if k not in loaded]
    for key, value in loaded.items():
        here = live[key]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif value.shape != here.shape or value.dtype != here.dtype:
            problems.append(
                f"{key!r} is {tuple(value.shape)} {value.dtype} there, "
                f"{tuple(here.shape)} {here.dtype} here"
            )
    if not problems:
        return None
    shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
    return (
        f"{source!r} does not fit this model ({len(problems)} misfits: {shown}); load the "
        "weights of the model this pipeline was built from"
    )


def _unexpected(source: str, available: set[str], names: set[str]) -> str | None:
    extra = sorted(available - names)
    if not extra:
        return None
    return (
        f"{source!r} holds {len(extra)} tensors that this model has not "
        f"({', '.join(map(repr, extra[:6]))}{', ...' if len(extra) > 6 else ''}): it is "
        "another model's; pass strict=False to ignore them"
    )
