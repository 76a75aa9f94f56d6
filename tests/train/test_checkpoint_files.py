"""Checkpoints that do not fit or cannot be read change nothing; killed saves leave no litter.

INVARIANT 28. Each misfit is loaded into an accumulator mid-window (gradients
accumulated, Adam state, a stepped scheduler and scaler); afterwards every
parameter, gradient, optimizer and scheduler state, counter and window field
must be bitwise what it was, and a fitting checkpoint must still resume
bit-identically to a run that never stopped.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import CheckpointError
from pipesched.train.integrity import CHECKSUM, digest
from pipesched.train.state import _HOST, remove_stale_temp_files

pytestmark = pytest.mark.usefixtures("fp64")

STEPS, WINDOW, SAVED_AT = 7, 3, 4  # saved one window and one step into the next
FIELDS = ("steps", "windows", "position", "_items", "_samples", "_loss_sum", "_scale")


def _model(width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3))


def _acc(
    *,
    width: int = 8,
    optimizers: int = 1,
    schedulers: int = 1,
    scaler: bool = True,
    window: int = WINDOW,
    groups: int = 1,
    covered: int = 4,
    scheduler: type = torch.optim.lr_scheduler.StepLR,
) -> GradientAccumulator:
    """An Adam accumulator; ``covered``: how many of the 4 parameters its one group holds."""
    pipe = Pipeline(_model(width), 2, balance=[2, 1], devices=["cpu", "cpu"], schedule="1f1b")
    params = list(pipe.parameters())
    if optimizers == 2:  # one per stage
        opts = [torch.optim.Adam(s.parameters(), lr=1e-2) for s in pipe.stages]
    elif groups == 2:
        opts = [torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)]
    else:
        opts = [torch.optim.Adam(params[:covered], lr=1e-2)]
    return GradientAccumulator(
        pipe,
        opts if optimizers == 2 else opts[0],
        accumulation_steps=window,
        max_grad_norm=1.0,
        scaler=torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1) if scaler else None,
        lr_scheduler=[
            scheduler(opts[0], 1, 0.9)
            if scheduler is torch.optim.lr_scheduler.StepLR
            else scheduler(opts[0], 0.9)
            for _ in range(schedulers)
        ],
    )


def _train(acc: GradientAccumulator, steps: range, data: int = 100) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(data + step)
        x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
        acc.step(x, y, loss_fn=nn.functional.mse_loss)


def _saved(tmp_path, name: str = "ckpt.pt", **kwargs) -> str:
    acc = _acc(**kwargs)
    _train(acc, range(SAVED_AT))
    path = str(tmp_path / name)
    acc.save(path)
    return path


def _edited(tmp_path, edit) -> str:
    """A fitting checkpoint, changed by ``edit(state)`` (and sealed again with its checksum)."""
    state = torch.load(_saved(tmp_path, "good.pt"), weights_only=False)
    del state[CHECKSUM]
    edit(state)
    state[CHECKSUM] = digest(state)
    path = str(tmp_path / "edited.pt")
    torch.save(state, path)
    return path


def _everything(acc: GradientAccumulator) -> dict:
    return copy.deepcopy(
        {
            "model": acc.pipe.state_dict(),
            "grads": {n: p.grad for n, p in acc.pipe.named_parameters()},
            "optimizers": [o.state_dict() for o in acc.optimizers],
            "schedulers": [s.state_dict() for s in acc.schedulers],
            "loss_scale": acc.loss_scale.state_dict(),
            "fields": [getattr(acc, k) for k in FIELDS],
            "rng": torch.get_rng_state(),
        }
    )


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def _refused_and_unchanged(path: str, *misfit: str, target=None) -> GradientAccumulator:
    """Loads ``path`` into a trained accumulator: refused, naming the file and ``misfit``."""
    acc = target or _acc()
    # Other data than the checkpoint's, so that every value a load writes would
    # differ; a window and a step done: gradients, Adam state, scheduler and scaler moved.
    _train(acc, range(SAVED_AT), data=500)
    before = _everything(acc)
    with pytest.raises(CheckpointError) as info:
        acc.load(path)
    message = str(info.value)
    assert repr(path) in message, message
    for text in misfit:
        assert text in message, message
    _assert_same(before, _everything(acc))
    return acc


def _resumes_exactly(acc: GradientAccumulator, tmp_path) -> None:
    """After the refused load, a fitting checkpoint still resumes bit-identically."""
    reference = _acc()
    _train(reference, range(STEPS))
    reference.flush()
    acc.load(_saved(tmp_path, "fits.pt"))
    assert (acc.steps, acc.windows, acc.position) == (SAVED_AT, 1, 1)
    _train(acc, range(SAVED_AT, STEPS))
    acc.flush()
    _assert_same(_everything(reference)["model"], _everything(acc)["model"])
    _assert_same(_everything(reference)["optimizers"], _everything(acc)["optimizers"])


def test_another_optimizer_count_changes_nothing(tmp_path):
    path = _saved(tmp_path, optimizers=2)
    acc = _refused_and_unchanged(path, "optimizers: 2 in the checkpoint, 1 here", "fix:")
    _resumes_exactly(acc, tmp_path)


def test_another_param_group_size_changes_nothing(tmp_path):
    path = _saved(tmp_path, covered=3)  # Adam over the first 3 of 4 parameters
    message = "optimizer 1 of 1: param group 0 has 3 parameters in the checkpoint, 4 here"
    _resumes_exactly(_refused_and_unchanged(path, message), tmp_path)


def test_another_param_group_count_changes_nothing(tmp_path):
    path = _saved(tmp_path, groups=2)
    message = "optimizer 1 of 1: 2 param groups in the checkpoint, 1 here"
    _resumes_exactly(_refused_and_unchanged(path, message), tmp_path)


@pytest.mark.parametrize("saved", [0, 2])
def test_a_scheduler_more_or_less_changes_nothing(tmp_path, saved):
    path = _saved(tmp_path, schedulers=saved)
    message = f"lr schedulers: {saved} in the checkpoint, 1 here"
    _resumes_exactly(_refused_and_unchanged(path, message), tmp_path)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_scheduler_of_another_class_changes_nothing(tmp_path, sharded):
    """Before, an ExponentialLR took a StepLR's state, its step_size mixed into its own."""
    path = str(tmp_path / "steplr")
    saved = _acc()
    _train(saved, range(SAVED_AT))
    saved.save(path, sharded=sharded)
    target = _acc(scheduler=torch.optim.lr_scheduler.ExponentialLR)
    message = "lr scheduler 1 of 1: the checkpoint was saved from a torch.optim.lr_scheduler.StepLR"
    _refused_and_unchanged(path, message, "ExponentialLR", target=target)


def test_a_checkpoint_without_scaler_changes_nothing(tmp_path):
    path = _saved(tmp_path, scaler=False)
    message = "GradScaler: this accumulator has one, the checkpoint was saved without"
    _resumes_exactly(_refused_and_unchanged(path, message), tmp_path)


def test_a_checkpoint_with_scaler_into_none_changes_nothing(tmp_path):
    path = _saved(tmp_path)
    _refused_and_unchanged(path, "GradScaler: the checkpoint holds", target=_acc(scaler=False))


def test_parameters_of_another_shape_change_nothing(tmp_path):
    path = _saved(tmp_path, width=9)
    acc = _refused_and_unchanged(
        path,
        "model: '0.weight' is (9, 5) torch.float64 in the checkpoint, (8, 5) torch.float64 here",
        "exp_avg of '0.weight' is (9, 5) in the checkpoint, (8, 5) here",
        "window: the gradient of '0.weight' is (9, 5)",
    )
    _resumes_exactly(acc, tmp_path)


def test_another_dtype_changes_nothing(tmp_path):
    def to_float32(state):
        state["model"]["2.bias"] = state["model"]["2.bias"].float()

    path = _edited(tmp_path, to_float32)
    _refused_and_unchanged(path, "model: '2.bias' is (3) torch.float32 in the checkpoint")


def test_missing_and_unexpected_model_keys_change_nothing(tmp_path):
    def rename(state):
        state["model"]["9.weight"] = state["model"].pop("2.weight")

    path = _edited(tmp_path, rename)
    acc = _refused_and_unchanged(
        path,
        "model: missing from the checkpoint: '2.weight'",
        "model: in the checkpoint but not in this model: '9.weight'",
    )
    _resumes_exactly(acc, tmp_path)


def test_on_a_mesh_layers_this_rank_lacks_point_to_the_sharded_checkpoint(tmp_path):
    # On a mesh a rank's state dict holds its own stages; a file of another layout is
    # refused naming the keys and the checkpoint that loads at any layout.
    def rename(state):
        state["model"]["9.weight"] = state["model"].pop("2.weight")

    path = _edited(tmp_path, rename)
    acc = _acc()
    _train(acc, range(SAVED_AT), data=500)
    before = _everything(acc)
    mesh = types.SimpleNamespace(shard_mesh=None)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(CheckpointError) as info:
        patch.setattr(type(acc.pipe), "mesh", property(lambda self: mesh))
        acc.load(path)
    assert "in the checkpoint but not in this model: '9.weight'" in str(info.value)
    assert "acc.save(directory, sharded=True)" in str(info.value)
    _assert_same(before, _everything(acc))


def test_adam_state_of_another_shape_changes_nothing(tmp_path):
    def reshape(state):
        state["optimizers"][0]["state"][2]["exp_avg_sq"] = torch.zeros(8, 9)

    path = _edited(tmp_path, reshape)
    message = "optimizer 1 of 1: exp_avg_sq of '2.weight' is (8, 9) in the checkpoint, (3, 8) here"
    _resumes_exactly(_refused_and_unchanged(path, message), tmp_path)


def test_window_gradients_of_another_shape_change_nothing(tmp_path):
    def reshape(state):
        state["window"]["grads"]["2.bias"] = torch.zeros(4)
        state["window"]["grads"]["7.bias"] = torch.zeros(4)

    path = _edited(tmp_path, reshape)
    acc = _refused_and_unchanged(
        path,
        "window: the gradient of '2.bias' is (4) torch.float64 in the checkpoint, its "
        "parameter (3) torch.float64 here",
        "window: gradients of parameters not in this model: '7.bias'",
    )
    _resumes_exactly(acc, tmp_path)


def test_a_window_longer_than_this_one_changes_nothing(tmp_path):
    path = _saved(tmp_path, window=5)  # 4 steps into a window of 5
    _refused_and_unchanged(path, "window: 4 steps in, but this accumulator's windows are 3")


@pytest.mark.parametrize("drop", ["counters", "window"])
def test_missing_fields_change_nothing(tmp_path, drop):
    path = _edited(tmp_path, lambda state: state.pop(drop))
    _refused_and_unchanged(path, f"lacks {drop!r}")


def test_missing_window_fields_change_nothing(tmp_path):
    path = _edited(tmp_path, lambda state: state["window"].pop("loss_sum"))
    _refused_and_unchanged(path, "window: lacks 'loss_sum'")


def test_load_state_dict_is_checked_too(tmp_path):
    acc = _acc()
    _train(acc, range(SAVED_AT))
    state = _acc(optimizers=2).state_dict()
    before = _everything(acc)
    with pytest.raises(CheckpointError, match="(?s)the state dict does not fit.*optimizers: 2"):
        acc.load_state_dict(state)
    _assert_same(before, _everything(acc))


def test_a_failure_the_checks_miss_is_undone(tmp_path):
    # A custom optimizer hook refuses the state after the model was loaded.
    acc = _acc()

    def refuse(optimizer, state):
        raise RuntimeError("this optimizer wants other state")

    acc.optimizers[0].register_load_state_dict_pre_hook(refuse)
    path = _saved(tmp_path, "other.pt")
    with torch.no_grad():  # the checkpoint's parameters differ from acc's
        for p in acc.pipe.parameters():
            p.add_(1.0)
    acc = _refused_and_unchanged(path, "could not be applied", "was put back", target=acc)
    with pytest.raises(CheckpointError) as info:
        acc.load(path)
    assert isinstance(info.value.__cause__, RuntimeError)


def _unreadable(tmp_path, kind: str) -> str:
    path = tmp_path / "bad.pt"
    with open(_saved(tmp_path, "good.pt"), "rb") as f:
        good = f.read()
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
    return str(path)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "directory"])
def test_an_unreadable_file_raises_checkpoint_error_naming_it(tmp_path, kind):
    path = _unreadable(tmp_path, kind)
    acc = _refused_and_unchanged(path, "cannot be read")
    with pytest.raises(CheckpointError) as info:
        acc.load(path)
    if kind in ("truncated", "directory"):  # the reader's own error, for the details
        assert info.value.__cause__ is not None
    _resumes_exactly(acc, tmp_path)


@pytest.mark.parametrize(
    ("contents", "misfit"),
    [
        (lambda: torch.zeros(3), "holds a Tensor, not a GradientAccumulator checkpoint"),
        (lambda: {"steps": 3}, "lacks 'model'"),
        (lambda: _model().state_dict(), "looks like a model's state_dict"),
    ],
)
def test_a_file_of_other_contents_raises_checkpoint_error_naming_it(tmp_path, contents, misfit):
    path = str(tmp_path / "other.pt")
    torch.save(contents(), path)
    _refused_and_unchanged(path, misfit)


def test_a_missing_file_is_file_not_found(tmp_path):
    # Python's convention, kept: `except FileNotFoundError` means "no checkpoint yet".
    with pytest.raises(FileNotFoundError):
        _acc().load(str(tmp_path / "absent.pt"))


_SAVER = textwrap.dedent(
    """
    import sys
    import torch
    from pipesched.train.state import load_checkpoint, save_checkpoint

    state = load_checkpoint(sys.argv[1])
    state["padding"] = torch.zeros(4_000_000)  # 16 MB: each save takes a while
    print("ready", flush=True)
    while True:
        save_checkpoint(state, sys.argv[1])
    """
)


def _temp_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def _kill_mid_save(path: str, directory) -> None:
    """Runs a process that saves to ``path`` in a loop and SIGKILLs it while a save writes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for _ in range(5):  # a kill that lands between two saves leaves nothing: try again
        command = [sys.executable, "-c", _SAVER, path]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            deadline = time.monotonic() + 60
            while not _temp_files(directory) and time.monotonic() < deadline:
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)  # reaped: its pid is no longer alive
        if _temp_files(directory):
            return
    pytest.fail("no save was ever killed mid-write")


def test_a_save_killed_with_sigkill_leaves_the_old_file_and_no_litter(tmp_path):
    path = _saved(tmp_path)
    _kill_mid_save(path, tmp_path)
    assert len(_temp_files(tmp_path)) == 1  # what the killed save was writing
    acc = _acc()
    acc.load(path)  # the previous file (or a complete later one) still loads
    _train(acc, range(SAVED_AT, STEPS))
    reference = _acc()
    _train(reference, range(STEPS))
    _assert_same(_everything(reference)["model"], _everything(acc)["model"])
    acc.save(path)  # the next save to the same path removes the leftover
    assert _temp_files(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_stale_temp_files_of_dead_processes_of_this_target_only_are_removed(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    host = _HOST  # the host name as temporary files spell it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    names = {
        "stale": f".ckpt.pt.pipesched-{host}-{dead.pid}-abc123.tmp",
        "live": f".ckpt.pt.pipesched-{host}-{os.getppid()}-abc123.tmp",
        "own": f".ckpt.pt.pipesched-{host}-{os.getpid()}-abc123.tmp",
        "other host": f".ckpt.pt.pipesched-elsewhere-{dead.pid}-abc123.tmp",
        "other target": f".other.pt.pipesched-{host}-{dead.pid}-abc123.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    _acc().save(path)
    left = set(os.listdir(tmp_path))
    assert names["stale"] not in left
    assert {names[k] for k in ("live", "own", "other host", "other target")} <= left
    assert remove_stale_temp_files(path) == []


def _sgd(momentum: float = 0.9) -> GradientAccumulator:
    """Like :func:`_acc`, with SGD (momentum) instead of Adam."""
    pipe = Pipeline(_model(), 2, balance=[2, 1], devices=["cpu", "cpu"], schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-2, momentum=momentum)
    return GradientAccumulator(
        pipe,
        opt,
        accumulation_steps=WINDOW,
        max_grad_norm=1.0,
        scaler=torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1),
        lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, 0.9),
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_another_optimizer_type_changes_nothing(tmp_path, sharded):
    # Issue 25 item 2: Adam's checkpoint into SGD(momentum) was accepted, SGD's groups became
    # Adam's (no "momentum") and the next window end raised KeyError: 'momentum'.
    acc = _acc()
    _train(acc, range(SAVED_AT))
    path = str(tmp_path / ("ckpt" if sharded else "ckpt.pt"))
    acc.save(path, sharded=sharded)
    target = _refused_and_unchanged(
        path, "torch.optim.adam.Adam", "torch.optim.sgd.SGD", target=_sgd()
    )
    _train(target, range(SAVED_AT, STEPS))  # and it still trains as it was
    assert target.windows == STEPS // WINDOW


def test_an_old_checkpoint_without_types_is_checked_by_its_param_groups(tmp_path):
    state = torch.load(_saved(tmp_path, "good.pt"), weights_only=False)
    del state["optimizer_types"], state[CHECKSUM]  # as written before either was recorded
    path = str(tmp_path / "old.pt")
    torch.save(state, path)
    _refused_and_unchanged(path, "lacks 'dampening', 'momentum'", target=_sgd())
    fits = _acc()
    fits.load(path)  # into the optimizer it came from: loads
    assert fits.steps == SAVED_AT


def test_ctrl_c_during_a_save_is_a_keyboard_interrupt_and_leaves_the_old_file(
    tmp_path, monkeypatch, ctrl_c
):
    # Issue 25 item 10: torch's writer turned the Ctrl-C into
    # "RuntimeError: [enforce fail at inline_container.cc]".
    path = _saved(tmp_path)
    good = Path(path).read_bytes()
    acc = _acc()
    _train(acc, range(SAVED_AT + 1))
    real = os.fdopen

    class Interrupted:  # the file a save writes: Ctrl-C comes on its third write
        def __init__(self, f) -> None:
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                signal.raise_signal(signal.SIGINT)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Interrupted(real(*a, **k)))
    with pytest.raises(KeyboardInterrupt):
        acc.save(path)
    monkeypatch.undo()
    assert Path(path).read_bytes() == good
    assert _temp_files(tmp_path) == []
    acc.save(path)  # and the next save goes through
    _acc().load(path)


class _TiedLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 12, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


def _lm_acc(tied: bool) -> GradientAccumulator:
    pipe = Pipeline(_TiedLM(tied), chunks=2, devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    return GradientAccumulator(pipe, optimizer, accumulation_steps=2)


def _lm_steps(acc: GradientAccumulator, steps: int) -> None:
    ids = torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        acc.step(
            ids, ids, loss_fn=lambda o, y: nn.functional.cross_entropy(o.flatten(0, 1), y.flatten())
        )


@pytest.mark.parametrize("saved_tied", [False, True])
def test_a_sharded_checkpoint_tied_otherwise_than_the_model_changes_nothing(tmp_path, saved_tied):
    """Before, it loaded: the tied model took one of the two saved weights (and its Adam
    state); the untied one gave both names the tied gradient, counted twice."""
    saved = _lm_acc(saved_tied)
    _lm_steps(saved, 3)  # a window and a step: the untied weights differ, a gradient is in
    path = str(tmp_path / "ckpt")
    saved.save(path, sharded=True)
    acc = _lm_acc(not saved_tied)
    _lm_steps(acc, 1)
    before = _everything(acc)
    with pytest.raises(CheckpointError, match="ties its weights otherwise than this model"):
        acc.load(path)
    _assert_same(before, _everything(acc))
    same = _lm_acc(saved_tied)  # tied alike: it loads
    same.load(path)
    _assert_same(_everything(saved)["model"], _everything(same)["model"])
