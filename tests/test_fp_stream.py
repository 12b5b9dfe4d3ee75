"""The fp stream spilled to disk (quant/fp_stream.py): background writes, a block read ahead, failures named.

The calibration-level property (kept, spilled and recomputed streams give the same lattice bytes, a killed run's
spill cleared) is in tests/test_quantize_whisper.py; the reader is fuzzed in tests/test_fuzz_readers.py."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from tarq_deploy.quant.fp_stream import FpSpill, FpSpillError, InMemory


def layer(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(30, 8, generator=g)
    return {"q": x, "k": x, "v": x, "fc2": torch.randn(30, 32, generator=g)}, torch.randn(30, 8, generator=g)


def test_written_in_the_background_and_read_back_bit_for_bit(tmp_path: Path) -> None:
    spill = FpSpill(tmp_path / "fp-stream")
    spill.clear()
    spill.prefetch = True
    try:
        entries = {(b, w): spill.write(f"b{b}", w, *layer(10 * b + w)) for b in range(3) for w in range(5)}
        spill.flush()
        assert len(list(spill.directory.iterdir())) == 15
        for (b, w), entry in entries.items():
            entry.prefetch()
            inputs, output = entry.take()
            expected_inputs, expected_output = layer(10 * b + w)
            assert set(inputs) == set(expected_inputs)
            assert all(torch.equal(inputs[rel], expected_inputs[rel]) for rel in inputs)
            assert torch.equal(output, expected_output)
            assert inputs["k"] is inputs["q"] is inputs["v"]  # one tensor on disk, as in memory
            assert not entry.path.exists()  # read once, then gone
    finally:
        spill.remove()
    assert not spill.directory.exists()


def test_without_prefetch_a_read_happens_at_take(tmp_path: Path) -> None:
    spill = FpSpill(tmp_path / "s")
    spill.clear()
    entry = spill.write("b", 0, *layer(1))
    entry.prefetch()  # the budget held one block only: nothing read ahead
    assert entry._read is None
    assert torch.equal(entry.take()[1], layer(1)[1])
    spill.remove()


def test_a_failed_background_write_is_raised_at_flush(tmp_path: Path) -> None:
    spill = FpSpill(tmp_path / "s")
    spill.clear()
    spill.directory.rmdir()  # the folder vanishes under the writer
    spill.write("b", 0, *layer(2))
    with pytest.raises(OSError) as failure:
        spill.flush()
    assert failure.value.errno == errno.ENOENT
    spill.remove()


def test_a_file_changed_under_the_run_is_named(tmp_path: Path) -> None:
    spill = FpSpill(tmp_path / "s")
    spill.clear()
    entry = spill.write("b", 0, *layer(3))
    spill.flush()
    entry.path.write_bytes(entry.path.read_bytes()[:100])
    with pytest.raises(FpSpillError, match=r"b\.w00000\.safetensors"):
        entry.take()
    spill.remove()


def test_clear_removes_a_killed_runs_files_and_has_room_reads_the_disk(tmp_path: Path) -> None:
    spill = FpSpill(tmp_path / "work" / "fp-stream")
    assert spill.has_room(1 << 20)  # the folder need not exist yet: its nearest existing parent's disk
    assert not spill.has_room(1 << 62)
    spill.directory.mkdir(parents=True)
    (spill.directory / "stale.safetensors").write_bytes(b"junk")
    spill.clear()
    assert list(spill.directory.iterdir()) == []
    spill.remove()


def test_in_memory_entries_hand_back_the_tensors_themselves() -> None:
    inputs, output = layer(4)
    entry = InMemory(inputs, output)
    entry.prefetch()
    assert entry.take()[0] is inputs and entry.take()[1] is output
