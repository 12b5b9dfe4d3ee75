"""A float whisper.cpp model file as a model source (formats/whisper_cpp_model.py, models/whisper_tokens.py): the
packaged models written to F16 files and read back are the packaged models (weights, tokenizer, feature extractor,
generation config, every saved file), quantize gives the same lattice bytes from either, a quantized file is refused
before any work, and damaged files end in the reader's own error.

The F16 files are written with the project's exporter from the packaged CTranslate2 checkpoints (float16 weights, the
layout whisper.cpp loads): what a whisper.cpp user's ``ggml-base.bin`` holds, as far as can be checked offline.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Seed, clips_manifest, fresh_path, mutated, parses_or_refuses
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import WhisperConfig, WhisperForConditionalGeneration

from tarq_deploy.cli import main
from tarq_deploy.data.corpus import Utterance, load_audio, write_manifest
from tarq_deploy.data.real_clips import all_real_clips, jfk_wav_path
from tarq_deploy.formats.ggml_file import GGMLFileError, read_whisper_cpp
from tarq_deploy.formats.whisper_cpp import export_whisper_cpp
from tarq_deploy.formats.whisper_cpp_model import STOCK_ALIGNMENT_HEADS, load_whisper_cpp
from tarq_deploy.models.common import saved_files
from tarq_deploy.formats.model_loader import load_whisper
from tarq_deploy.models.whisper_shapes import v3_vocabulary
from tarq_deploy.models.whisper_tokens import ControlTokens

HEADER_INTS = 1 + 11 + 2  # magic, the 11 header integers, the mel filter dimensions
SENTENCES = (
    "And so my fellow Americans, ask not what your country can do for you.",
    "On 12 March 1847, Mr. Dashwood paid £3,250.75 -- roughly 40% of it -- to Mrs. Jennings!",
    "the tall tree, to take the train at 10:45 (platform 9¾)?",
    "Zoë and Björn met Søren in Zürich; naïve café façades, 東京 and Москва.",
    "\"Quotes,\" she said—'nested' ones… and emoji 🎉 #hashtag @user <tag> [brackets] {braces}",
    "  leading and trailing spaces  \n and a newline\ttab",
)


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ggml_source")


@pytest.fixture(scope="module")
def packaged() -> dict[str, tuple]:
    """(model, processor, generation config) of each packaged model, float32 (as export reads them)."""
    return {name: load_whisper(f"packaged:{name}") for name in ("tiny.en", "base")}


@pytest.fixture(scope="module")
def f16_files(packaged, work) -> dict[str, Path]:
    """Each packaged model written to a whisper.cpp F16 file."""
    return {name: export_whisper_cpp(bundle, work / f"ggml-{name}.bin", "f16") for name, bundle in packaged.items()}


def _small_whisper_file(processor, path: Path, float16_values: bool) -> Path:
    """A 1+1-layer, 8-wide Whisper of tiny.en's real vocabulary and feature extractor, as an F16 file (1.2 MB);
    ``float16_values``: every weight a float16 value, as in a file converted from float16 weights."""
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51864, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    model = WhisperForConditionalGeneration(config).eval()
    if float16_values:
        model = model.half().float()
    return export_whisper_cpp((model, processor), path, "f16")


@pytest.fixture(scope="module")
def small_file(packaged, work) -> Path:
    return _small_whisper_file(packaged["tiny.en"][1], work / "small.bin", float16_values=True)


# ---------------------------------------------------------------------------------------------- the same model
@pytest.mark.parametrize("name", ["tiny.en", "base"])
def test_an_f16_file_is_the_packaged_model(packaged, f16_files, name):
    """Weights in their stored precision, config, generation config, tokenizer and feature extractor: every file a
    checkpoint saves of the model is byte for byte the packaged model's."""
    reference = load_whisper(f"packaged:{name}", dtype="stored")
    model, processor, generation_config = load_whisper(str(f16_files[name]), dtype="stored")
    assert model.dtype == reference[0].dtype == torch.float16
    expected = reference[0].state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for key, tensor in model.state_dict().items():
        assert tensor.dtype == expected[key].dtype and torch.equal(tensor, expected[key]), key
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()  # tied
    ours = saved_files(model.config, generation_config, processor)
    theirs = saved_files(reference[0].config, reference[2], reference[1])
    assert sorted(ours) == sorted(theirs)
    for file_name, data in theirs.items():
        assert ours[file_name] == data, file_name
    widened = load_whisper(str(f16_files[name]))[0]  # the default: float32, the same values
    assert widened.dtype == torch.float32
    assert torch.equal(widened.model.encoder.conv1.weight, packaged[name][0].model.encoder.conv1.weight)


def test_exporting_a_loaded_f16_file_writes_the_same_bytes(f16_files, work):
    """`export --model ggml-tiny.en.bin --type f16` (load_whisper, then the exporter) gives the file back: header,
    mel filters, vocabulary and every tensor."""
    path = f16_files["tiny.en"]
    again = export_whisper_cpp(load_whisper(str(path)), work / "again.bin", "f16")
    assert again.read_bytes() == path.read_bytes()


def test_features_of_real_audio_are_the_packaged_processors(packaged, f16_files):
    """The stored mel filters are transformers' Slaney filters, so the standard extractor gives the same features."""
    audio = load_audio(str(jfk_wav_path()))
    for name, path in f16_files.items():
        stored = read_whisper_cpp(path).mel_filters
        ours = load_whisper(str(path))[1].feature_extractor
        assert np.abs(stored - ours.mel_filters.T).max() < 1e-7
        expected = packaged[name][1].feature_extractor(audio, sampling_rate=16000, return_tensors="np").input_features
        got = ours(audio, sampling_rate=16000, return_tensors="np").input_features
        assert np.array_equal(got, expected), name


@pytest.mark.parametrize("name", ["tiny.en", "base"])
def test_the_tokenizer_from_the_file_encodes_and_decodes_as_the_packaged_one(packaged, f16_files, name):
    tokenizer = load_whisper(str(f16_files[name]))[1].tokenizer
    reference = packaged[name][1].tokenizer
    assert len(tokenizer) == len(reference) == packaged[name][0].config.vocab_size
    for text in SENTENCES:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert tokenizer(text).input_ids == reference(text).input_ids, text  # the transcript template
        assert tokenizer.decode(ids) == text
    timestamp = tokenizer.convert_tokens_to_ids("<|0.00|>")
    assert timestamp == reference.convert_tokens_to_ids("<|notimestamps|>") + 1
    ids = [timestamp, *tokenizer(" hi", add_special_tokens=False).input_ids]
    assert tokenizer.decode(ids, skip_special_tokens=True, decode_with_timestamps=True) == "<|0.00|> hi"


def test_the_control_token_layout_of_every_vocabulary_size(packaged):
    """51864 / 51865 tokens: the packaged tokenizers' control tokens; 51866: large-v3's, as whisper_shapes builds
    its vocabulary from base's (<|yue|> at 50358, every later control token one up)."""
    base_processor, base_generation = packaged["base"][1], packaged["base"][2]
    v3_tokenizer = v3_vocabulary(base_processor, base_generation)[0].tokenizer
    for n_vocab, tokenizer in ((51864, packaged["tiny.en"][1].tokenizer), (51865, base_processor.tokenizer),
                               (51866, v3_tokenizer)):
        control = ControlTokens.for_vocab_size(n_vocab)
        assert {name: tokenizer.convert_tokens_to_ids(name) for name in control.names} == control.ids, n_vocab
        assert len(tokenizer) == n_vocab
    assert ControlTokens.for_vocab_size(51866).ids["<|yue|>"] == 50358
    with pytest.raises(ValueError, match="no Whisper vocabulary"):
        ControlTokens.for_vocab_size(51000)


def test_stock_alignment_heads_are_the_packaged_models(packaged):
    for name, key in (("tiny.en", (384, 4, 4, 51864, 80)), ("base", (512, 6, 6, 51865, 80))):
        assert [list(pair) for pair in STOCK_ALIGNMENT_HEADS[key]] == packaged[name][2].alignment_heads, name


def test_a_file_of_other_dimensions_loads_with_default_alignment_heads(small_file, caplog):
    model, processor, generation_config = load_whisper(str(small_file), dtype="stored")
    assert model.dtype == torch.float16 and model.config.d_model == 8
    assert generation_config.alignment_heads == [[0, 0], [0, 1]]  # every head of the decoder's second half
    assert "no known alignment heads" in caplog.text


def test_float32_values_in_the_f32_tensors_keep_the_model_in_float32(packaged, work):
    """An F16 file whose norms and biases hold values no float16 holds (converted from float32 weights): "stored"
    takes float32, so that nothing is rounded."""
    path = _small_whisper_file(packaged["tiny.en"][1], work / "small-f32-values.bin", float16_values=False)
    model = load_whisper(str(path), dtype="stored")[0]
    assert model.dtype == torch.float32
    stored = read_whisper_cpp(path)
    assert np.array_equal(model.model.encoder.layer_norm.bias.detach().numpy(),
                          stored.dequantize("encoder.ln_post.bias"))


# ------------------------------------------------------------------------------------------------------ quantize
@pytest.fixture(scope="module")
def calib_manifest(work) -> Path:
    clips = [c for c in all_real_clips() if c.id != "jfk"][:1]  # one: base runs twice (161 s with two, shared CPU)
    return clips_manifest(clips, work / "calib.jsonl")


def test_quantize_from_the_ggml_file_writes_the_same_lattice(f16_files, calib_manifest, work):
    """Multilingual base, TARQ Q4_0 on a real clip (its rare-word alignment uses the file's alignment heads): the lattice and every other tensor byte-identical to the run
    from packaged:base, and so are the model files the checkpoint keeps."""
    checkpoints = {}
    for label, model in (("packaged", "packaged:base"), ("ggml", str(f16_files["base"]))):
        out = work / f"base-{label}"
        argv = ["quantize", "--model", model, "--method", "tarq", "--type", "q4_0", "--calib", str(calib_manifest),
                "--n-calib", "1", "--out", str(out)]
        assert main(argv) == 0, argv
        checkpoints[label] = out
    files = sorted(p.name for p in checkpoints["packaged"].rglob("*") if p.is_file())
    assert "lattice.safetensors" in files and "tensors.safetensors" in files
    assert files == sorted(p.name for p in checkpoints["ggml"].rglob("*") if p.is_file())
    for relative in (p.relative_to(checkpoints["packaged"]) for p in checkpoints["packaged"].rglob("*")
                     if p.is_file() and p.name != "manifest.json"):
        assert (checkpoints["ggml"] / relative).read_bytes() == (checkpoints["packaged"] / relative).read_bytes(), \
            relative
    manifests = {label: json.loads((out / "manifest.json").read_text()) for label, out in checkpoints.items()}
    for label, model_id in (("packaged", "packaged:base"), ("ggml", str(f16_files["base"]))):
        assert manifests[label]["source_model"].pop("id") == model_id
        manifests[label].pop("manifest_sha256")
    assert manifests["ggml"] == manifests["packaged"]  # the source's name (and the digest over it) is all that differs


# --------------------------------------------------------------------------------------------- refused sources
@pytest.fixture(scope="module")
def q4_0_file(packaged, work) -> Path:
    """tiny.en rounded by ggml's own Q4_0 quantizer: what whisper.cpp's quantize tool makes of the F16 file."""
    return export_whisper_cpp(packaged["tiny.en"], work / "ggml-tiny.en-q4_0.bin", "q4_0", baseline="rtn")


def test_a_quantized_file_is_refused_before_any_work(q4_0_file, work):
    """Exit 2, one line naming the file and its type, nothing written; refused before the corpus is read (whose
    audio here does not exist: had it been read, the error would name the missing clip)."""
    manifest = write_manifest([Utterance("ghost", str(work / "missing.wav"), "hello there")], work / "ghost.jsonl")
    out = work / "refused"
    done = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", "quantize", "--model", str(q4_0_file),
                           "--method", "tarq", "--type", "q4_0", "--calib", str(manifest), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(q4_0_file) in lines[0] and "Q4_0" in lines[0] and "missing.wav" not in lines[0]
    assert not [p for p in work.iterdir() if p.name.startswith("refused")]
    with pytest.raises(GGMLFileError, match="Q4_0"):
        load_whisper(str(q4_0_file))


def test_mel_filters_of_another_design_are_refused(small_file, work):
    data = bytearray(small_file.read_bytes())
    at = 4 * HEADER_INTS + 4 * 201 * 10  # the eleventh band
    band = np.frombuffer(bytes(data[at:at + 4 * 201]), dtype="<f4") * np.float32(1.01)
    data[at:at + 4 * 201] = band.astype("<f4").tobytes()
    path = work / "other-filters.bin"
    path.write_bytes(bytes(data))
    with pytest.raises(GGMLFileError, match="mel filters differ from Whisper's Slaney filters"):
        load_whisper(str(path))


@pytest.mark.parametrize("field, value, problem", [
    (3, 3, "not a multiple of its 3 heads"),  # n_audio_head: no tensor shape shows it
    (7, 5, "not a multiple of its 5 heads"),  # n_text_head
])
def test_head_counts_that_do_not_divide_the_width_are_refused(small_file, work, field, value, problem):
    data = bytearray(small_file.read_bytes())
    struct.pack_into("<i", data, 4 * (1 + field), value)
    path = work / f"heads-{field}.bin"
    path.write_bytes(bytes(data))
    with pytest.raises(GGMLFileError, match=problem):
        load_whisper_cpp(path)


def test_every_truncation_of_the_header_is_the_readers_error(small_file, work):
    data = small_file.read_bytes()
    vocab_end = 4 * HEADER_INTS + 4 * 80 * 201 + 4 + 64
    for cut in [*range(0, 4 * HEADER_INTS + 8), *range(4 * HEADER_INTS + 8, vocab_end, 97), len(data) - 1]:
        path = fresh_path(work, ".bin")
        path.write_bytes(data[:cut])
        with pytest.raises(GGMLFileError):
            load_whisper_cpp(path)


def _header_seed(path: Path) -> Seed:
    """The small file with its header fields marked: magic, the 11 integers, the mel dimensions, the vocabulary count
    and its first and last token lengths, and the first tensor's header."""
    data = path.read_bytes()
    fields = [4 * i for i in range(HEADER_INTS)]
    vocab_at = 4 * HEADER_INTS + 4 * 80 * 201
    fields.append(vocab_at)
    at = vocab_at + 4
    lengths = []
    for _ in range(50257):
        lengths.append(at)
        at += 4 + struct.unpack_from("<i", data, at)[0]
    fields += lengths[:8] + lengths[-8:] + [at + 4 * i for i in range(6)]
    return Seed(data, tuple(fields))


@pytest.fixture(scope="module")
def header_seed(small_file) -> Seed:
    return _header_seed(small_file)


@settings(deadline=None)  # an example that loads whole builds a 51864-token tokenizer (~2 s): no deadline
@given(data=st.data())
def test_damaged_files_load_or_give_the_readers_error(header_seed, work, data):
    """Truncations, bit flips and edited integers, mostly in the header: the whole load either works or raises
    GGMLFileError (a UserError: one line, exit 2), never another exception or a hang."""
    path = fresh_path(work, ".bin")
    path.write_bytes(data.draw(mutated(header_seed)))
    parses_or_refuses(lambda: load_whisper_cpp(path), GGMLFileError)
