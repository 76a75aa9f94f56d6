"""Only torch's own draw-free layers and losses, exact types without hooks, draw nothing."""

from __future__ import annotations

import pytest
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


def _moves_generator(module: nn.Module, *inputs: torch.Tensor) -> bool:
    """Whether a training forward and backward of ``module`` moves torch's default generator."""
    module.train()
    before = torch.default_generator.get_state()
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    return not torch.equal(before, torch.default_generator.get_state())


_DROPOUTS = {  # each dropout on an input of the shape it expects
    nn.Dropout: (3, 4), nn.Dropout1d: (2, 3, 4), nn.Dropout2d: (2, 3, 4, 4),
    nn.Dropout3d: (2, 3, 2, 4, 4), nn.AlphaDropout: (3, 4), nn.FeatureAlphaDropout: (2, 3, 4, 4),
}  # fmt: skip


def _dropout(kind, shape):
    return lambda p: (nn.Sequential(kind(p)), (torch.randn(*shape, requires_grad=True),))


_CONFIGURED = {
    **{kind.__name__: _dropout(kind, shape) for kind, shape in _DROPOUTS.items()},
    "encoder layer": lambda p: (
        nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=p, batch_first=True), 2),
        (torch.randn(2, 5, 8),),
    ),
    "encoder layer, norm first, gelu": lambda p: (
        nn.Sequential(
            nn.TransformerEncoderLayer(8, 2, 16, p, "gelu", batch_first=True, norm_first=True)
        ),
        (torch.randn(2, 5, 8),),
    ),
    "decoder layer": lambda p: (
        nn.Transformer(8, 2, 1, 1, 16, dropout=p, batch_first=True),
        (torch.randn(2, 5, 8), torch.randn(2, 3, 8)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_CONFIGURED))
def test_torchs_dropout_and_attention_draw_nothing_exactly_when_their_p_is_zero(name):
    # The claim draws_nothing makes, checked against the generator itself: at p = 0
    # neither pass draws (so the stage needs no seeding); at p > 0 both claim and
    # generator say it draws.
    for p in (0.0, 0.2):
        torch.manual_seed(0)
        module, inputs = _CONFIGURED[name](p)
        assert draws_nothing(module) == (p == 0)
        assert _moves_generator(module, *inputs) == (p > 0)


@pytest.mark.parametrize("need_weights", [True, False])
def test_attention_without_dropout_draws_nothing_on_either_path(need_weights):
    x = torch.randn(2, 5, 8)
    for p in (0.0, 0.2):
        attention = nn.MultiheadAttention(8, 2, dropout=p, batch_first=True)
        assert draws_nothing(nn.Sequential(attention)) == (p == 0)
        before = torch.default_generator.get_state()
        attention(x, x, x, need_weights=need_weights)[0].sum().backward()
        assert torch.equal(before, torch.default_generator.get_state()) == (p == 0)


def test_a_transformer_layer_with_an_activation_of_ones_own_is_seeded():
    def noisy(x):  # may draw: not a module pipesched can see
        return F.relu(x) + 0.0 * torch.rand_like(x)

    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=noisy)
    assert not draws_nothing(nn.Sequential(layer))
    assert draws_nothing(nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, 0.0, nn.SiLU())))
    assert not draws_nothing(nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, 0.0, nn.RReLU())))
    module = nn.Sequential(nn.Dropout(0.0))
    assert draws_nothing(module)
    module[0].p = 0.1  # changed between steps: read again at the next
    assert not draws_nothing(module)
