"""`--target transcribe.cpp` for Whisper, end to end on real parts: the packaged real Whisper base quantized by TARQ on
a real clip to a Q4_K body with the buckets of transcribe.cpp's Q4_K_M preset made by hand (attention outputs Q8_0,
the tied token embedding / output projection Q6_K: one file of three lattice types), exported as a transcribe.cpp
GGUF, verified exact, and run in the transcribe-cpp wheel (0.4.1) on jfk.wav beside the F16 file of the same model
made the same way; a lattice type its loader rejects is refused before any file exists; both vocabularies (tiny.en
English-only, base multilingual) load and transcribe.

The wheel runs in a child process: a native abort on a bad file must fail one test, not kill pytest.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import jiwer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tarq_deploy.cli import main
from tarq_deploy.data.corpus import Utterance, write_manifest
from tarq_deploy.data.normalize import normalized_words
from tarq_deploy.data.real_clips import JFK_TEXT, all_real_clips
from tarq_deploy.formats.ggml_blocks import GGMLType
from tarq_deploy.formats.gguf_file import read_gguf

# found, not imported: its native library is loaded in the children only
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transcribe_cpp") is None,
                                reason="the transcribe-cpp wheel (dev extra) runs the files")

# One child per file: load it, transcribe 16 kHz mono float32 PCM in English, print the text as JSON.
WORKER = """
import json, sys, wave
import numpy as np
import transcribe_cpp
path, wav = sys.argv[1], sys.argv[2]
with wave.open(wav) as w:
    assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
    pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
with transcribe_cpp.Model(path) as model, model.session(n_threads=1) as session:
    print(json.dumps(session.run(pcm, language="en").text))
"""
# jfk has 22 words. Measured (2-core AMD EPYC): F16 0 errors, this TARQ mix 1 ("asked not"); calibrated on one clip,
# its codes move with the kernels torch picks on another x86 CPU, so the bound leaves two more words of margin.
# On jfk + the 5 LibriVox clips the same files measured pooled WER 1.1 % (F16) and 6.5 % (this TARQ mix): one
# calibration clip is far too little for the "within 2 points" -- not what this test checks.
MAX_EXTRA_WER = 3 / 22
# the Q4_K_M buckets (transcribe.cpp's docs/tools/quantization.md) as --tensor-type rules, first match wins
Q4_K_M_RULES = ("embed_tokens|proj_out=q6_k", "out_proj=q8_0")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("transcribe_cpp")


@pytest.fixture(scope="module")
def tarq_mix(work) -> Path:
    """TARQ of real base on one real clip (jfk held out): Q4_K body, Q8_0 attention outputs, Q6_K token embedding."""
    clips = [c for c in all_real_clips() if c.id != "jfk"][:1]
    manifest = write_manifest([Utterance(c.id, str(c.path), c.text) for c in clips], work / "calib.jsonl")
    out = work / "base-tarq-mix"
    rules = [arg for rule in Q4_K_M_RULES for arg in ("--tensor-type", rule)]
    argv = ["quantize", "--model", "packaged:base", "--target", "transcribe.cpp", "--method", "tarq", "--type", "q4_k",
            *rules, "--calib", str(manifest), "--n-calib", "1", "-o", str(out)]
    assert main(argv) == 0, argv
    return out


@pytest.fixture(scope="module")
def files(tarq_mix, work) -> dict[str, Path]:
    """The TARQ checkpoint's GGUF and the F16 GGUF of the float model, through the same exporter."""
    out = {"tarq": work / "base-tarq-mix.gguf", "f16": work / "base-f16.gguf"}
    assert main(["export", str(tarq_mix), "--target", "transcribe.cpp", "-o", str(out["tarq"]), "--quiet"]) == 0
    assert main(["export", "--model", "packaged:base", "--target", "transcribe.cpp", "-o", str(out["f16"]),
                 "--quiet"]) == 0
    return out


def transcribe(path: Path, wav: str) -> str:
    done = subprocess.run([sys.executable, "-c", WORKER, str(path), wav], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"transcribe-cpp on {path.name}: exit {done.returncode}\n{done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def word_error_rate(reference: str, hypothesis: str) -> float:
    return jiwer.wer(" ".join(normalized_words(reference)), " ".join(normalized_words(hypothesis)) or "<empty>")


def test_the_lattice_is_stored_bit_for_bit_and_verify_says_so(files, tarq_mix, capsys):
    capsys.readouterr()
    assert main(["verify", str(files["tarq"]), "--checkpoint", str(tarq_mix)]) == 0
    assert "OK: all" in capsys.readouterr().out


def test_the_file_has_the_types_the_loader_takes(files):
    model = read_gguf(files["tarq"])
    types = {name: record.ggml_type for name, record in model.tensors.items()}
    assert model.arch == "whisper"
    assert types["dec.token_embd.weight"] == GGMLType.Q6_K  # the tied output projection: calibrated too
    assert types["enc.blocks.0.attn.q.weight"] == types["dec.blocks.5.ffn.fc2.weight"] == GGMLType.Q4_K
    assert types["enc.blocks.0.attn.out.weight"] == types["dec.blocks.5.cross_attn.out.weight"] == GGMLType.Q8_0
    assert types["enc.conv.0.weight"] == types["enc.conv.1.weight"] == GGMLType.F16  # fp16-born: nothing rounded
    f32 = [name for name in types if name.endswith((".bias", "norm.weight", "pos_emb.weight")) or "norm_" in name
           or name.startswith("frontend.")]
    assert f32 and all(types[name] == GGMLType.F32 for name in f32)
    assert "enc.blocks.0.attn.k.bias" not in types
    assert model.kv["general.languages"][:2] == ["en", "zh"] and model.kv["stt.capability.lang_detect"]
    assert len(model.kv["tokenizer.ggml.tokens"]) == model.kv["stt.whisper.decoder.vocab_size"] == 51865


def test_the_wheel_transcribes_jfk_as_well_as_from_the_f16_file(files, jfk_wav):
    texts = {label: transcribe(path, jfk_wav) for label, path in files.items()}
    wers = {label: word_error_rate(JFK_TEXT, text) for label, text in texts.items()}
    print(f"transcribe.cpp on jfk: {texts}, WER {wers}")
    assert wers["f16"] <= 0.05, texts["f16"]
    assert wers["tarq"] <= wers["f16"] + MAX_EXTRA_WER, texts


def test_the_english_only_vocabulary_loads_and_transcribes(work, jfk_wav):
    out = work / "tiny.en-f16.gguf"
    assert main(["export", "--model", "packaged:tiny.en", "--target", "transcribe.cpp", "-o", str(out),
                 "--quiet"]) == 0
    model = read_gguf(out)
    assert model.kv["general.languages"] == ["en"] and not model.kv["stt.capability.lang_detect"]
    assert len(model.kv["tokenizer.ggml.tokens"]) == 51864
    assert word_error_rate(JFK_TEXT, transcribe(out, jfk_wav)) <= 0.05


def test_a_type_the_loader_rejects_is_refused_before_any_file_exists(work, capsys):
    """IQ4_NL stores tiny.en's rows exactly, but transcribe.cpp's loader allowlist has no IQ types (nor Q2_K/Q3_K)."""
    ckpt = work / "tiny.en-rtn-iq4_nl"
    assert main(["quantize", "--model", "packaged:tiny.en", "--method", "rtn", "--type", "iq4_nl", "-o",
                 str(ckpt)]) == 0
    out = work / "refused.gguf"
    capsys.readouterr()
    assert main(["export", str(ckpt), "--target", "transcribe.cpp", "-o", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "iq4_nl" in error and "loader" in error, error
    assert not out.exists() and not list(work.glob("refused*"))


def test_eval_and_bench_run_the_file_through_the_runtime_adapter(files, jfk_wav):
    """The registry gives a Whisper GGUF to transcribe.cpp; its worker subprocess decodes as the whisper.cpp adapter
    does (English, greedy, no fallback, no timestamps)."""
    from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
    from tarq_deploy.runtimes.child import read_wav_float32
    from tarq_deploy.runtimes.registry import infer_runtime, open_transcriber
    from tarq_deploy.runtimes.transcribe_cpp import NAME, describe_transcribe_cpp_file

    assert infer_runtime(str(files["tarq"])) == NAME
    info = describe_transcribe_cpp_file(files["tarq"])
    assert info.backbone == "base" and info.details["tensor_types"]["Q6_K"] == 1
    transcriber = open_transcriber(ModelSpec("tarq", str(files["tarq"]), NAME), DecodeOptions())
    try:
        text = transcriber.transcribe(read_wav_float32(jfk_wav), "jfk")
    finally:
        transcriber.close()
    assert word_error_rate(JFK_TEXT, text) <= MAX_EXTRA_WER, text


@pytest.mark.parametrize("damage", ["truncated", "tensor byte", "head count"])
def test_verify_names_a_damaged_file(files, tarq_mix, work, capsys, damage):
    """A cut file or a changed key is bad input (exit 2, one line naming it); a changed weight byte is a mismatch
    (exit 1) naming the tensor: never a traceback."""
    data = bytearray(files["tarq"].read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "tensor byte":
        data[read_gguf(files["tarq"]).tensors["enc.blocks.0.ffn.fc1.weight"].offset + 100] ^= 0x11
    else:  # the key's value (uint32 8) follows its name and its value type (uint32 4)
        at = data.index(b"stt.whisper.encoder.n_heads") + len(b"stt.whisper.encoder.n_heads") + 4
        assert data[at:at + 4] == (8).to_bytes(4, "little")
        data[at:at + 4] = (4).to_bytes(4, "little")
    damaged = work / f"damaged-{damage.replace(' ', '-')}.gguf"
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    status = main(["verify", str(damaged), "--checkpoint", str(tarq_mix)])
    out, err = capsys.readouterr()
    if damage == "tensor byte":
        assert status == 1 and "MISMATCH" in out and "enc.blocks.0.ffn.fc1.weight" in out, out[-2000:]
    else:
        assert status == 2 and len(err.strip().splitlines()) == 1 and str(damaged) in err, err


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_verify_and_the_runtime_gate_survive_any_damage(files, tarq_mix, tmp_path_factory, data):
    """The Whisper flavour of transcribe.cpp's GGUF, fuzzed (as the Qwen3-ASR and Voxtral ones are): a truncated file,
    or one with bytes changed where keys and tensor infos lie, is verified (exit 0 or 1) or refused in one line naming
    the file (exit 2); the runtime gate describes it or raises the reader's named error. Never another exception."""
    from tarq_deploy.formats.gguf_file import GGUFFileError
    from tarq_deploy.runtimes.transcribe_cpp import describe_transcribe_cpp_file

    damaged = bytearray(files["tarq"].read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        damaged = damaged[:data.draw(st.integers(0, len(damaged) - 1), label="length")]
    else:
        header = min(r.offset for r in read_gguf(files["tarq"]).tensors.values())  # keys and tensor infos
        for _ in range(data.draw(st.integers(1, 4), label="edits")):
            damaged[data.draw(st.integers(0, header - 1), label="at")] = data.draw(st.integers(0, 255), label="byte")
    path = tmp_path_factory.mktemp("fuzz") / "damaged.gguf"
    path.write_bytes(bytes(damaged))
    try:
        describe_transcribe_cpp_file(path)
    except (GGUFFileError, ValueError):
        pass
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["verify", str(path), "--checkpoint", str(tarq_mix)])
    err = err.getvalue()
    assert status in (0, 1, 2)
    if status == 2:
        assert len(err.strip().splitlines()) == 1 and str(path) in err, err
