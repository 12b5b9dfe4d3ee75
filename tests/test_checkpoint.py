"""The lattice checkpoint: bit-exact round trip, atomic writes, clear errors on damaged files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tarq_deploy.checkpoint import (
    CheckpointError, LatticeCheckpoint, load_checkpoint, pack_codes, save_checkpoint, unpack_codes,
)
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.quant.lattice_fit import quantize_rtn


def make_checkpoint(bits: int = 4, group_size: int = 32) -> LatticeCheckpoint:
    spec = LatticeSpec(bits, group_size)
    g = torch.Generator().manual_seed(0)
    quantized = {f"layers.{i}.fc.weight": quantize_rtn(torch.randn(16, 128, generator=g), spec) for i in range(3)}
    quantized["proj_out.weight"] = quantize_rtn(torch.randn(40, 128, generator=g), spec)
    tensors = {"layers.0.fc.bias": torch.randn(16, generator=g), "norm.weight": torch.ones(128, dtype=torch.float16)}
    return LatticeCheckpoint(
        spec=spec, quantized=quantized, tensors=tensors, aliases={"embed.weight": "proj_out.weight"},
        metadata={"method": {"name": "rtn"}, "layers": [{"name": "layers.0.fc.weight", "lam": None}]},
        model_files={"config.json": b'{"model_type": "toy"}\n', "sub/tokenizer.json": b"{}"},
    )


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (4, -1), (3, 64), (8, 32)])
def test_round_trip_is_bit_exact(tmp_path: Path, bits: int, group_size: int) -> None:
    original = make_checkpoint(bits, group_size)
    loaded = load_checkpoint(save_checkpoint(original, tmp_path / "ckpt"))
    assert loaded.spec == original.spec
    for name, q in original.quantized.items():
        assert torch.equal(loaded.quantized[name].codes, q.codes)
        assert torch.equal(loaded.quantized[name].scales, q.scales)
    for name, t in original.tensors.items():
        assert torch.equal(loaded.tensors[name], t) and loaded.tensors[name].dtype == t.dtype
    assert loaded.aliases == original.aliases and loaded.model_files == original.model_files
    assert loaded.metadata["method"] == {"name": "rtn"}
    state = loaded.dequantized_state_dict()
    assert torch.equal(state["embed.weight"], original.quantized["proj_out.weight"].dequantize())


def test_same_checkpoint_gives_same_bytes(tmp_path: Path) -> None:
    a = save_checkpoint(make_checkpoint(), tmp_path / "a")
    b = save_checkpoint(make_checkpoint(), tmp_path / "b")
    for name in ("manifest.json", "lattice.safetensors", "tensors.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_nibble_packing_round_trip() -> None:
    q = quantize_rtn(torch.randn(5, 64), LatticeSpec(4, 32))
    packed = pack_codes(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(unpack_codes(packed, q.spec, 64), q.codes)


def test_overwrite_replaces_and_leaves_no_temporaries(tmp_path: Path) -> None:
    save_checkpoint(make_checkpoint(4, 32), tmp_path / "ckpt")
    save_checkpoint(make_checkpoint(4, 128), tmp_path / "ckpt")
    assert load_checkpoint(tmp_path / "ckpt").spec.group_size == 128
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "precious.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not a lattice checkpoint"):
        save_checkpoint(make_checkpoint(), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "precious.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_truncated_lattice_file_is_named(tmp_path: Path) -> None:
    path = save_checkpoint(make_checkpoint(), tmp_path / "ckpt")
    data = (path / "lattice.safetensors").read_bytes()
    (path / "lattice.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="lattice.safetensors.*corrupted or truncated"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="lattice.safetensors: not a readable safetensors"):
        load_checkpoint(path, verify_hashes=False)


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(make_checkpoint(), tmp_path / "ckpt")
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tensors.safetensors"):
        load_checkpoint(path)


def test_out_of_range_codes_are_rejected(tmp_path: Path) -> None:
    ckpt = make_checkpoint(3, 64)
    path = save_checkpoint(ckpt, tmp_path / "ckpt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["lattice"]["bits"] = 2  # 3-bit codes reach -4, outside the 2-bit range
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not match its own manifest_sha256"):
        load_checkpoint(path)  # the manifest is hashed like every other file
    with pytest.raises(CheckpointError, match="outside"):
        load_checkpoint(path, verify_hashes=False)  # and the codes are checked against the lattice regardless


@pytest.mark.parametrize("content,message", [(None, "missing"), ("{not json", "not valid JSON"),
                                             ('{"format": "other"}', "format is 'other'")])
def test_bad_manifest(tmp_path: Path, content: str | None, message: str) -> None:
    path = save_checkpoint(make_checkpoint(), tmp_path / "ckpt")
    if content is None:
        (path / "manifest.json").unlink()
    else:
        (path / "manifest.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)
