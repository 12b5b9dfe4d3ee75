"""The lattice checkpoint: bit-exact round trip, atomic writes, clear errors on damaged files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from gguf.constants import GGMLQuantizationType as GGMLType
from safetensors.torch import load_file, save_file

from tarq_deploy.checkpoint import (
    CheckpointError, LatticeCheckpoint, load_checkpoint, manifest_digest, pack_codes, save_checkpoint, unpack_codes,
)
from tarq_deploy.quant.ggml_types import pack
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
    ckpts = [make_checkpoint(), make_checkpoint()]
    for ckpt in ckpts:  # with a token table too: its file's bytes must not depend on the run either
        ckpt.model_files["tokenizer.json"] = b'{"model": {"vocab": {"a": 0, "<|endoftext|>": 1}}}'
    a, b = (save_checkpoint(ckpt, tmp_path / name) for ckpt, name in zip(ckpts, "ab"))
    for name in ("manifest.json", "lattice.safetensors", "tensors.safetensors", "vocabulary.safetensors"):
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


# ------------------------------------------------------------------------------------- format 2: ggml blocks
def test_native_ggml_lattice_is_stored_as_blocks_and_decoded_only_when_asked(tmp_path: Path) -> None:
    original = make_checkpoint(4, 32)  # Q4_0's own lattice
    path = save_checkpoint(original, tmp_path / "ckpt")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["lattice"]["code_storage"] == "ggml-blocks"
    stored = load_file(str(path / "lattice.safetensors"))
    assert sorted(stored) == sorted(f"{name}.blocks" for name in original.quantized)
    loaded = load_checkpoint(path)
    name = "layers.0.fc.weight"
    blocks = loaded.quantized.blocks(name, GGMLType.Q4_0)
    assert blocks is not None and np.array_equal(blocks, pack(original.quantized[name], GGMLType.Q4_0))
    assert loaded.quantized.blocks(name, GGMLType.Q8_0) is None  # another type: packed from the codes instead
    assert loaded.quantized.spec_of(name) == original.spec and loaded.quantized.shape_of(name) == (16, 128)
    assert not loaded.quantized._decoded  # nothing decoded yet
    assert torch.equal(loaded.quantized[name].codes, original.quantized[name].codes)
    assert torch.equal(loaded.quantized[name].scales, original.quantized[name].scales)
    resaved = save_checkpoint(loaded, tmp_path / "again")  # stored blocks are written back as they are
    assert (resaved / "lattice.safetensors").read_bytes() == (path / "lattice.safetensors").read_bytes()


def write_version_1(ckpt: LatticeCheckpoint, directory: Path) -> Path:
    """A checkpoint as format version 1 wrote it: codes and scales for every lattice, sha256 digests only."""
    directory.mkdir()
    lattice = {}
    for name, q in ckpt.quantized.items():
        lattice[f"{name}.codes"] = pack_codes(q)
        lattice.update({f"{name}.{part}": t for part, t in q.params().items()})
    save_file(lattice, str(directory / "lattice.safetensors"), metadata={"format": "tarq-lattice"})
    save_file(dict(ckpt.tensors), str(directory / "tensors.safetensors"), metadata={"format": "tarq-lattice"})
    for rel, data in ckpt.model_files.items():
        (directory / "model" / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / "model" / rel).write_bytes(data)
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    lattice_record = {"bits": ckpt.spec.bits, "group_size": ckpt.spec.group_size, "scheme": "symmetric",
                      "ggml_type": "q4_0", "scale_dtype": "float16", "code_storage": "nibble"}
    manifest = {"format": "tarq-lattice", "format_version": 1, "lattice": lattice_record,
                "quantized": {n: list(q.shape) for n, q in ckpt.quantized.items()}, "aliases": ckpt.aliases,
                "files": {rel: hashlib.sha256((directory / rel).read_bytes()).hexdigest() for rel in files}}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def test_version_1_checkpoint_is_still_read(tmp_path: Path) -> None:
    original = make_checkpoint(4, 32)
    path = write_version_1(original, tmp_path / "v1")
    loaded = load_checkpoint(path)
    for name, q in original.quantized.items():
        assert torch.equal(loaded.quantized[name].codes, q.codes)
    data = bytearray((path / "lattice.safetensors").read_bytes())
    data[-1] ^= 0x01
    (path / "lattice.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="lattice.safetensors: content does not match its sha256"):
        load_checkpoint(path)  # version 1 has sha256 digests only, and they are checked


def test_sha256_is_checked_when_asked_even_where_the_fast_digest_was_rewritten(tmp_path: Path) -> None:
    path = save_checkpoint(make_checkpoint(), tmp_path / "ckpt")
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "tensors.safetensors").write_bytes(bytes(data))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files_xxh3"]["tensors.safetensors"] = xxhash.xxh3_128_hexdigest(bytes(data))
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    load_checkpoint(path)  # the fast digest was made to match
    with pytest.raises(CheckpointError, match="tensors.safetensors: content does not match its sha256"):
        load_checkpoint(path, sha256=True)


def test_inf_scale_in_stored_blocks_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(make_checkpoint(4, 32), tmp_path / "ckpt")
    arrays = load_file(str(path / "lattice.safetensors"))
    blocks = arrays["layers.1.fc.weight.blocks"].clone()
    blocks[3, 18:20] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # the second block's d: fp16 +inf
    arrays["layers.1.fc.weight.blocks"] = blocks
    save_file(arrays, str(path / "lattice.safetensors"), metadata={"format": "tarq-lattice"})
    with pytest.raises(CheckpointError, match="lattice.safetensors: content does not match its xxh3"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="layers.1.fc.weight: Q4_0 blocks hold an inf or nan scale"):
        load_checkpoint(path, verify_hashes=False)  # unverified blocks get their scales checked


def test_blocks_that_do_not_fit_the_shape_are_named(tmp_path: Path) -> None:
    path = save_checkpoint(make_checkpoint(4, 32), tmp_path / "ckpt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["quantized"]["proj_out.weight"] = [40, 96]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"blocks of proj_out.weight are stored as uint8 \[40, 72\], which does "
                                              r"not fit its shape \[40, 96\]"):
        load_checkpoint(path, verify_hashes=False)


def test_token_table_is_stored_and_follows_the_tokenizer(tmp_path: Path) -> None:
    tokenizer = {"model": {"vocab": {"Ġhello": 0, "wor": 1, "ld": 3}},
                 "added_tokens": [{"id": 4, "content": "<|endoftext|>"}, {"id": 0, "content": "ignored"}]}
    ckpt = make_checkpoint()
    ckpt.model_files["tokenizer.json"] = json.dumps(tokenizer).encode()
    loaded = load_checkpoint(save_checkpoint(ckpt, tmp_path / "ckpt"))
    table = loaded.token_table
    assert table is not None and table.tokens() == [b" hello", b"wor", b"", b"ld", b"<|endoftext|>"]
    assert table.defined.tolist() == [True, True, False, True, True] and table.find(b"<|endoftext|>") == 4
    assert loaded.tokens() is table  # the stored table, while tokenizer.json is the one it came from
    tokenizer["model"]["vocab"]["ld"] = 2
    loaded.model_files["tokenizer.json"] = json.dumps(tokenizer).encode()
    assert loaded.tokens().tokens() == [b" hello", b"wor", b"ld", b"", b"<|endoftext|>"]  # derived anew
