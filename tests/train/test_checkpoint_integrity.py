"""A checkpoint is what was saved (INVARIANT 34): a flipped byte anywhere is refused or harmless.

A byte flipped in a tensor's data, or anywhere in the pickle, is refused by
``load`` with a CheckpointError naming the file, before anything changes; a
flip that leaves the contents as saved (an unused memo index, a zip header
field the reader ignores) may load, and then loads exactly what was saved.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("fp64")


def _acc() -> GradientAccumulator:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    pipe = Pipeline(model, 2, balance=[2, 1], devices=["cpu", "cpu"])
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    return GradientAccumulator(
        pipe, optimizer, accumulation_steps=2,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9),
    )  # fmt: skip


def _trained(steps: int, data: int = 0) -> GradientAccumulator:
    acc = _acc()
    for step in range(steps):
        g = torch.Generator().manual_seed(data + step)
        acc.step(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g),
                 loss_fn=nn.functional.mse_loss)  # fmt: skip
    return acc


def _state(acc: GradientAccumulator) -> dict[str, torch.Tensor]:
    return {
        **{f"p/{n}": p.detach().clone() for n, p in acc.pipe.named_parameters()},
        **{f"g/{n}": p.grad.clone() for n, p in acc.pipe.named_parameters() if p.grad is not None},
    }


def _regions(path: str) -> dict[str, tuple[int, int]]:
    """Each zip entry's data: (offset, length) in the file."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        regions = {}
        for info in z.infolist():
            f.seek(info.header_offset + 26)
            name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
            start = info.header_offset + 30 + name_length + extra_length
            regions[info.filename] = (start, info.compress_size)
    return regions


def _flipped(path: str, position: int, out: str) -> str:
    data = bytearray(Path(path).read_bytes())
    data[position] ^= 0x5A
    with open(out, "wb") as f:
        f.write(data)
    return out


def test_a_flipped_byte_in_any_tensor_or_in_the_pickle_is_refused_naming_the_file(tmp_path):
    # Issue 25 item 3: one byte changed mid-file loaded, with a different '9.weight'.
    saved = _trained(3)
    path = str(tmp_path / "ckpt.pt")
    saved.save(path)
    expected = _state(saved)
    regions = _regions(path)
    pickle_name = next(n for n in regions if n.endswith("data.pkl"))
    positions = []
    for name, (start, length) in regions.items():  # every tensor's data: its middle byte
        if "/data/" in name and length:
            positions.append(("tensor " + name, start + length // 2))
    start, length = regions[pickle_name]
    positions += [("pickle", start + i) for i in range(0, length, max(1, length // 40))]
    acc = _trained(3, data=50)  # other weights: any write would show
    before = _state(acc)
    refused = {"tensor": 0, "pickle": 0}
    for kind, position in positions:
        bad = _flipped(path, position, str(tmp_path / "bad.pt"))
        try:
            acc.load(bad)
        except CheckpointError as err:
            assert repr(bad) in str(err), str(err)
            refused[kind.split()[0]] += 1
            after = _state(acc)
            assert after.keys() == before.keys()
            assert all(torch.equal(before[k], after[k]) for k in before), (kind, position)
            continue
        # A flip that changed nothing the checkpoint holds: it loads exactly what was saved.
        got = _state(acc)
        assert all(torch.equal(expected[k], got[k]) for k in expected), (kind, position)
        before = got
    tensors = sum(1 for kind, _ in positions if kind.startswith("tensor"))
    assert refused["tensor"] == tensors  # every tensor byte is content
    assert refused["pickle"] >= 0.9 * (len(positions) - tensors), refused
    os.unlink(str(tmp_path / "bad.pt"))
    acc.load(path)  # the good file still loads
    assert all(torch.equal(expected[k], v) for k, v in _state(acc).items())


def test_a_flipped_byte_in_a_sharded_checkpoint_is_refused_naming_the_file(tmp_path):
    saved = _trained(3)
    directory = tmp_path / "ckpt"
    saved.save(str(directory), sharded=True)
    expected = _state(saved)
    version = directory / (directory / "latest").read_text().strip()
    shards = sorted(p for p in version.iterdir() if p.suffix == ".distcp")
    acc = _trained(3, data=50)
    before = _state(acc)
    for shard in shards:
        good = shard.read_bytes()
        size = len(good)
        for position in (size // 7, size // 2, size - size // 5):
            bad = bytearray(good)
            bad[position] ^= 0x5A
            shard.write_bytes(bytes(bad))
            try:
                acc.load(str(directory))
            except CheckpointError as err:
                assert str(directory) in str(err), str(err)
                after = _state(acc)
                assert all(torch.equal(before[k], after[k]) for k in before), position
            else:  # only where the flip changed nothing the checkpoint holds
                got = _state(acc)
                assert all(torch.equal(expected[k], got[k]) for k in expected), position
                before = got
        shard.write_bytes(good)
    acc.load(str(directory))
    assert all(torch.equal(expected[k], v) for k, v in _state(acc).items())


def test_a_flipped_tensor_byte_in_a_sharded_checkpoint_names_its_file(tmp_path):
    saved = _trained(3)
    directory = tmp_path / "ckpt"
    saved.save(str(directory), sharded=True)
    version = directory / (directory / "latest").read_text().strip()
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(str(version)).read_metadata().storage_data
    _, info = next((i, s) for i, s in storage.items() if i.fqn == "model/0.weight")
    shard = version / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01  # one bit of one weight
    shard.write_bytes(bytes(data))
    acc = _acc()
    with pytest.raises(CheckpointError, match=rf"'model/0.weight' in '{info.relative_path}'"):
        acc.load(str(directory))


def test_ctrl_c_during_a_sharded_save_is_a_keyboard_interrupt_and_commits_nothing(
    tmp_path, monkeypatch
):
    # torch.distributed.checkpoint wraps whatever its writer raises in its own
    # CheckpointException (a BaseException): a Ctrl-C came out as that.
    import torch.distributed.checkpoint.filesystem as files

    acc = _trained(3)
    directory = tmp_path / "ckpt"
    acc.save(str(directory), sharded=True)
    committed = (directory / "latest").read_text()
    write = files.FileSystemWriter.write_data

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        acc.save(str(directory), sharded=True)

    def fails(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(files.FileSystemWriter, "write_data", fails)
    with pytest.raises(CheckpointError, match="disk full"):
        acc.save(str(directory), sharded=True)
    monkeypatch.setattr(files.FileSystemWriter, "write_data", write)
    assert (directory / "latest").read_text() == committed
    _acc().load(str(directory))  # the previous version still loads
