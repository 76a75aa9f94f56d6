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


def _refused_before_unpickling(acc: GradientAccumulator, bad: str, before) -> str:
    """Loads ``bad`` into ``acc``: refused by the file check, naming it; ``acc`` unchanged."""
    with pytest.raises(CheckpointError) as info:
        acc.load(bad)
    message = str(info.value)
    assert "is not what was saved" in message or "cannot be read" in message, message
    after = _state(acc)
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return message


def test_every_flipped_byte_of_the_pickle_and_of_each_tensor_is_refused_before_unpickling(
    tmp_path, monkeypatch
):
    # Issue 25 item 3: one byte changed mid-file loaded, with a different '9.weight'.
    # And CI's stop 39: a flip that turned an opcode into a memo index near 2**32 made
    # the unpickler allocate until the kernel killed the test run. Which byte did it
    # depended on the pickle's layout (Python's RNG state is saved: its length varies),
    # so every byte is flipped here, and none may reach the unpickler.
    saved = _trained(3)
    path = str(tmp_path / "ckpt.pt")
    saved.save(path)
    regions = _regions(path)
    pickle_name = next(n for n in regions if n.endswith("data.pkl"))
    start, length = regions[pickle_name]
    positions = {pickle_name: range(start, start + length)}
    for name, (first, size) in regions.items():  # every tensor: its first, middle, last byte
        if "/data/" in name and size:
            positions[name] = sorted({first, first + size // 2, first + size - 1})
    acc = _trained(3, data=50)  # other weights: any write would show
    before = _state(acc)
    unpickled = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or 1 / 0)
    bad = str(tmp_path / "bad.pt")
    for name, where in positions.items():
        for position in where:
            message = _refused_before_unpickling(acc, _flipped(path, position, bad), before)
            assert repr(bad) in message and repr(name) in message, message
    assert not unpickled
    monkeypatch.undo()
    acc.load(path)  # the good file still loads, exactly
    assert all(torch.equal(v, _state(saved)[k]) for k, v in _state(acc).items())


def test_a_changed_first_byte_is_refused_unread_not_taken_for_torchs_legacy_format(
    tmp_path, monkeypatch
):
    # torch.load reads a file that does not open with a zip's signature as its legacy
    # format: it would unpickle the zip's bytes (some values of byte 0 raised MemoryError).
    saved = _trained(3)
    path = str(tmp_path / "ckpt.pt")
    saved.save(path)
    acc = _trained(3, data=50)
    before = _state(acc)
    unpickled = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or 1 / 0)
    data = Path(path).read_bytes()
    bad = tmp_path / "bad.pt"
    for position in range(4):
        for mask in range(1, 256):
            changed = bytearray(data)
            changed[position] ^= mask
            bad.write_bytes(bytes(changed))
            message = _refused_before_unpickling(acc, str(bad), before)
            assert "its first bytes" in message, message
    assert not unpickled


def test_a_flipped_byte_anywhere_else_in_the_file_is_refused_or_harmless(tmp_path):
    saved = _trained(3)
    path = str(tmp_path / "ckpt.pt")
    saved.save(path)
    expected = _state(saved)
    size = os.path.getsize(path)
    content = [range(start, start + length) for start, length in _regions(path).values()]
    acc = _trained(3, data=50)
    before = _state(acc)
    for position in range(0, size, 97):  # zip headers, padding and directory included
        bad = _flipped(path, position, str(tmp_path / "bad.pt"))
        try:
            acc.load(bad)
        except CheckpointError as err:
            assert repr(bad) in str(err), str(err)
            assert all(torch.equal(before[k], v) for k, v in _state(acc).items()), position
            continue
        assert not any(position in r for r in content), position  # a record's byte: refused
        got = _state(acc)  # a field no reader uses, or padding: loads exactly what was saved
        assert all(torch.equal(expected[k], got[k]) for k in expected), position
        before = got


@pytest.fixture
def crcs_off():
    """torch.save told to write no CRC-32 (``set_crc32_options(False)``) for the test."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(previous)


def test_every_record_has_a_crc_even_where_torch_is_told_to_skip_them(tmp_path, crcs_off):
    saved = _trained(3)
    path = str(tmp_path / "ckpt.pt")
    saved.save(path)
    with zipfile.ZipFile(path) as z:
        assert all(info.CRC for info in z.infolist() if info.file_size)
        assert z.testzip() is None  # and the right ones
    assert torch.serialization.get_crc32_options() is False  # the user's setting, put back


def test_a_state_dict_saved_without_crcs_loads_checked_by_its_contents(tmp_path, crcs_off):
    # torch.save(acc.state_dict()) with torch's CRCs off: nothing for the file check,
    # which leaves it to the contents (here none: a state dict carries no checksum).
    saved = _trained(3)
    path = str(tmp_path / "state.pt")
    torch.save(saved.state_dict(), path)
    with zipfile.ZipFile(path) as z:
        assert not any(info.CRC for info in z.infolist())
    acc = _trained(3, data=50)
    acc.load(path)
    assert all(torch.equal(v, _state(saved)[k]) for k, v in _state(acc).items())


def _sharded(tmp_path) -> tuple[GradientAccumulator, Path, Path]:
    saved = _trained(3)
    directory = tmp_path / "ckpt"
    saved.save(str(directory), sharded=True)
    return saved, directory, directory / (directory / "latest").read_text().strip()


def test_a_flipped_byte_in_any_file_of_a_sharded_checkpoint_is_refused_naming_it(
    tmp_path, monkeypatch
):
    saved, directory, version = _sharded(tmp_path)
    expected = _state(saved)
    files = sorted(p for p in version.iterdir() if not p.name.startswith(".crc32-"))
    assert any(p.name == ".metadata" for p in files) and any(p.suffix == ".distcp" for p in files)
    acc = _trained(3, data=50)
    before = _state(acc)
    import torch.distributed.checkpoint.filesystem as fs

    read: list[tuple[str, int, int]] = []  # the bytes DCP's reader was asked for
    original = fs.FileSystemReader.read_data

    def spied(self, plan, planner):
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            read.append((info.relative_path, info.offset, info.offset + info.length))
        return original(self, plan, planner)

    monkeypatch.setattr(fs.FileSystemReader, "read_data", spied)
    for file in files:
        good = file.read_bytes()
        for position in range(0, len(good), max(1, len(good) // 200)):
            bad = bytearray(good)
            bad[position] ^= 0x5A
            file.write_bytes(bytes(bad))
            read.clear()
            message = _refused_before_unpickling(acc, str(directory), before)
            assert str(version) in message and repr(file.name) in message, message
            # Only bytes as saved were read: the changed one never reached DCP's reader.
            assert not any(n == file.name and a <= position < b for n, a, b in read), position
        file.write_bytes(good)
    monkeypatch.undo()
    acc.load(str(directory))
    assert all(torch.equal(expected[k], v) for k, v in _state(acc).items())


def test_a_sharded_checkpoint_without_file_records_is_checked_by_its_contents(tmp_path):
    # As one saved before the records were, or copied without them: the content
    # checksums still refuse a changed weight, and name it and its file.
    _, directory, version = _sharded(tmp_path)
    for record in version.glob(".crc32-*.json"):
        record.unlink()
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


def test_a_damaged_record_file_refuses_the_checkpoint(tmp_path):
    _, directory, version = _sharded(tmp_path)
    record = next(version.glob(".crc32-*.json"))
    record.write_text(record.read_text()[:-3])
    acc = _trained(3, data=50)
    before = _state(acc)
    message = _refused_before_unpickling(acc, str(directory), before)
    assert repr(record.name) in message, message


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


def test_a_save_whose_records_cannot_be_written_commits_nothing(tmp_path, monkeypatch):
    import pipesched.train.store as store

    acc, directory, _ = _sharded(tmp_path)
    committed = (directory / "latest").read_text()

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "record", disk_full)
    with pytest.raises(CheckpointError, match="No space left.*nothing was committed"):
        acc.save(str(directory), sharded=True)
    assert (directory / "latest").read_text() == committed
    monkeypatch.undo()
    fresh = _trained(3, data=50)
    fresh.load(str(directory))
    assert all(torch.equal(v, _state(acc)[k]) for k, v in _state(fresh).items())


def test_a_file_replaced_between_its_check_and_its_load_loads_what_was_checked(
    tmp_path, monkeypatch
):
    # Another process saving to the same path (an atomic rename) while this one loads:
    # torch.load opens by name, and must still read the file that was checked.
    saved, other = _trained(3), _trained(5, data=9)
    path, newer = str(tmp_path / "ckpt.pt"), str(tmp_path / "newer.pt")
    saved.save(path)
    other.save(newer)
    acc = _trained(3, data=50)
    load = torch.load

    def replaced_first(*args, **kwargs):
        os.replace(newer, path)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", replaced_first)
    acc.load(path)
    assert all(torch.equal(v, _state(saved)[k]) for k, v in _state(acc).items())
    monkeypatch.undo()
    acc.load(path)  # and the next load, the newer one
    assert all(torch.equal(v, _state(other)[k]) for k, v in _state(acc).items())


def test_a_changed_first_byte_of_a_zip_without_crcs_is_refused_unread(
    tmp_path, crcs_off, monkeypatch
):
    saved = _trained(3)
    path = tmp_path / "state.pt"
    torch.save(saved.state_dict(), path)  # torch's own save: no CRC
    data = bytearray(path.read_bytes())
    data[0] ^= 0x5A
    path.write_bytes(bytes(data))
    acc = _trained(3, data=50)
    unpickled = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or 1 / 0)
    message = _refused_before_unpickling(acc, str(path), _state(acc))
    assert "its first bytes" in message and not unpickled, message


@pytest.mark.parametrize("protocol", [1, 2, 4, 5])
def test_a_state_dict_in_torchs_legacy_format_still_loads(tmp_path, protocol):
    saved = _trained(3)
    path = str(tmp_path / "legacy.pt")
    torch.save(
        saved.state_dict(), path, _use_new_zipfile_serialization=False, pickle_protocol=protocol
    )
    acc = _trained(3, data=50)
    acc.load(path)
    assert all(torch.equal(v, _state(saved)[k]) for k, v in _state(acc).items())


def test_a_sharded_save_never_reads_its_metadata_back(tmp_path, monkeypatch):
    # Where each node has its own disk, only rank 0's holds .metadata: no rank may need it.
    import torch.distributed.checkpoint.filesystem as fs

    def unreadable(self, *args, **kwargs):
        raise FileNotFoundError(".metadata is on rank 0's disk")

    monkeypatch.setattr(fs.FileSystemReader, "read_metadata", unreadable)
    saved = _trained(3)
    saved.save(str(tmp_path / "ckpt"), sharded=True)
    monkeypatch.undo()
    acc = _trained(3, data=50)
    acc.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, _state(saved)[k]) for k, v in _state(acc).items())


def test_a_changed_byte_in_the_latest_pointer_is_refused_naming_it(tmp_path):
    # Found trying the change as a user: a byte 0x89 there raised UnicodeDecodeError.
    _, directory, _ = _sharded(tmp_path)
    pointer = directory / "latest"
    good = pointer.read_bytes()
    acc = _trained(3, data=50)
    before = _state(acc)
    for position in range(len(good)):
        for mask in (0x01, 0x20, 0xFF):
            bad = bytearray(good)
            bad[position] ^= mask
            pointer.write_bytes(bytes(bad))
            if bytes(bad).strip() == good.strip():
                continue  # only the line's end changed: the same version
            with pytest.raises(CheckpointError, match="'latest'"):
                acc.load(str(directory))
            assert all(torch.equal(before[k], v) for k, v in _state(acc).items())
