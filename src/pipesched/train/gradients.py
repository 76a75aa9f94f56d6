"""Whole-model gradient operations across every stage and device: scale, check, measure, clip.

On a sharded mesh (FSDP2) a rank's gradients mix placements: its stages' sharded
DTensors, and the weights left whole (a weight tied between two stages of the
rank), plain or replicated. DTensor ops across such a mix fail (a sharded
``.all()`` is a ``Partial``, which a ``Replicate`` one cannot join), so the
check and the clip work on each rank's own part of every gradient: the check's
flag is then reduced over every rank by the caller (``sync.all_true``), and the
clip multiplies each part by the one global coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipesched.runtime import foreach_mul_

__all__ = ["all_finite", "clip_to_", "grads_of", "scale_", "scaled"]


def grads_of(parameters: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients that exist (parameters whose ``.grad`` is None are left out)."""
    return [p.grad for p in parameters if p.grad is not None]


def scale_(grads: list[torch.Tensor], factor: float) -> None:
    """Multiplies every gradient by ``factor`` in place, once."""
    if factor != 1.0 and grads:
        foreach_mul_(grads, factor)


def scaled(
    parameters: Iterable[nn.Parameter], factor: float, keep: Iterable[torch.Tensor] = ()
) -> list[torch.Tensor]:
    """Multiplies every gradient by ``factor``, the ones in ``keep`` out of place; returns them.

    A gradient in ``keep`` is left as it was: the parameter's ``.grad``
    becomes a new tensor (so that it can be put back); the others are
    scaled in place. The same products either way, bit for bit.
    """
    kept = {id(t) for t in keep}
    held = [p for p in parameters if p.grad is not None]
    copies = [p for p in held if id(p.grad) in kept]
    in_place = [p.grad for p in held if id(p.grad) not in kept]
    scale_(in_place, factor)  # type: ignore[arg-type]
    for p in copies:
        p.grad = p.grad * factor  # type: ignore[operator,assignment]
    return [p.grad for p in held]  # type: ignore[misc]


def all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether no gradient on any device holds an inf or a NaN (one host sync per device).

    Of a DTensor gradient (a sharded stage's), this rank's part only: on a mesh
    the caller reduces the flag over every rank, which then covers every part.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in map(_local, grads):
        if g.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): its values
            g = g.coalesce().values()
        by_device.setdefault(g.device, []).append(g)
    return all(
        bool(torch.stack([torch.isfinite(g).all() for g in group]).all())
        for group in by_device.values()
    )


def clip_to_(parameters: list[nn.Parameter], max_norm: float | None, norm: float) -> None:
    """Scales all gradients down in place so their global norm ``norm`` becomes ``max_norm``.

    With ``norm`` the global norm over every stage (and rank), this is
    ``torch.nn.utils.clip_grad_norm_`` on the unpipelined model: the same
    coefficient, ``max_norm / (norm + 1e-6)``, clamped to 1.
    """
    if max_norm is None or not math.isfinite(norm):
        return
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    # As clip_grads_with_norm_ computes it: the coefficient in the gradients' dtype (not the
    # default float32), clamped to 1, and multiplied in (into this rank's part of a DTensor,
    # where torch's own would mix a plain coefficient with DTensors and fail).
    total = torch.tensor(norm, dtype=grads[0].dtype)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        on_device = coefficient.to(device)
        for g in group:
            g.mul_(on_device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local tensor where ``t`` is a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t
