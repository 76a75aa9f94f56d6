"""Which stages a rank keeps, which parameters it shares with other ranks, and freeing the rest."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["keep_own_stages"]


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
        for p in stage.parameters():
            users.setdefault(id(p), set()).add(placement[s])
    own = [s for s in range(len(stages)) if placement[s] == pp_rank]
    for s in own:
        stages[s].to(device)
    own_modules = {id(m) for s in own for m in stages[s].modules()}
    for s, stage in enumerate(stages):
        if s not in own:
            for layer in stage.children():
                if id(layer) not in own_modules:
                    # Module.to gives the layer new (meta) Parameters: a Parameter object
                    # that an own stage shares stays where it is, with its data.
                    layer.to("meta")
    tied = {
        id(p): tuple(sorted(users[id(p)]))
        for s in own
        for p in stages[s].parameters()
        if len(users[id(p)]) > 1
    }
    return own, tied
