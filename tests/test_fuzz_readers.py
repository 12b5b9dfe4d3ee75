"""Every file reader fuzzed (issue 27): random truncations, bit flips and field edits of a small valid file end in a
valid parse or the reader's own named error -- one the CLI prints as a one-line message and exits 2 on -- never
another exception, a hang or a crashed process.

Readers: the WAV decoder (through ``load_audio``, resampling included), the JSONL manifest, the Kaldi data folder and
a saved ``datasets`` folder with its column options (``load_corpus``), the term list (``read_terms``), the
whisper.cpp ``.bin`` reader and the gate in front of pywhispercpp (``describe_whisper_cpp_file``, what the bench and
publish validate with), the GGUF reader and the gates in front of CrispASR / qwen3-asr.cpp (``checked_gguf``,
``is_crispasr_file``, ``describe_crispasr_file``), the lattice checkpoint (``load_checkpoint`` on a mutated
manifest.json or safetensors file, then decoding every weight) and the sweep TOML (``load_sweep``).

Seeds are built here in milliseconds with the project's own writers (a 1-layer, 32-wide Whisper of 16 tokens; a
3-tensor GGUF; a 2-weight checkpoint). Field edits land on the bytes where structure lies (headers, sizes, counts,
names), found from each seed's own layout, so most examples get past the first check.

Time: ``deadline`` bounds each example after the fact, and a SIGALRM guard interrupts one stuck in a loop (a deadline
never fires on an example that does not return). Profiles (tests/conftest.py): ``fast`` by default (derandomized, a
few seconds per reader), ``HYPOTHESIS_PROFILE=long`` for thousands of examples. Native runtimes are never called
by the fuzzing: every gate is pure Python. The one test that hands gate-accepted files to pywhispercpp and CrispASR
does so through the runtimes' own worker subprocesses, whose crash must come back as an error naming the file.
"""
from __future__ import annotations

import hashlib
import io
import json
import struct
import tracemalloc
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGUFValueType
from helpers import Seed, fresh_path, hang_guard, mutated, parses_or_refuses
from hypothesis import given, settings
from hypothesis import strategies as st

from tarq_deploy import cli
from tarq_deploy.checkpoint import (FAST_DIGESTS_KEY, MANIFEST, MANIFEST_DIGEST_KEY, CheckpointError,
                                    LatticeCheckpoint, fast_digest, load_checkpoint, manifest_digest, save_checkpoint)
from tarq_deploy.data.corpus import CorpusError, Utterance, encode_wav_float32, load_audio, load_corpus
from tarq_deploy.data.normalize import spoken_words
from tarq_deploy.errors import UserError
from tarq_deploy.formats.ggml_blocks import GGMLType
from tarq_deploy.formats.ggml_file import (FTYPE_OF_TYPE, QNT_VERSION, QNT_VERSION_FACTOR, GGMLFileError,
                                           WhisperHParams, read_whisper_cpp, tensor_slots)
from tarq_deploy.formats.ggml_tensors import PackedTensor
from tarq_deploy.formats.gguf_file import KV, GGUFFileError, GGUFModel, file_kv, read_gguf, write_gguf
from tarq_deploy.formats.whisper_cpp import WhisperCppModel, write_whisper_cpp
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.quant.lattice_fit import quantize_rtn
from tarq_deploy.runtimes.base import BackendError, DecodeOptions, ModelSpec
from tarq_deploy.runtimes.crispasr import ARCH as CRISPASR_ARCH, describe_crispasr_file, is_crispasr_file
from tarq_deploy.runtimes.registry import open_transcriber
from tarq_deploy.runtimes.sources import checked_gguf
from tarq_deploy.runtimes.whisper_cpp import describe_whisper_cpp_file
from tarq_deploy.sweep.plan import load_sweep
from tarq_deploy.vocabulary import TokenTable

# bytes a claimed-size allocation would need at the least (the WAV seeds hold a few KiB): the decoders' peak stays below
ALLOCATION_LIMIT_BYTES = 64 << 20


# ----------------------------------------------------------------------------------------------------- mutations
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def json_edited(draw: st.DrawFn, document: object) -> object:
    """``document`` (parsed JSON) with one value replaced, one key deleted or renamed, somewhere inside it."""
    document = json.loads(json.dumps(document))  # a private copy
    parent, key = _random_slot(draw, document)
    if parent is None:
        return draw(json_values)
    edit = draw(st.sampled_from(("replace", "replace", "delete", "rename")))
    if edit == "replace" or isinstance(parent, list):
        parent[key] = draw(json_values)
    elif edit == "delete":
        del parent[key]
    else:
        parent[draw(st.text(max_size=8))] = parent.pop(key)
    return document


def _random_slot(draw: st.DrawFn, document: object) -> tuple[object | None, object]:
    """A (container, key) reached by walking down from the root a random number of steps."""
    parent, key, node = None, None, document
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)) > 0:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    return parent, key


# --------------------------------------------------------------------------------------------------------- seeds
def wav_seeds() -> list[Seed]:
    """16-bit PCM mono at 16 kHz with a LIST chunk before the data, and float32 at 44.1 kHz (resampled)."""
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((rng.standard_normal(800) * 3000).astype("<i2").tobytes())
    pcm = buffer.getvalue()
    data_at = pcm.index(b"data")
    info = b"LIST" + struct.pack("<I", 4) + b"INFO"
    pcm = pcm[:4] + struct.pack("<I", len(pcm) - 8 + len(info)) + pcm[8:data_at] + info + pcm[data_at:]
    float_wav = encode_wav_float32(rng.standard_normal(2205).astype(np.float32) * 0.1, 44_100)
    return [Seed(data, _wav_fields(data)) for data in (pcm, float_wav)]


def _wav_fields(data: bytes) -> tuple[int, ...]:
    """The RIFF size, every chunk's id and size, and the fmt chunk's fields (tag, channels, rate, byte rate, block
    align, bits)."""
    fields, at = [4, 8], 12
    while at + 8 <= len(data):
        fields += [at, at + 4]
        if data[at:at + 4] == b"fmt ":
            fields += [at + 8 + offset for offset in (0, 2, 4, 8, 12, 14)]
        at += 8 + struct.unpack_from("<I", data, at + 4)[0]
    return tuple(fields)


def whisper_cpp_seed(path: Path) -> Seed:
    """A whisper.cpp Q8_0 model file of one 32-wide layer each side, 16 tokens, 2 mel bins (36 KB)."""
    weight_type = GGMLType.Q8_0
    h = WhisperHParams(n_vocab=16, n_audio_ctx=4, n_audio_state=32, n_audio_head=1, n_audio_layer=1, n_text_ctx=4,
                       n_text_state=32, n_text_head=1, n_text_layer=1, n_mels=2,
                       ftype=FTYPE_OF_TYPE[weight_type] + QNT_VERSION_FACTOR * QNT_VERSION)
    rng = np.random.default_rng(0)
    tensors = [_packed(slot.name, slot.ggml_type(weight_type), slot.shape, rng) for slot in tensor_slots(h)]
    mel = rng.random((h.n_mels, 201), dtype=np.float32)
    vocab = TokenTable.of([bytes([97 + i]) * (1 + i % 3) for i in range(h.n_vocab)])
    write_whisper_cpp(WhisperCppModel(h, mel, vocab, tensors), path)
    return Seed(path.read_bytes(), _whisper_cpp_fields(path))


def _whisper_cpp_fields(path: Path) -> tuple[int, ...]:
    """Magic and header integers, mel dimensions, vocabulary count and token lengths, and every tensor's header
    (dimension count, name length, type, dimensions, name), located from the parsed file."""
    parsed = read_whisper_cpp(path)
    n_header = 1 + len(parsed.hparams.ints())
    fields = [4 * i for i in range(n_header + 2)]  # magic, header, mel filter dimensions
    at = 4 * (n_header + 2) + parsed.mel_filters.nbytes
    fields.append(at)  # the vocabulary count
    at += 4
    for token in parsed.vocab:
        fields.append(at)
        at += 4 + len(token)
    for record in parsed.tensors.values():
        name_at = record.offset - len(record.name.encode())
        header_at = name_at - 12 - 4 * len(record.shape)
        fields += [header_at + 4 * i for i in range(3 + len(record.shape))] + [name_at]
    return tuple(fields)


def _packed(name: str, ggml_type: int, shape: tuple[int, ...], rng: np.random.Generator) -> PackedTensor:
    from gguf.quants import quantize

    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if ggml_type == GGMLType.F32:
        data = values
    elif ggml_type == GGMLType.F16:
        data = values.astype(np.float16)
    else:
        data = quantize(values.reshape(-1, shape[-1]), GGMLType(ggml_type))
    return PackedTensor(name, ggml_type, shape, data)


def gguf_seed(path: Path, size_value_type: int = GGUFValueType.UINT32) -> Seed:
    """A CrispASR-architecture GGUF: general.* keys (general.alignment too), the four size keys describe reads (of
    ``size_value_type``), a string array, a float array, and an F32, an F16 and a Q8_0 tensor (1 KB)."""
    from tarq_deploy.formats.crispasr import SIZE_KEYS

    rng = np.random.default_rng(0)
    size = int if size_value_type != GGUFValueType.STRING else str
    kv = [*file_kv("fuzz", GGMLType.Q8_0), KV("general.alignment", 32, GGUFValueType.UINT32),
          *(KV(key, size(1 + i), size_value_type) for i, key in enumerate(SIZE_KEYS)),
          KV("tokenizer.ggml.tokens", ["a", "bb", "<|x|>"], GGUFValueType.STRING, is_array=True),
          KV(f"{CRISPASR_ARCH}.audio.window", [0.0, 0.5, 1.0], GGUFValueType.FLOAT32, is_array=True)]
    tensors = [_packed("audio.conv.1.weight", GGMLType.F32, (2, 32), rng),
               _packed("output_norm.weight", GGMLType.F16, (32,), rng),
               _packed("token_embd.weight", GGMLType.Q8_0, (4, 32), rng)]
    write_gguf(GGUFModel(CRISPASR_ARCH, kv, tensors), path)
    return Seed(path.read_bytes(), _gguf_fields(path))


def _gguf_fields(path: Path) -> tuple[int, ...]:
    """Where every part of the header, of each key/value and of each tensor info begins (lengths, types, counts,
    values), as gguf-py's own reader lays the file out."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    parts = [*(p for f in reader.fields.values() for p in f.parts), *(p for t in reader.tensors for p in t.field.parts)]
    return tuple(sorted({part.ctypes.data - base for part in parts}))


def checkpoint_seed(directory: Path) -> Path:
    """Two lattice weights (Q4_0 blocks, and a 3-bit override stored as int8 codes), an alias, float32 and bfloat16
    tensors, a byte-level tokenizer (so vocabulary.safetensors is written) and a config."""
    torch.manual_seed(0)
    q4, q3 = LatticeSpec(4, 32), LatticeSpec(3, 32)
    quantized = {"enc.fc1.weight": quantize_rtn(torch.randn(8, 64), q4),
                 "enc.fc2.weight": quantize_rtn(torch.randn(8, 64), q3)}
    tensors = {"enc.ln.weight": torch.randn(64), "enc.embed": torch.randn(4, 8).to(torch.bfloat16)}
    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġc": 2}}, "added_tokens": [
        {"id": 3, "content": "<|endoftext|>"}]}
    files = {"config.json": b'{"d_model": 64}', "tokenizer.json": json.dumps(tokenizer).encode()}
    ckpt = LatticeCheckpoint(q4, quantized, tensors, {"dec.proj.weight": "enc.fc1.weight"},
                             {"method": {"name": "rtn"}}, files)
    return save_checkpoint(ckpt, directory)


SWEEP = """\
[sweep]
target = "whisper.cpp"
methods = ["gptq", "tarq"]
types = ["q4_0", "q8_0"]
baseline = "gptq"
steps = ["quantize", "export", "verify", "eval", "bench"]
reference = true

[models]
"tiny.en" = "packaged:tiny.en"

[calibration]
synth = { manifest = "calib.jsonl", n = 8 }
plain = "calib.jsonl"

[evaluation]
dev = "eval.jsonl"

[quantize]
seed = 0

[eval]
limit = 4
threads = 1

[bench]
threads = [1, 2]
runs = 1
"""
TOML_VALUES = ('0', '-1', '1e999', 'nan', 'true', '""', '"x"', '"q4_0"', '"../../etc/passwd"', '"\\u0000"', '[]',
               '[1, "a"]', '[[1]]', '{}', '{ manifest = 1 }', '{ manifest = "calib.jsonl", n = -3 }', '1979-05-27',
               '"' + "a" * 300 + '"')
TOML_KEYS = ("methdos", "basline", "n", "manifest", '""', "a.b", "target")
TOML_LINES = ("[extra]", "[[sweep]]", "unknown = 1", "[calibration.deep]", "[models]")


@st.composite
def toml_edited(draw: st.DrawFn, text: str) -> str:
    """``text`` with one line's value replaced, a line deleted or duplicated, a key renamed, or a key added."""
    lines = text.splitlines()
    at = draw(st.integers(0, len(lines) - 1))
    key, sep, _ = lines[at].partition(" = ")
    edit = draw(st.sampled_from(("value", "value", "delete", "duplicate", "rename", "add")))
    if edit == "value" and sep:
        lines[at] = f"{key} = {draw(st.sampled_from(TOML_VALUES))}"
    elif edit == "delete":
        del lines[at]
    elif edit == "duplicate":
        lines.insert(at, lines[at])
    elif edit == "rename" and sep:
        lines[at] = f"{draw(st.sampled_from(TOML_KEYS))} = {lines[at].partition(' = ')[2]}"
    else:
        lines.insert(at, draw(st.sampled_from(TOML_LINES)))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def wavs() -> list[Seed]:
    """The WAV seeds, each decoded once here: the first resampling imports scipy.signal, seconds under tracemalloc."""
    seeds = wav_seeds()
    for seed in seeds:
        load_audio(Utterance("seed", "seed.wav", "x", audio_bytes=seed.data))
    return seeds


@pytest.fixture(scope="module")
def bin_seed(work) -> Seed:
    return whisper_cpp_seed(work / "seed.bin")


@pytest.fixture(scope="module")
def gguf(work) -> Seed:
    return gguf_seed(work / "seed.gguf")


@pytest.fixture(scope="module")
def manifest_seed(work, wavs) -> list[dict]:
    """Three valid records whose audio exists (the normaliser is loaded here, not in the first timed example)."""
    spoken_words("warm up")
    for i, seed in enumerate(wavs):
        (work / f"clip{i}.wav").write_bytes(seed.data)
    return [{"id": "a", "audio": "clip0.wav", "text": "The quick brown fox."},
            {"id": "b", "audio": str(work / "clip1.wav"), "text": "a serendipitous quokka, 1847"},
            {"id": "c", "audio": "clip0.wav", "text": "it's Mr. Dashwood's"}]


@pytest.fixture(scope="module")
def sweep_dir(work) -> Path:
    folder = work / "sweep"
    folder.mkdir()
    for name in ("calib.jsonl", "eval.jsonl"):
        (folder / name).write_text("")
    return folder


# --------------------------------------------------------------------------------------------------------- tests
def test_seeds_are_valid(wavs, bin_seed, gguf, work, manifest_seed, sweep_dir):
    """Every seed parses: the fuzz tests start from valid files."""
    for seed in wavs:
        assert load_audio(Utterance("seed", "seed.wav", "x", audio_bytes=seed.data)).size > 0
    assert describe_whisper_cpp_file(work / "seed.bin").precision == "Q8_0"
    assert describe_crispasr_file(work / "seed.gguf").backbone == "qwen3-asr-a1x2-t3x4"
    manifest = work / "seed.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in manifest_seed))
    assert len(load_corpus(manifest)) == 3
    (sweep_dir / "sweep.toml").write_text(SWEEP)
    assert load_sweep(sweep_dir / "sweep.toml").methods == ("gptq", "tarq")


@given(data=st.data())
def test_wav_reader(wavs, data):
    """Truncated, flipped and edited WAVs decode or raise CorpusError, and never allocate what a header claims."""
    mutant = data.draw(mutated(data.draw(st.sampled_from(wavs))))
    tracemalloc.start()
    try:
        parses_or_refuses(lambda: load_audio(Utterance("fuzz", "fuzz.wav", "x", audio_bytes=mutant)), CorpusError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_LIMIT_BYTES, f"decoding {len(mutant)} bytes peaked at {peak} bytes"


@given(data=st.data())
def test_manifest_reader(work, manifest_seed, data):
    """Records edited as JSON (values of any type, keys gone or renamed), then bytes mutated: corpus or CorpusError."""
    records = [data.draw(json_edited(r)) if data.draw(st.booleans()) else r for r in manifest_seed]
    text = "".join(json.dumps(r, ensure_ascii=data.draw(st.booleans())) + "\n" for r in records).encode()
    mutant = data.draw(mutated(Seed(text, tuple(range(len(text)))))) if data.draw(st.booleans()) else text
    path = fresh_path(work, ".jsonl")
    path.write_bytes(mutant)
    parses_or_refuses(lambda: load_corpus(path), CorpusError)


KALDI_SEED = {"wav.scp": "A clip0.wav\nB {work}/clip1.wav\n",
              "text": "A-1 the quick brown fox\nA-2 jumps over\nB-1 a serendipitous quokka\n",
              "segments": "A-1 A 0.0 0.05\nA-2 A 0.05 -1\nB-1 B 0.01 0.04\n"}


@given(data=st.data())
def test_kaldi_reader(work, manifest_seed, data):
    """A Kaldi data folder (wav.scp, text, segments) whose files are mutated, one left out or all kept: a corpus or
    CorpusError naming the file and line."""
    folder = fresh_path(work, "-kaldi")
    folder.mkdir()
    for name, text in KALDI_SEED.items():
        seed = text.format(work=work).replace("clip0.wav", str(work / "clip0.wav")).encode()
        action = data.draw(st.sampled_from(("keep", "keep", "mutate", "mutate", "drop")))
        if action != "drop":
            (folder / name).write_bytes(data.draw(mutated(Seed(seed, tuple(range(len(seed))))))
                                        if action == "mutate" else seed)
    parses_or_refuses(lambda: load_corpus(folder, decode=True), CorpusError)


@settings(max_examples=25)  # each example writes a datasets folder (tens of milliseconds)
@given(data=st.data())
def test_datasets_folder_reader(work, wavs, data):
    """A saved datasets folder whose rows hold any text, stored audio bytes (mutated WAVs), paths or nothing, read
    with the column options: a corpus or CorpusError naming the folder and row."""
    import datasets

    rows = data.draw(st.lists(st.fixed_dictionaries({
        "speech": st.fixed_dictionaries({
            "bytes": st.none() | st.sampled_from(wavs).flatmap(lambda seed: mutated(seed)) | st.binary(max_size=64),
            "path": st.none() | st.sampled_from(["", "missing.wav", str(work / "clip0.wav")])}),
        "words": st.none() | st.text(max_size=20)}), min_size=1, max_size=3))
    stored = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    features = datasets.Features({"speech": stored, "words": datasets.Value("string")})
    folder = fresh_path(work, "-hf")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("speech", "words")},
                               features=features).save_to_disk(str(folder))
    parses_or_refuses(lambda: load_corpus(folder, audio_column="speech", text_column="words", decode=True),
                      CorpusError)


TERMS_SEED = "# drug names\nwarfarin\t2\nJoe Keaton\nnew york city\t1.5\n".encode()


@given(data=st.data())
def test_term_list_reader(work, data):
    """A mutated term list: its terms or TermsError naming the file and line (what quantize/eval --terms print)."""
    from tarq_deploy.data.rarity import written_words
    from tarq_deploy.data.terms import TermsError, read_terms

    path = fresh_path(work, ".txt")
    path.write_bytes(data.draw(mutated(Seed(TERMS_SEED, tuple(range(len(TERMS_SEED)))))))
    parses_or_refuses(lambda: read_terms(path, written_words), TermsError)


@given(data=st.data())
def test_whisper_cpp_reader_and_gate(work, bin_seed, data):
    """The strict .bin parser, and the gate the bench and publish validate with before pywhispercpp sees a file."""
    path = fresh_path(work, ".bin")
    path.write_bytes(data.draw(mutated(bin_seed)))
    parses_or_refuses(lambda: read_whisper_cpp(path), GGMLFileError)
    parses_or_refuses(lambda: describe_whisper_cpp_file(path), GGMLFileError)


@given(data=st.data())
def test_gguf_reader_and_runtime_gates(work, gguf, data):
    """The GGUF parser, and every way a GGUF reaches CrispASR / qwen3-asr.cpp: claims, checked_gguf, describe."""
    path = fresh_path(work, ".gguf")
    path.write_bytes(data.draw(mutated(gguf)))
    spec = ModelSpec("fuzz", str(path), "crispasr")
    parses_or_refuses(lambda: read_gguf(path), GGUFFileError)
    parses_or_refuses(lambda: is_crispasr_file(str(path)))
    parses_or_refuses(lambda: checked_gguf(spec, CRISPASR_ARCH, "CrispASR", "crispasr"), UserError)
    parses_or_refuses(lambda: describe_crispasr_file(path), GGUFFileError)


CHECKPOINT_FILES = ("lattice.safetensors", "tensors.safetensors", "vocabulary.safetensors", "model/config.json",
                    "model/tokenizer.json")


@given(data=st.data())
def test_checkpoint_reader(work, data):
    """A mutated manifest.json (JSON edits; its digest kept, dropped or recomputed) or a mutated file beside it (its
    digests kept or recomputed): load_checkpoint and decoding every weight give the checkpoint or CheckpointError."""
    seed = work / "seed-ckpt"
    if not seed.exists():
        checkpoint_seed(seed)
    target = fresh_path(work, "-ckpt")
    _copy_tree(seed, target)
    manifest = json.loads((seed / MANIFEST).read_text())
    if data.draw(st.booleans()):
        manifest = data.draw(json_edited(manifest))
    else:
        rel = data.draw(st.sampled_from(CHECKPOINT_FILES))
        original = (seed / rel).read_bytes()
        edited = safetensors_edited(original) if rel.endswith(".safetensors") else json_file_edited(original)
        (target / rel).write_bytes(data.draw(edited))
        if data.draw(st.booleans()) and isinstance(manifest.get("files"), dict):
            _record_digests(manifest, rel, (target / rel).read_bytes())
    signing = data.draw(st.sampled_from(("keep", "drop", "recompute")))
    if isinstance(manifest, dict) and signing == "drop":
        manifest.pop(MANIFEST_DIGEST_KEY, None)
    elif isinstance(manifest, dict) and signing == "recompute":
        manifest[MANIFEST_DIGEST_KEY] = manifest_digest(manifest)
    (target / MANIFEST).write_text(json.dumps(manifest))
    verify_hashes = data.draw(st.booleans())

    def load_and_decode() -> None:
        ckpt = load_checkpoint(target, verify_hashes=verify_hashes)
        ckpt.wait_verified()
        ckpt.dequantized_state_dict()
        ckpt.tokens()

    parses_or_refuses(load_and_decode, CheckpointError)


def _copy_tree(source: Path, target: Path) -> None:
    for path in sorted(source.rglob("*")):
        if path.is_file():
            (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (target / path.relative_to(source)).write_bytes(path.read_bytes())


@st.composite
def json_file_edited(draw: st.DrawFn, data: bytes) -> bytes:
    """A JSON file with one value edited (of any type), or its bytes mutated."""
    if draw(st.booleans()):
        return json.dumps(draw(json_edited(json.loads(data)))).encode()
    return draw(mutated(Seed(data, tuple(range(len(data))))))


@st.composite
def safetensors_edited(draw: st.DrawFn, data: bytes) -> bytes:
    """A safetensors file with its JSON header edited (dtypes, shapes, offsets of any type; the length prefix kept
    consistent), or its length prefix and header bytes mutated."""
    n = int.from_bytes(data[:8], "little")
    if draw(st.booleans()):
        header = json.dumps(draw(json_edited(json.loads(data[8:8 + n])))).encode()
        return len(header).to_bytes(8, "little") + header + data[8 + n:]
    return draw(mutated(Seed(data, tuple(range(8 + n)))))


def _record_digests(manifest: dict, rel: str, data: bytes) -> None:
    """What a writer would have recorded for ``data``: a consistent checkpoint with bad content."""
    manifest["files"][rel] = hashlib.sha256(data).hexdigest()
    if isinstance(manifest.get(FAST_DIGESTS_KEY), dict):
        manifest[FAST_DIGESTS_KEY][rel] = fast_digest(data)


@given(data=st.data())
def test_sweep_reader(sweep_dir, data):
    """Sweep files with values of the wrong type, keys renamed, lines deleted, duplicated or added, then bytes
    mutated: load_sweep gives a sweep or a UserError."""
    text = data.draw(toml_edited(SWEEP)).encode() if data.draw(st.booleans()) else SWEEP.encode()
    mutant = data.draw(mutated(Seed(text, tuple(range(len(text)))))) if data.draw(st.booleans()) else text
    path = fresh_path(sweep_dir, ".toml")
    path.write_bytes(mutant)
    parses_or_refuses(lambda: load_sweep(path), UserError)


@pytest.mark.parametrize("old, new", [('"packaged:tiny.en"', '"' + "m" * 300 + '"'),
                                      ('"eval.jsonl"', '"' + "e" * 300 + '.jsonl"')])
def test_a_sweep_path_the_os_cannot_look_up_is_named(sweep_dir, old, new):
    """Found by the long profile: a 300-character name made Path.exists() raise ENAMETOOLONG from load_sweep."""
    path = fresh_path(sweep_dir, ".toml")
    path.write_text(SWEEP.replace(old, new))
    with pytest.raises(UserError, match="not a usable path"):
        load_sweep(path)


# ------------------------------------------------------------------------------------------------ native runtime
@pytest.mark.parametrize("backend, seed_file", [("whisper.cpp", "seed.bin"), ("crispasr", "seed.gguf")])
def test_a_file_the_gate_passes_but_the_runtime_cannot_run_is_an_error_not_a_crash(work, bin_seed, gguf, backend,
                                                                                  seed_file):
    """The seeds pass the gates (their layout is what the runtime reads) but hold no real model: whisper.cpp aborts
    on the 16-token vocabulary (GGML_ASSERT in get_rows: its special tokens have fixed ids near 50257), CrispASR
    segfaults on the tensors a Qwen3-ASR needs and the seed lacks. The runtimes run in a worker subprocess, so the
    crash is a BackendError naming the file (the CLI's exit 2) and this process lives on."""
    path = work / seed_file
    transcriber = None
    with pytest.raises(BackendError) as error:
        transcriber = open_transcriber(ModelSpec("fuzz", str(path), backend), DecodeOptions(timeout_s=120))
        transcriber.transcribe(np.zeros(16_000, dtype=np.float32), "u0")
    if transcriber is not None:
        transcriber.close()
    assert str(path) in str(error.value) and cli.user_error_message(error.value) is not None


# ----------------------------------------------------------------------------------------- crashes found, pinned
# Each was an exception other than the reader's own (a traceback from the CLI) or a hang before its fix; the fuzzing
# above finds most of them again only with the long profile, so they are kept here as plain examples.
def _with_gguf_value(seed: Path, key: str, skip: int, value: bytes, out: Path) -> Path:
    """``seed`` with ``value`` written ``skip`` bytes after the end of metadata key ``key``'s name."""
    data = bytearray(seed.read_bytes())
    at = data.index(key.encode()) + len(key) + skip
    data[at:at + len(value)] = value
    out.write_bytes(data)
    return out


@pytest.mark.parametrize("key, skip, value, problem", [
    ("general.alignment", 4, struct.pack("<I", 0), "general.alignment 0 is not a power of two"),  # ZeroDivisionError
    ("general.alignment", 4, struct.pack("<I", 48), "general.alignment 48 is not a power of two"),
    ("tokenizer.ggml.tokens", 4, struct.pack("<I", GGUFValueType.ARRAY), "is an array of arrays"),  # recursion
    ("tokenizer.ggml.tokens", 8, struct.pack("<Q", 1 << 62), "claims more entries than"),  # a loop of 2^62
])
def test_gguf_metadata_that_crashed_or_hung_the_reader(work, gguf, key, skip, value, problem):
    path = _with_gguf_value(work / "seed.gguf", key, skip, value, fresh_path(work, ".gguf"))
    with pytest.raises(GGUFFileError, match=problem):
        read_gguf(path)


def test_a_size_key_that_is_no_integer_is_a_gguf_error(work):
    """describe (the bench's gate) took int() of it: ValueError or TypeError, a traceback."""
    path = fresh_path(work, ".gguf")
    gguf_seed(path, GGUFValueType.STRING)
    with pytest.raises(GGUFFileError, match="is '1', not an integer"):
        describe_crispasr_file(path)


def test_a_gguf_error_is_a_user_error_the_cli_prints():
    """GGUFFileError was unknown to the CLI: wherever one escaped, a traceback and exit 1."""
    assert cli.user_error_message(GGUFFileError("m.gguf", "truncated")) == "m.gguf: truncated"


@pytest.mark.parametrize("line, problem", [
    ('{"id": 1' + "0" * 5000 + ', "audio": "a.wav", "text": "x"}', "ValueError: Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    (json.dumps({"id": "a", "audio": "a" * 300 + ".wav", "text": "hello"}), "unusable audio path"),  # ENAMETOOLONG
])
def test_manifest_lines_that_crashed_the_reader(work, line, problem):
    path = fresh_path(work, ".jsonl")
    path.write_text(line + "\n")
    with pytest.raises(CorpusError, match=problem):
        load_corpus(path)


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.update(aliases=None), "aliases is not an object"),  # AttributeError in dequantized_state_dict
    (lambda m: m.update(aliases={"x": "nothing"}), "alias x names nothing"),  # KeyError there
    (lambda m: m[FAST_DIGESTS_KEY].update(ghost="0"), "ghost: listed in manifest.json but missing"),  # KeyError
    (lambda m: m.update(quantized=[]), "quantized is not an object"),
])
def test_checkpoint_manifests_that_crashed_the_reader(work, edit, problem):
    """Read with verify_hashes=False (or a manifest without its digest): the manifest is taken as it stands."""
    seed, target = work / "seed-ckpt", fresh_path(work, "-ckpt")
    if not seed.exists():
        checkpoint_seed(seed)
    _copy_tree(seed, target)
    manifest = json.loads((target / MANIFEST).read_text())
    edit(manifest)
    (target / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=problem):
        load_checkpoint(target, verify_hashes=False).dequantized_state_dict()


def test_a_safetensors_dtype_that_is_no_name_is_a_checkpoint_error(work):
    """``dtype not in TORCH_DTYPES`` with a list dtype: TypeError (unhashable), found by the long profile."""
    seed, target = work / "seed-ckpt", fresh_path(work, "-ckpt")
    if not seed.exists():
        checkpoint_seed(seed)
    _copy_tree(seed, target)
    data = (target / "tensors.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["enc.embed"]["dtype"] = ["BF16"]
    text = json.dumps(header).encode()
    (target / "tensors.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(CheckpointError, match=r"dtype \['BF16'\] has no view here"):
        load_checkpoint(target, verify_hashes=False)


def test_a_tokenizer_id_of_a_billion_is_no_token_table():
    """table_of_tokens makes a row for every id up to the largest: 10^9 took minutes and gigabytes."""
    from tarq_deploy.checkpoint import table_of_tokenizer

    with hang_guard(10):
        assert table_of_tokenizer(json.dumps({"model": {"vocab": {"a": 0, "b": 10 ** 9}}}).encode()) is None
