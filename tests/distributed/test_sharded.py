"""One sharded checkpoint, saved at pp=2 x dp=1 mid-window, resumed at other layouts.

The reference is the uninterrupted run in one process. Resumed at pp=1 in
one process, at pp=2 x dp=2 (4 processes) and at pp=4 with another balance,
two windows later the parameters equal it (fp64, rtol 1e-12); randomness
(Dropout) continues too where the micro-batches stay the same rows. The
pp=2 x dp=2 MLP and one traced run are built on the meta device: each rank
allocates only its stages and fills them from the checkpoint. A rank
killed while writing a newer version leaves the older one loadable; a rank
whose model does not fit makes every rank refuse the load, unchanged; the
checkpoint exports to the plain model's state dict.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched.train import export_model
from tests.distributed import sharded_worker as w
from tests.distributed.launch import launch

WORKER = Path(w.__file__)


def _reference(name: str, steps: int) -> dict[str, torch.Tensor]:
    """The same training, uninterrupted, in one process (pipesched's local runtime)."""
    torch.manual_seed(1)
    acc = w.accumulator(w.pipeline(w.model(name), 2, None))
    w.train(acc, range(steps), 0, 1)
    return w.own_parameters(acc.pipe)


def _assert_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str):
    for name, value in got.items():
        torch.testing.assert_close(
            value, expected[name], rtol=1e-12, atol=1e-14, msg=f"{where}: {name}"
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``save`` at pp=2: two checkpoints, the second save of one killed on rank 1."""
    out = tmp_path_factory.mktemp("sharded")
    torch.set_default_dtype(torch.float64)
    try:
        exits = launch("save", 2, out, timeout=90, worker=WORKER)
    finally:
        torch.set_default_dtype(torch.float32)
    codes = [e.code for e in exits]
    assert codes[1] == 3, exits[1].output  # died writing its shards, as told
    assert codes[0] not in (0, None), exits[0].output  # failed with it, did not hang
    return out


def test_saved_at_pp2_equals_reference_and_exports(saved: Path) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        for name in ("traced", "drop", "plain"):
            expected = _reference(name, w.SAVE_AT)
            got = {}
            for rank in range(2):
                got.update(torch.load(saved / f"rank{rank}.pt")[name])
            assert set(got) == set(expected)
            _assert_params(got, expected, f"{name} at the save")
            exported = saved / f"{name}.pt"
            export_model(str(saved / name), str(exported))
            plain = w.model(name)
            plain.load_state_dict(torch.load(exported), strict=True)
            _assert_params(dict(plain.named_parameters()), expected, f"{name} exported")
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize(
    ("scenario", "world"),
    [
        ("resume-drop-1x1", 1),
        ("resume-drop-4x1", 4),
        ("resume-traced-1x1", 1),
        ("resume-traced-2x2", 4),
        ("resume-metaplain-2x2", 4),
        ("resume-metatraced-2x1", 2),
    ],
)
def test_resumes_at_another_layout(saved: Path, scenario: str, world: int) -> None:
    name = scenario.split("-")[1].removeprefix("meta")
    torch.set_default_dtype(torch.float64)
    try:
        if world == 1:  # one process, no mesh
            w.main(scenario, saved)
        else:
            exits = launch(scenario, world, saved, timeout=90, worker=WORKER)
            assert all(e.code == 0 for e in exits), [e.output for e in exits]
        expected = _reference(name, w.TOTAL)
    finally:
        torch.set_default_dtype(torch.float32)
    got: dict[str, torch.Tensor] = {}
    for rank in range(world):
        record = torch.load(saved / f"{scenario}-rank{rank}.pt")
        assert (record["steps"], record["windows"]) == (w.TOTAL, w.TOTAL // w.STEPS)
        got.update(record["params"])
    assert set(got) == set(expected)
    _assert_params(got, expected, scenario)


def test_a_misfit_on_one_rank_stops_every_rank_unchanged(saved: Path) -> None:
    exits = launch("misfit", 2, saved, timeout=60, worker=WORKER)
    assert all(e.code == 0 for e in exits), [e.output for e in exits]
    records = [torch.load(saved / f"misfit-rank{rank}.pt") for rank in range(2)]
    for record in records:
        assert record["unchanged"] and record.get("absent")
        assert "rank 1:" in record["error"] and "'7.weight'" in record["error"], record["error"]
        assert "rank 0:" not in record["error"]


def test_load_model_reads_plain_weights_on_each_rank(saved: Path) -> None:
    export_model(str(saved / "plain"), str(saved / "plain.pt"))
    expected = torch.load(saved / "plain.pt")
    exits = launch("weights", 2, saved, timeout=60, worker=WORKER)
    assert all(e.code == 0 for e in exits), [e.output for e in exits]
    records = [torch.load(saved / f"weights-rank{rank}.pt") for rank in range(2)]
    for source in ("plain.pt", "plain"):
        got = {n: v for record in records for n, v in record[source].items()}
        assert set(got) == {k for k in expected if k.endswith(("weight", "bias"))}
        for name, value in got.items():
            assert torch.equal(value, expected[name]), (source, name)
    for record in records:
        assert record["unchanged"]
        assert "rank 1:" in record["error"] and "'7.weight'" in record["error"], record["error"]


def test_reference_differs_without_the_resume() -> None:
    """The comparison can fail: another step count gives other parameters."""
    torch.set_default_dtype(torch.float64)
    try:
        a, b = _reference("plain", w.TOTAL), _reference("plain", w.TOTAL - 1)
    finally:
        torch.set_default_dtype(torch.float32)
    assert not all(torch.allclose(a[n], b[n], rtol=1e-6) for n in a)


def test_plain_model_loads_export_strictly(saved: Path) -> None:
    out = saved / "plain-export.pt"
    export_model(str(saved / "plain"), str(out))
    state = torch.load(out)
    assert set(state) == set(w.mlp(0.0).state_dict())
    with pytest.raises(RuntimeError):  # strict: another model refuses it
        nn.Sequential(nn.Linear(6, w.WIDTH)).load_state_dict(state, strict=True)


def test_each_rank_records_its_files_crc_and_a_changed_file_of_rank_1_is_refused(
    saved: Path, tmp_path: Path
) -> None:
    import json
    import shutil
    import zlib

    from pipesched.errors import CheckpointError

    checkpoint = tmp_path / "plain"
    shutil.copytree(saved / "plain", checkpoint)
    version = checkpoint / (checkpoint / "latest").read_text().strip()
    records = {r: json.loads((version / f".crc32-{r}.json").read_text()) for r in range(2)}
    keys = [k for r in records.values() for k in r]
    assert len(keys) == len(set(keys))  # each recorded once
    spans = {k: k.split("@") for k in keys if "@" in k}
    assert {n for n, _ in spans.values()} == {p.name for p in version.glob("*.distcp")}
    assert records[1] and all(k.startswith("__1_") for k in records[1])  # its own bytes
    assert ".metadata" in records[0]
    for key, crc in {**records[0], **records[1]}.items():
        name, _, where = key.partition("@")
        data = (version / name).read_bytes()
        if where:
            offset, length = map(int, where.split("+"))
            data = data[offset : offset + length]
        assert zlib.crc32(data) == crc, key
    covered = sum(int(k.split("+")[1]) for k in records[1])
    assert covered == sum(p.stat().st_size for p in version.glob("__1_*.distcp"))
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(str(version)).read_metadata().storage_data
    info = next(  # a weight rank 1 wrote: export reads it
        i for x, i in storage.items() if x.fqn.startswith("model/") and "__1_" in i.relative_path
    )
    shard = version / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"the file {shard.name!r} \(bytes"):
        export_model(str(checkpoint), str(tmp_path / "out.pt"))
    assert not (tmp_path / "out.pt").exists()
