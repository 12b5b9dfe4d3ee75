"""whisper.cpp export: ggml block packing, the model file, verify, and the real runtime (pywhispercpp 1.5.1) on real
Whisper tiny.en weights.

pywhispercpp runs in a subprocess: a model it cannot load does not raise, the first transcribe() segfaults, and that
must fail one test rather than kill pytest. Every file is checked by our strict parser before whisper.cpp sees it.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import wave
from pathlib import Path

import jiwer
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers import lattice_checkpoint, transcribe_whisper_cpp, words

from tarq_deploy.formats.ggml_blocks import (BLOCKS as GGML_BLOCK, LatticeNotRepresentable, ggml_rtn_q4_0, ggml_rtn_q8_0,
                                             pack_q4_0, pack_q8_0)
from tarq_deploy.formats.ggml_file import GGMLFileError, read_whisper_cpp, tensor_slots
from tarq_deploy.formats.whisper_cpp import as_source, export_whisper_cpp, verify
from tarq_deploy.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tarq_deploy.commands.export_whispercpp import add_export_arguments, run_export
from tarq_deploy.commands.verify import add_arguments as add_verify_arguments, run as run_verify
from tarq_deploy.data.real_clips import JFK_TEXT
from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight
from tarq_deploy.quant.lattice_fit import quantize_rtn

Q4_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0


# ------------------------------------------------------------------------------------------------------ helpers
def transcribe_transformers(bundle, wav: str) -> str:
    model, processor, generation_config = bundle
    with wave.open(wav) as w:
        audio = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0
    features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(features, generation_config=generation_config)
    return processor.batch_decode(ids, skip_special_tokens=True)[0].strip()


def parse(parser_setup, argv: list[str]) -> argparse.Namespace:
    from tarq_deploy.commands.options import merge_spellings

    parser = argparse.ArgumentParser()
    parser_setup(parser)
    args = parser.parse_args(argv)
    merge_spellings(args)  # what the CLI does before a command runs (a positional CHECKPOINT_DIR -> --checkpoint)
    return args


# ----------------------------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small torch ops, one thread


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("whisper_cpp")


@pytest.fixture(scope="module")
def checkpoints(tiny, work) -> dict[int, Path]:
    """4-bit RTN lattice checkpoints of tiny.en with group 32 and 128, saved as directories."""
    return {g: save_checkpoint(lattice_checkpoint(tiny, LatticeSpec(4, g)), work / f"ckpt-g{g}") for g in (32, 128)}


# ----------------------------------------------------------------------------------------------- block packing
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_q4_0_blocks_decode_to_the_lattice_exactly(group):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(group + 100)) * 0.03
    q = quantize_rtn(w, LatticeSpec(4, group))
    blocks = pack_q4_0(q.codes, q.scales)
    assert blocks.shape == (8, 256 // 32 * GGML_BLOCK[2][1])
    assert np.array_equal(dequantize(blocks, Q4_0), q.dequantize().numpy())


def test_q4_0_block_layout():
    codes = np.arange(-8, 8, dtype=np.int8).repeat(2).reshape(1, 32)  # -8,-8,-7,-7,...,7,7
    scales = np.array([[0.5]], dtype=np.float16)
    block = pack_q4_0(codes, scales)[0]
    assert block[:2].tobytes() == np.float16(0.5).tobytes()
    nibbles = codes[0] + 8
    assert list(block[2:]) == [int(nibbles[j]) | int(nibbles[j + 16]) << 4 for j in range(16)]


def test_q8_0_blocks_decode_to_an_8_bit_lattice_exactly():
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(7))
    q = quantize_rtn(w, LatticeSpec(8, 64))
    assert int(q.codes.min()) == -128 or int(q.codes.max()) == 127
    assert np.array_equal(dequantize(pack_q8_0(q.codes, q.scales), Q8_0), q.dequantize().numpy())


@pytest.mark.parametrize("n_cols, n_groups, match", [
    (96, 2, "group size 48"),  # group 48 straddles a block boundary
    (48, 1, "group size 48"),  # per-channel, but the row is not whole blocks
    (64, 4, "group size 16"),  # narrower than a block
])
def test_pack_refuses_groups_a_block_cannot_hold(n_cols, n_groups, match):
    codes = np.zeros((2, n_cols), dtype=np.int8)
    scales = np.ones((2, n_groups), dtype=np.float16)
    with pytest.raises(LatticeNotRepresentable, match=match):
        pack_q4_0(codes, scales)


def test_pack_refuses_codes_outside_q4_0():
    with pytest.raises(LatticeNotRepresentable, match="outside Q4_0"):
        pack_q4_0(np.full((1, 32), 8, dtype=np.int8), np.ones((1, 1), dtype=np.float16))


def test_ggml_rounding_matches_gguf_on_real_weights(tiny):
    state = tiny[0].state_dict()
    for name in ("model.encoder.layers.0.fc1.weight", "model.decoder.layers.3.encoder_attn.k_proj.weight"):
        w = state[name].numpy()
        assert np.array_equal(ggml_rtn_q4_0(w), quantize(w, Q4_0)), name
        assert np.array_equal(ggml_rtn_q8_0(w), quantize(w, Q8_0)), name


# ---------------------------------------------------------------------------------------- model file + runtime
def test_f16_export_transcribes_like_transformers(tiny, work, jfk_wav):
    out = export_whisper_cpp(tiny, work / "tiny-f16.bin", "f16")
    model = read_whisper_cpp(out)
    assert model.hparams.ftype == 1 and len(model.vocab) == 50257 and model.vocab[-1] == b"<|endoftext|>"
    assert transcribe_whisper_cpp(out, jfk_wav) == transcribe_transformers(tiny, jfk_wav)


def test_q4_0_export_of_a_4_bit_checkpoint_runs_in_whisper_cpp(checkpoints, work, jfk_wav):
    out = export_whisper_cpp(checkpoints[32], work / "tiny-g32-q4_0.bin", "q4_0")
    model = read_whisper_cpp(out)
    assert model.hparams.ftype == 2002
    assert model.tensors["decoder.token_embedding.weight"].ggml_type == 2  # tied embedding on the lattice too
    assert model.tensors["encoder.conv1.weight"].ggml_type == 1
    text = transcribe_whisper_cpp(out, jfk_wav)
    assert jiwer.wer(words(JFK_TEXT), words(text)) <= 0.25, text


@pytest.mark.parametrize("group", [128, 32])
def test_q4_0_export_is_bit_exact(checkpoints, work, group):
    out = export_whisper_cpp(checkpoints[group], work / f"tiny-g{group}-q4_0.bin", "q4_0")
    diffs = verify(out, checkpoints[group])
    expected = ["mel_filters", *(slot.name for slot in tensor_slots(read_whisper_cpp(out).hparams))]
    assert list(diffs) == expected
    assert {name: d for name, d in diffs.items() if d != 0.0} == {}


def test_copied_blocks_and_stored_tokens_give_the_bytes_packing_and_the_tokenizer_give(tiny, checkpoints, work):
    """The fast path (stored Q4_0 blocks copied, the vocabulary from the checkpoint's token table) writes the same
    file as the slow one (blocks packed from codes, the vocabulary translated from tokenizer.json)."""
    loaded = load_checkpoint(checkpoints[32])
    assert loaded.token_table is not None and not loaded.quantized._decoded
    fast = export_whisper_cpp(loaded, work / "fast.bin", "q4_0")
    assert not loaded.quantized._decoded  # nothing was decoded: the blocks were copied
    slow_source = as_source(lattice_checkpoint(tiny, LatticeSpec(4, 32)))  # in memory: codes and scales
    slow_source.token_table = None
    assert slow_source.export_vocab().tokens() == slow_source.vocab()
    slow = export_whisper_cpp(slow_source, work / "slow.bin", "q4_0")
    assert fast.read_bytes() == slow.read_bytes()


def test_a_damaged_checkpoint_exports_nothing(checkpoints, work):
    """The digests are checked while the export packs and writes; a mismatch removes the written file."""
    damaged = work / "damaged"
    shutil.copytree(checkpoints[32], damaged)
    data = bytearray((damaged / "lattice.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x10  # inside some tensor's blocks: the file still parses
    (damaged / "lattice.safetensors").write_bytes(bytes(data))
    out = work / "from-damaged" / "tiny.bin"
    with pytest.raises(CheckpointError, match="lattice.safetensors: content does not match its xxh3 digest"):
        export_whisper_cpp(damaged, out, "q4_0")
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("name", ["tiny.en", "base"])  # English-only, and multilingual with an id left empty
def test_an_in_memory_model_asks_its_tokenizer_for_the_vocabulary_tokenizer_json_gives(name):
    """model_source reads the vocabulary from the tokenizer object instead of parsing its JSON: the same tokens, ids
    and added tokens, so the same vocabulary bytes in the file."""
    from tarq_deploy.formats.whisper_cpp import base_vocab_table, model_source
    from tarq_deploy.formats.model_loader import load_whisper
    from tarq_deploy.vocabulary import token_strings

    model, processor, _ = load_whisper(f"packaged:{name}")
    parsed = json.loads(processor.tokenizer.backend_tokenizer.to_str())
    asked = model_source(model, processor).tokenizer
    assert token_strings(asked) == token_strings(parsed)
    assert np.array_equal(base_vocab_table(asked).records, base_vocab_table(parsed).records)


def test_q8_0_export_of_an_8_bit_checkpoint_is_bit_exact_and_runs(tiny, work, jfk_wav):
    ckpt_dir = save_checkpoint(lattice_checkpoint(tiny, LatticeSpec(8, 128)), work / "ckpt-8bit-g128")
    out = export_whisper_cpp(ckpt_dir, work / "tiny-q8_0.bin", "q8_0")
    assert read_whisper_cpp(out).hparams.ftype == 2007  # GGML_FTYPE_MOSTLY_Q8_0 + 1000 * GGML_QNT_VERSION
    assert {name: d for name, d in verify(out, ckpt_dir).items() if d != 0.0} == {}
    text = transcribe_whisper_cpp(out, jfk_wav)
    assert jiwer.wer(words(JFK_TEXT), words(text)) <= 0.1, text


def test_f16_export_of_a_checkpoint_rounds_only_lattice_values(checkpoints, work):
    out = export_whisper_cpp(checkpoints[128], work / "tiny-g128-f16.bin", "f16")
    model = read_whisper_cpp(out)
    diffs = verify(out, checkpoints[128])
    matrices = [s.name for s in tensor_slots(model.hparams) if s.role == "matrix"]
    assert {n: d for n, d in diffs.items() if d != 0.0 and n not in matrices} == {}  # real conv weights are fp16
    assert any(diffs[n] > 0.0 for n in matrices)  # fp16 cannot hold every s * q ...
    for n in matrices:  # ... but misses each by at most half an fp16 step
        assert diffs[n] <= float(np.abs(model.dequantize(n)).max()) * 2.0**-11, n


def test_f16_from_stored_blocks_is_the_f16_of_the_decoded_lattice(tiny, checkpoints, work):
    """An F16 export of a checkpoint whose Q4_0 blocks are decoded straight into fp16 (compiled kernels, on threads
    while the file is written) writes the bytes of the slow path: codes and scales, s * q, rounded by torch."""
    loaded = load_checkpoint(checkpoints[32])
    fast = export_whisper_cpp(loaded, work / "fast-f16.bin", "f16")
    assert not loaded.quantized._decoded  # nothing went through codes and scales
    slow = export_whisper_cpp(lattice_checkpoint(tiny, LatticeSpec(4, 32)), work / "slow-f16.bin", "f16")
    assert fast.read_bytes() == slow.read_bytes()
    model = read_whisper_cpp(fast)
    name = "decoder.blocks.0.mlp.0.weight"
    assert model.tensors[name].ggml_type == 1  # F16
    expected = loaded.quantized["model.decoder.layers.0.fc1.weight"].dequantize().half().float().numpy()
    assert np.array_equal(model.dequantize(name), expected)


def test_rtn_baseline_is_byte_identical_to_gguf(tiny, work):
    out = export_whisper_cpp(tiny, work / "tiny-rtn-q4_0.bin", "q4_0", baseline="rtn")
    model = read_whisper_cpp(out)
    state = tiny[0].state_dict()
    quantized = [s for s in tensor_slots(model.hparams) if model.tensors[s.name].ggml_type == 2]
    assert len(quantized) == 4 * 6 + 4 * 10 + 1  # every attention / MLP matrix and the token embedding
    for slot in quantized:
        w = state[slot.hf_name].to(torch.float16).float().numpy()  # whisper.cpp quantizes its F16 file
        assert np.array_equal(model.raw(slot.name), quantize(w, Q4_0)), slot.name


# ------------------------------------------------------------------------------------------------------ refusals
def test_group_48_lattice_is_refused_without_output(tiny, work):
    ckpt = lattice_checkpoint(tiny, LatticeSpec(4, 32))
    name = "model.decoder.layers.1.fc2.weight"
    spec48 = object.__new__(LatticeSpec)  # LatticeSpec itself rejects 48; a converter must not trust that alone
    object.__setattr__(spec48, "bits", 4)
    object.__setattr__(spec48, "group_size", 48)
    w = tiny[0].state_dict()[name]
    scales = (w.abs().reshape(w.shape[0], -1, 48).amax(dim=2) / 7).half()
    codes = torch.round(w / scales.float().repeat_interleave(48, dim=1)).clamp(-8, 7).to(torch.int8)
    ckpt.quantized[name] = QuantizedWeight(codes, scales, spec48)
    out_dir = work / "refused"
    out_dir.mkdir()
    with pytest.raises(LatticeNotRepresentable, match=rf"{re.escape(name)}.*group size 48"):
        export_whisper_cpp(ckpt, out_dir / "model.bin", "q4_0")
    assert list(out_dir.iterdir()) == []


def test_cli_refuses_a_type_the_lattice_does_not_fit(checkpoints, work, capsys):
    out = work / "wrong-type.bin"
    args = parse(add_export_arguments, [str(checkpoints[32]), "-o", str(out), "--type", "q8_0", "--quiet"])
    assert run_export(args) == 2
    assert "4-bit symmetric lattice is not what Q8_0 stores" in capsys.readouterr().err
    assert not out.exists() and not list(work.glob(".wrong-type.bin.*"))


# --------------------------------------------------------------------------------------- verify: broken files
@pytest.fixture(scope="module")
def good_q4_0(checkpoints, work) -> Path:
    return export_whisper_cpp(checkpoints[128], work / "good-q4_0.bin", "q4_0")


def _corrupt(src: Path, dst: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    dst.write_bytes(bytes(edit(data)))
    return dst


def test_verify_cli_passes_a_lossless_export(good_q4_0, checkpoints, capsys):
    assert run_verify(parse(add_verify_arguments, [str(good_q4_0), "--against", str(checkpoints[128])])) == 0
    assert "OK: all" in capsys.readouterr().out


@pytest.mark.parametrize("edit, problem", [
    (lambda b: b[:-1000], "truncated"),
    (lambda b: b[:len(b) // 2], "truncated"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + (0).to_bytes(4, "little") + b[8:], "bad header"),
])
def test_verify_rejects_broken_files(good_q4_0, checkpoints, work, capsys, edit, problem):
    broken = _corrupt(good_q4_0, work / "broken.bin", edit)
    with pytest.raises(GGMLFileError, match=problem) as info:
        verify(broken, checkpoints[128])
    assert str(broken) in str(info.value)
    assert run_verify(parse(add_verify_arguments, [str(broken), "--against", str(checkpoints[128])])) == 2
    assert problem in capsys.readouterr().err


def _last_tensor_start(model) -> int:
    """File offset of the last tensor's header (n_dims, name length, type, dims, name precede its data)."""
    last = max(model.tensors.values(), key=lambda r: r.offset)
    return last.offset - len(last.name) - 4 * len(last.shape) - 12


def test_parser_names_missing_and_duplicate_tensors(good_q4_0, work):
    model = read_whisper_cpp(good_q4_0)
    start = _last_tensor_start(model)
    last = max(model.tensors.values(), key=lambda r: r.offset).name
    with pytest.raises(GGMLFileError, match=rf"missing tensors \(1 of 167\): {re.escape(last)}"):
        read_whisper_cpp(_corrupt(good_q4_0, work / "missing.bin", lambda b: b[:start]))
    with pytest.raises(GGMLFileError, match=rf"tensor {re.escape(last)} appears twice"):
        read_whisper_cpp(_corrupt(good_q4_0, work / "twice.bin", lambda b: b + b[start:]))


def test_verify_rejects_an_unknown_tensor_type(good_q4_0, work):
    model = read_whisper_cpp(good_q4_0)
    first = min(model.tensors.values(), key=lambda r: r.offset)
    type_at = first.offset - len(first.name) - 4 * len(first.shape) - 4  # n_dims, name length, TYPE, dims, name

    def set_type(b: bytearray) -> bytearray:
        b[type_at:type_at + 4] = (77).to_bytes(4, "little")
        return b

    with pytest.raises(GGMLFileError, match="unknown ggml type 77"):
        read_whisper_cpp(_corrupt(good_q4_0, work / "bad-type.bin", set_type))


def test_verify_reports_a_changed_weight(good_q4_0, checkpoints, work, capsys):
    model = read_whisper_cpp(good_q4_0)
    rec = model.tensors["decoder.blocks.2.mlp.0.weight"]

    def flip(b: bytearray) -> bytearray:
        b[rec.offset + 5] ^= 0x11  # two codes of the first block change by one step each
        return b

    broken = _corrupt(good_q4_0, work / "changed.bin", flip)
    diffs = verify(broken, checkpoints[128])
    assert [name for name, d in diffs.items() if d != 0.0] == ["decoder.blocks.2.mlp.0.weight"]
    assert run_verify(parse(add_verify_arguments, [str(broken), "--against", str(checkpoints[128])])) == 1
    assert "MISMATCH" in capsys.readouterr().out
