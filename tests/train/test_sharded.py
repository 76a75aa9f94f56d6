"""Sharded checkpoints in one process: any balance resumes bit-identically; misfits change nothing.

The multi-process layouts (pp=2 saving; pp=1, pp=2 x dp=2, pp=4 resuming)
are in tests/distributed/test_sharded.py; here the same files are written
and read by one process, where every path of the format runs too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from pipesched import GradientAccumulator, Pipeline
from pipesched.cli.main import main
from pipesched.errors import CheckpointError
from pipesched.train import export, export_model, import_model, load_model, model_state
from pipesched.train.store import LATEST, resolve

STEPS = 2


@pytest.fixture(autouse=True)
def _fp64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _model(width: int = 8, dropout: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, width), nn.Tanh(), nn.Dropout(dropout), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, 1),
    )  # fmt: skip


def _acc(
    balance: list[int], *, width: int = 8, groups: bool = False, per_stage: bool = False
) -> GradientAccumulator:
    pipe = Pipeline(
        _model(width), 2, balance=balance, devices=["cpu"] * len(balance), schedule="1f1b"
    )
    if per_stage:  # one optimizer and one scheduler per stage
        optimizers = [torch.optim.AdamW(s.parameters(), lr=0.01) for s in pipe.stages]
        schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, 0.7) for o in optimizers]
        return GradientAccumulator(
            pipe, optimizers, accumulation_steps=STEPS, lr_scheduler=schedulers
        )
    params = list(pipe.parameters())
    if groups:  # no weight decay on biases, as transformer recipes do
        decay = [p for p in params if p.ndim > 1]
        rest = [p for p in params if p.ndim == 1]
        chosen: object = [
            {"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0},
        ]
    else:
        chosen = params
    optimizer = torch.optim.AdamW(chosen, lr=0.01)  # type: ignore[arg-type]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda w: 1 / (1 + w))
    return GradientAccumulator(pipe, optimizer, accumulation_steps=STEPS, lr_scheduler=scheduler)


def _data(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(count)]


def _train(acc: GradientAccumulator, batches) -> None:
    for x, y in batches:
        acc.step(x, y, loss_fn=nn.functional.mse_loss)


def _params(acc: GradientAccumulator) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in acc.pipe.named_parameters()}


def _resumed(
    tmp_path, balance: list[int], **kwargs: bool
) -> tuple[GradientAccumulator, GradientAccumulator]:
    """A run of 7 steps at [3, 3], and one saved after 3 and resumed at ``balance``."""
    data = _data(7)
    torch.manual_seed(1)
    whole = _acc([3, 3], **kwargs)
    _train(whole, data)
    torch.manual_seed(1)
    saver = _acc([3, 3], **kwargs)
    _train(saver, data[:3])  # one window and one step: the window's gradient is saved
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    torch.manual_seed(123)  # the checkpoint's generator state replaces this
    resumed = _acc(balance, **kwargs)
    resumed.load(str(tmp_path / "ckpt"))
    assert (resumed.steps, resumed.windows, resumed.position) == (3, 1, 1)
    _train(resumed, data[3:])
    expected = _params(whole)
    for name, value in _params(resumed).items():
        assert torch.equal(value, expected[name]), name
    return whole, resumed


@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("balance", [[6], [1, 5], [2, 2, 2]])
def test_resumes_mid_window_at_another_balance_bit_identically(tmp_path, balance, groups):
    whole, resumed = _resumed(tmp_path, balance, groups=groups)
    assert resumed.schedulers[0].last_epoch == whole.schedulers[0].last_epoch


@pytest.mark.parametrize("balance", [[6], [2, 2, 2]])
def test_per_stage_optimizers_and_schedulers_resume_at_another_stage_count(tmp_path, balance):
    """Before, their schedulers were refused: "lr schedulers: 2 in the checkpoint, 3 here"."""
    whole, resumed = _resumed(tmp_path, balance, per_stage=True)
    last = whole.schedulers[0].get_last_lr()
    assert [s.get_last_lr() for s in resumed.schedulers] == [last] * len(balance)


def test_the_comparison_bites_without_the_window_gradient(tmp_path):
    data = _data(4)
    torch.manual_seed(1)
    whole = _acc([3, 3])
    _train(whole, data)
    torch.manual_seed(1)
    saver = _acc([3, 3])
    _train(saver, data[:3])
    for p in saver.pipe.parameters():  # the window's gradient dropped before saving
        p.grad = None
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    resumed = _acc([2, 4])
    resumed.load(str(tmp_path / "ckpt"))
    _train(resumed, data[3:])
    expected = _params(whole)
    assert any(not torch.equal(v, expected[n]) for n, v in _params(resumed).items())


def test_each_save_is_a_new_version_and_the_old_ones_go(tmp_path):
    acc = _acc([3, 3])
    _train(acc, _data(1))
    path = tmp_path / "ckpt"
    acc.save(str(path), sharded=True)
    first = resolve(str(path))
    (path / "v-halfwritten").mkdir()  # what a save killed before its commit leaves
    (path / "v-halfwritten" / "__0_0.distcp").write_bytes(b"partial")
    _train(acc, _data(1))
    acc.save(str(path), sharded=True)
    second = resolve(str(path))
    assert second != first and not os.path.exists(first)
    assert sorted(os.listdir(path)) == sorted([LATEST, os.path.basename(second)])
    loaded = _acc([3, 3])
    loaded.load(str(path))
    assert loaded.steps == 2


def test_a_version_lost_or_never_committed_is_refused_naming_it(tmp_path):
    acc = _acc([3, 3])
    path = tmp_path / "ckpt"
    path.mkdir()
    with pytest.raises(CheckpointError, match="without a committed version"):
        acc.load(str(path))
    (path / LATEST).write_text("v-gone\n")
    with pytest.raises(CheckpointError, match="'v-gone'.*not a complete checkpoint"):
        acc.load(str(path))
    with pytest.raises(FileNotFoundError):
        acc.load(str(tmp_path / "absent"))


def test_a_checkpoint_of_another_model_changes_nothing_and_names_the_misfit(tmp_path):
    saver = _acc([3, 3])
    _train(saver, _data(3))
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    other = _acc([3, 3], width=9)
    _train(other, _data(3))
    before = _params(other)
    state = {
        k: v.clone() for k, v in other.optimizers[0].state[next(other.pipe.parameters())].items()
    }
    with pytest.raises(CheckpointError, match=r"'0\.weight' is \(8, 4\).*\(9, 4\)"):
        other.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, before[n]) for n, v in _params(other).items())
    kept = other.optimizers[0].state[next(other.pipe.parameters())]
    assert all(torch.equal(kept[k], v) for k, v in state.items())
    assert (other.steps, other.position) == (3, 1)


def test_groups_saved_with_other_options_are_refused(tmp_path):
    saver = _acc([3, 3], groups=True)
    _train(saver, _data(2))
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    with pytest.raises(CheckpointError, match="mixes parameters saved with different options"):
        _acc([3, 3], groups=False).load(str(tmp_path / "ckpt"))


def test_export_import_and_load_model_read_the_plain_names(tmp_path):
    acc = _acc([3, 3])
    _train(acc, _data(2))
    acc.save(str(tmp_path / "ckpt"), sharded=True)
    out = tmp_path / "model.pt"
    export_model(str(tmp_path / "ckpt"), str(out))
    plain = _model()
    plain.load_state_dict(torch.load(out), strict=True)
    assert all(
        torch.equal(p, q) for p, q in zip(plain.parameters(), acc.pipe.parameters(), strict=True)
    )
    assert set(model_state(str(tmp_path / "ckpt"))) == set(plain.state_dict())
    import_model(str(out), str(tmp_path / "weights"))
    for source in (str(out), str(tmp_path / "weights")):
        fresh = _acc([2, 4])
        load_model(fresh.pipe, source)
        assert all(
            torch.equal(p, q)
            for p, q in zip(plain.parameters(), fresh.pipe.parameters(), strict=True)
        )
    with pytest.raises(CheckpointError, match="load_model"):  # weights only: not a resume
        _acc([3, 3]).load(str(tmp_path / "weights"))


def test_load_model_refuses_misfits_and_extra_tensors_before_writing(tmp_path):
    acc = _acc([3, 3])
    before = _params(acc)
    wide = tmp_path / "wide.pt"
    torch.save(_model(width=9).state_dict(), wide)
    with pytest.raises(CheckpointError, match=r"'0\.weight' is \(9, 4\)"):
        load_model(acc.pipe, str(wide))
    extra = tmp_path / "extra.pt"
    torch.save({**_model().state_dict(), "head.weight": torch.zeros(2)}, extra)
    with pytest.raises(CheckpointError, match="'head.weight'.*strict=False"):
        load_model(acc.pipe, str(extra))
    assert all(torch.equal(v, before[n]) for n, v in _params(acc).items())
    load_model(acc.pipe, str(extra), strict=False)
    with pytest.raises(CheckpointError, match="not a state dict"):
        torch.save([1, 2], tmp_path / "list.pt")
        load_model(acc.pipe, str(tmp_path / "list.pt"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_plain_dcp_directory_reads_like_a_version(tmp_path):
    state = {f"model/{k}": v for k, v in _model().state_dict().items()}
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    acc = _acc([3, 3])
    for p in acc.pipe.parameters():
        p.data.zero_()
    load_model(acc.pipe, str(tmp_path / "plain"))
    assert all(
        torch.equal(p, q) for p, q in zip(_model().parameters(), acc.pipe.parameters(), strict=True)
    )


def test_cli_shows_exports_and_imports(tmp_path, capsys):
    acc = _acc([3, 3])
    _train(acc, _data(3))
    acc.save(str(tmp_path / "ckpt"), sharded=True)
    assert main(["checkpoint", "show", str(tmp_path / "ckpt")]) == 0
    shown = capsys.readouterr().out
    assert "saved at pp=1 x dp=1, balance [3, 3]" in shown
    assert "step 3, window 1 done, 1 of 2 steps into the next" in shown
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(out)]) == 0
    assert set(torch.load(out)) == set(_model().state_dict())
    assert main(["checkpoint", "import", str(out), str(tmp_path / "w")]) == 0
    assert main(["checkpoint", "show", str(tmp_path / "w")]) == 0
    assert "model weights only" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(tmp_path / "nothing"), str(out)]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_a_sharded_save_onto_a_file_is_refused_naming_it(tmp_path):
    acc = _acc([3, 3])
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot save the checkpoint to .*file"):
        acc.save(str(tmp_path / "file"), sharded=True)


@pytest.mark.parametrize("read", [model_state, export.describe], ids=["export", "show"])
def test_a_one_process_file_is_told_apart_from_a_sharded_checkpoint(tmp_path, read):
    acc = _acc([3, 3])
    acc.save(str(tmp_path / "ckpt.pt"))  # one process: a file
    with pytest.raises(CheckpointError, match="'.*ckpt.pt' is a file, not a sharded checkpoint"):
        read(str(tmp_path / "ckpt.pt"))
    with pytest.raises(FileNotFoundError):
        read(str(tmp_path / "nothing"))


def test_a_loss_scaler_resumes_with_its_scale_and_growth(tmp_path):
    def make() -> GradientAccumulator:
        pipe = Pipeline(_model(), 2, balance=[3, 3], devices=["cpu", "cpu"])
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return GradientAccumulator(
            pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=STEPS,
            scaler=scaler,
        )  # fmt: skip

    data = _data(9)
    torch.manual_seed(1)
    whole = make()
    _train(whole, data)
    torch.manual_seed(1)
    saver = make()
    _train(saver, data[:5])  # two windows (the scale grew once) and one step
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    resumed = make()
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.loss_scale.value() == saver.loss_scale.value() != 2.0**10
    _train(resumed, data[5:])
    assert resumed.loss_scale.value() == whole.loss_scale.value()
    expected = _params(whole)
    assert all(torch.equal(v, expected[n]) for n, v in _params(resumed).items())


class _Residual(nn.Module):
    """Not a Sequential: traced on its first call, so a load may come before any cut."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.drop = nn.Linear(4, 8), nn.Linear(8, 4), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(torch.tanh(self.a(x))))


def test_a_traced_model_loads_before_its_first_call_and_resumes_at_another_cut(tmp_path):
    def make(split: list[str]) -> GradientAccumulator:
        pipe = Pipeline(_Residual(), 2, devices=["cpu"] * (len(split) + 1), split_points=split)
        return GradientAccumulator(
            pipe, torch.optim.AdamW(pipe.parameters(), lr=0.01), accumulation_steps=STEPS
        )

    data = [(x, x.flip(0)) for x, _ in _data(5)]
    torch.manual_seed(1)
    whole = make(["b"])
    _train(whole, data)
    torch.manual_seed(1)
    saver = make(["b"])
    _train(saver, data[:3])
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    resumed = make([])  # one stage, not cut yet: the load comes first
    resumed.load(str(tmp_path / "ckpt"))
    _train(resumed, data[3:])
    expected = _params(whole)
    assert all(torch.equal(v, expected[n]) for n, v in _params(resumed).items())


def test_importing_a_gradient_accumulator_file_says_where_its_model_is(tmp_path, capsys):
    """Before, torch's weights_only message of some 900 characters came back."""
    acc = _acc([3, 3])
    _train(acc, _data(1))
    acc.save(str(tmp_path / "acc.pt"))
    assert main(["checkpoint", "import", str(tmp_path / "acc.pt"), str(tmp_path / "w")]) == 2
    assert "GradientAccumulator.save file (its model is under 'model'" in capsys.readouterr().err


def test_a_ctrl_c_inside_a_sharded_save_is_a_ctrl_c_and_the_last_version_loads(
    tmp_path, monkeypatch
):
    """Before, torch's zip writer, closing on the Ctrl-C, raised over it: a CheckpointError."""
    from torch.distributed.checkpoint import filesystem

    acc = _acc([3, 3])
    _train(acc, _data(1))
    path = str(tmp_path / "ckpt")
    acc.save(path, sharded=True)
    saved = _params(acc)
    _train(acc, _data(2)[1:])

    def interrupted(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None

    monkeypatch.setattr(filesystem, "_write_item", interrupted)
    with pytest.raises(KeyboardInterrupt):
        acc.save(path, sharded=True)
    monkeypatch.undo()
    resumed = _acc([3, 3])
    resumed.load(path)
    assert all(torch.equal(v, saved[n]) for n, v in _params(resumed).items())


def test_a_ctrl_c_inside_a_sharded_load_is_a_ctrl_c_and_changes_nothing(tmp_path, monkeypatch):
    """Before, it came back as "a file of it is missing, truncated or changed"."""
    from torch.distributed.checkpoint import filesystem

    saver = _acc([3, 3])
    _train(saver, _data(3))
    saver.save(str(tmp_path / "ckpt"), sharded=True)
    acc = _acc([3, 3])
    _train(acc, _data(1))
    before = _params(acc)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(filesystem.FileSystemReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        acc.load(str(tmp_path / "ckpt"))
    monkeypatch.undo()
    assert acc.steps == 1 and all(torch.equal(v, before[n]) for n, v in _params(acc).items())
