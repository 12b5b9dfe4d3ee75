"""The importance matrix as llama.cpp's imatrix GGUF: saved by `quantize --method imatrix --save-imatrix`, reused by
`--imatrix` for the same lattice bytes, and read in the layout llama.cpp's own tools write (checked with gguf-py,
the reference reader and writer)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tarq_deploy import cli
from tarq_deploy.formats.gguf_file import GGUFFileError
from tarq_deploy.formats.imatrix_gguf import Imatrix, ImatrixFileError, read_imatrix, write_imatrix
from tarq_deploy.data.real_clips import all_real_clips

MODEL = "packaged:tiny.en"


def llama_cpp_style_file(path: Path, entries: dict[str, tuple[np.ndarray, float]]) -> None:
    """What llama-imatrix writes, made with gguf-py's own writer: general.type, the three imatrix keys, NAME.in_sum2
    and NAME.counts in F32."""
    writer = gguf.GGUFWriter(path, arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", ["wiki.train.raw"])
    writer.add_uint32("imatrix.chunk_count", 100)
    writer.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, count) in entries.items():
        writer.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        writer.add_tensor(f"{name}.counts", np.array([count], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_our_file_is_llama_cpps_layout_and_theirs_reads_here(tmp_path):
    ours = Imatrix(datasets=["calib.jsonl"], chunk_count=3)
    ours.add("model.encoder.layers.0.fc1.weight", np.array([4.0, 1.5, 0.0], np.float32), 12)
    write_imatrix(ours, tmp_path / "ours.gguf")
    reader = gguf.GGUFReader(tmp_path / "ours.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.type"] == "imatrix" and fields["imatrix.datasets"] == ["calib.jsonl"]
    assert fields["imatrix.chunk_count"] == 3 and fields["imatrix.chunk_size"] == 0
    tensors = {t.name: t for t in reader.tensors}
    assert {n: t.tensor_type.name for n, t in tensors.items()} == {
        "model.encoder.layers.0.fc1.weight.in_sum2": "F32", "model.encoder.layers.0.fc1.weight.counts": "F32"}
    assert np.array_equal(tensors["model.encoder.layers.0.fc1.weight.in_sum2"].data, [4.0, 1.5, 0.0])

    sums = np.random.default_rng(0).random(384).astype(np.float32) * 50
    llama_cpp_style_file(tmp_path / "theirs.gguf", {"blk.0.ffn_up.weight": (sums, 51200.0),
                                                    "blk.0.unused.weight": (sums, 0.0)})
    theirs = read_imatrix(tmp_path / "theirs.gguf")
    assert theirs.datasets == ["wiki.train.raw"] and (theirs.chunk_count, theirs.chunk_size) == (100, 512)
    assert np.array_equal(theirs.importance("blk.0.ffn_up.weight"), sums / np.float32(51200.0))
    assert np.array_equal(theirs.importance("blk.0.unused.weight"), np.ones(384, np.float32))  # llama.cpp: 1s
    assert theirs.importance("blk.1.ffn_up.weight") is None


@pytest.fixture(scope="module")
def two_clips(tmp_path_factory) -> Path:
    manifest = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    clips = [c for c in all_real_clips() if c.id != "jfk"][:2]
    manifest.write_text("".join(json.dumps({"id": c.id, "audio": str(c.path), "text": c.text}) + "\n" for c in clips))
    return manifest


def test_a_saved_imatrix_reproduces_the_same_lattice_without_calibrating(two_clips, tmp_path):
    saved = tmp_path / "tiny.en.imatrix.gguf"
    common = ["quantize", "--model", MODEL, "--method", "imatrix", "--type", "q4_0"]
    assert cli.main([*common, "--calib", str(two_clips), "--save-imatrix", str(saved), "-o", str(tmp_path / "a")]) == 0
    assert cli.main([*common, "--imatrix", str(saved), "-o", str(tmp_path / "b")]) == 0
    for name in ("lattice.safetensors", "tensors.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    imatrix = read_imatrix(saved)
    assert imatrix.datasets == [str(two_clips)] and imatrix.chunk_count >= 1
    assert len(imatrix.sums) == 4 * 6 + 4 * 10 + 1  # tiny.en: 4 encoder x 6, 4 decoder x 10 Linears, and the head
    assert all(count > 0 for count in imatrix.counts.values())
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["calibration"]["importance"]["file"] == str(saved)

    # An entry missing (a file made for another model) is refused by name, before anything is written.
    partial = Imatrix(datasets=["x"])
    name = next(iter(imatrix.sums))
    partial.add(name, imatrix.sums[name], imatrix.counts[name])
    write_imatrix(partial, tmp_path / "partial.gguf")
    assert cli.main([*common, "--imatrix", str(tmp_path / "partial.gguf"), "-o", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv, named", [
    (["--method", "gptq", "--imatrix", "m.gguf"], "--imatrix m.gguf"),
    (["--method", "imatrix", "--imatrix", "m.gguf", "--save-imatrix", "n.gguf"], "--save-imatrix"),
    (["--method", "imatrix", "--imatrix", "{missing}"], "{missing}"),
])
def test_wrong_imatrix_options_are_refused_by_name(argv, named, tmp_path, capsys):
    fill = {"missing": str(tmp_path / "none.gguf")}
    status = cli.main(["quantize", "--model", MODEL, "--type", "q4_0", "-o", str(tmp_path / "o"),
                       *(a.format(**fill) for a in argv)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and named.format(**fill) in err and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("imatrix") / "valid.gguf"
    imatrix = Imatrix(datasets=["d"], chunk_count=2)
    imatrix.add("a.weight", np.arange(8, dtype=np.float32), 5)
    imatrix.add("b.weight", np.ones(4, np.float32), 3)
    write_imatrix(imatrix, path)
    return path.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_imatrix_files_give_the_readers_error(valid_file, tmp_path, data):
    raw = bytearray(valid_file)
    cut = data.draw(st.integers(0, len(raw)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=6))
    for at, value in flips:
        raw[at] = value
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))
    try:
        imatrix = read_imatrix(path)
    except ImatrixFileError as e:
        assert str(path) in str(e)
        return
    except GGUFFileError as e:  # pragma: no cover - a reader error must be ours, named
        pytest.fail(f"not an ImatrixFileError: {e}")
    for name in imatrix.sums:  # what reads is usable: finite, not negative
        assert np.isfinite(imatrix.importance(name)).all() and (imatrix.importance(name) >= 0).all()
