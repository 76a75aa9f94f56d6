"""Only torch's own draw-free layers and losses, exact types without hooks, draw nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from pipesched.runtime.stage.draw_free import draws_nothing, loss_draws_nothing


def test_only_stages_of_torchs_draw_free_layers_skip_seeding():
    plain = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.LayerNorm(3), nn.Sequential(nn.GELU()))
    assert draws_nothing(plain)
    assert not draws_nothing(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1)))
    assert not draws_nothing(nn.Sequential(nn.RReLU()))  # draws in training

    class MyLinear(nn.Linear):  # a subclass may override forward
        pass

    assert not draws_nothing(nn.Sequential(MyLinear(3, 3)))
    hooked = nn.Sequential(nn.Linear(3, 3))
    handle = hooked[0].register_forward_hook(lambda m, i, o: o)
    assert not draws_nothing(hooked)
    handle.remove()
    assert draws_nothing(hooked)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert not draws_nothing(hooked)  # a hook on every module
    finally:
        handle.remove()
    assert not draws_nothing(nn.Sequential(parametrizations.weight_norm(nn.Linear(3, 3))))


def test_only_torchs_own_losses_skip_seeding():
    assert loss_draws_nothing(F.mse_loss) and loss_draws_nothing(F.cross_entropy)
    assert loss_draws_nothing(nn.CrossEntropyLoss(ignore_index=-100))
    assert not loss_draws_nothing(lambda y, t: F.mse_loss(y, t))  # may draw: seeded

    class MyLoss(nn.MSELoss):
        pass

    assert not loss_draws_nothing(MyLoss())
    hooked = nn.MSELoss()
    hooked.register_forward_hook(lambda m, i, o: o)
    assert not loss_draws_nothing(hooked)
