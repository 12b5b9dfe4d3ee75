"""The CTranslate2 Whisper importer, checked against ctranslate2 itself on the real packaged weights.

Reference: ``ctranslate2.models.Whisper`` (float32 compute) on the same directory and the same log-mel features,
greedy decoding. Audio comes from the shared fixtures ``jfk_wav`` and ``librivox_clips`` (tests/conftest.py).
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import struct
import wave
from pathlib import Path

import ctranslate2
import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from tarq_deploy.models import packaged
from tarq_deploy.models.ct2 import (
    CT2_NUMPY_DTYPES,
    Ct2Checkpoint,
    load_ct2_whisper,
    plan_tensor_routes,
    read_ct2_model_bin,
    save_as_transformers,
)
from tarq_deploy.formats.model_loader import load_whisper
from tarq_deploy.models.packaged import PackagedModelError, resolve_packaged

SAMPLE_RATE = 16_000
LIBRIVOX_CLIPS_COMPARED = 3
MAX_LOGIT_DIFF = 1e-3
JFK_PHRASE = "ask not what your country can do for you"
TIED_ALIAS = {"decoder/projection/weight": "decoder/embeddings/weight"}
# One thread per engine: torch and ctranslate2 each bring an OpenMP pool, and taking turns on 2 shared cores,
# each pool's spinning idle threads starved the other (measured 4x more CPU time with 2 threads each).
ENGINE_THREADS = 1
SYNTHETIC_STEPS = 12


# ----------------------------------------------------------------------------------------------- helpers


def read_wav_16k(path: str) -> np.ndarray:
    """16-bit PCM mono 16 kHz WAV as float32 in [-1, 1)."""
    with wave.open(path, "rb") as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (SAMPLE_RATE, 1, 2), path
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


def log_mel(processor, path: str) -> np.ndarray:
    """[1, n_mels, 3000] features; both engines get exactly these, so only the networks are compared."""
    extractor = processor.feature_extractor
    return extractor(read_wav_16k(path), sampling_rate=SAMPLE_RATE, return_tensors="np").input_features


def decoder_prompt(generation_config) -> list[int]:
    """<|startoftranscript|> [<|en|> <|transcribe|>] <|notimestamps|>: English transcription, no timestamps."""
    language_task = []
    if generation_config.is_multilingual:
        language_task = [generation_config.lang_to_id["<|en|>"], generation_config.task_to_id["transcribe"]]
    return [generation_config.decoder_start_token_id, *language_task, generation_config.no_timestamps_token_id]


def hf_greedy_ids(model, features: np.ndarray, generation_config) -> list[int]:
    """Text token ids from transformers' greedy Whisper generate (prompt and end-of-text removed)."""
    language = {"language": "en", "task": "transcribe"} if generation_config.is_multilingual else {}
    with torch.inference_mode():
        output = model.generate(torch.from_numpy(features), num_beams=1, do_sample=False,
                                return_timestamps=False, **language)
    ids = output[0].tolist()
    prompt = decoder_prompt(generation_config)
    ids = ids[len(prompt):] if ids[:len(prompt)] == prompt else ids
    return ids[:-1] if ids and ids[-1] == generation_config.eos_token_id else ids


def ct2_greedy(whisper: ctranslate2.models.Whisper, features: np.ndarray, prompt: list[int],
               max_length: int = 448) -> tuple[list[int], np.ndarray]:
    """ctranslate2 greedy ids and its per-step logits ([steps, vocab]; suppressed ids are -FLT_MAX)."""
    result = whisper.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)), [prompt],
                              beam_size=1, max_length=max_length, return_logits_vocab=True)[0]
    logits = np.stack([np.asarray(step) for step in result.logits[0]])
    return list(result.sequences_ids[0]), logits


def ct2_reference(directory: Path) -> ctranslate2.models.Whisper:
    return ctranslate2.models.Whisper(str(directory), device="cpu", compute_type="float32",
                                      intra_threads=ENGINE_THREADS)


def write_model_bin(path: Path, variables: dict[str, np.ndarray], aliases: dict[str, str], *,
                    version: int = 6, spec: str = "WhisperSpec", revision: int = 3,
                    dtype_ids: dict[str, int] | None = None) -> None:
    """Minimal CTranslate2 model.bin writer, for synthetic and deliberately broken files."""
    type_id_of = {dtype: type_id for type_id, dtype in CT2_NUMPY_DTYPES.items() if type_id != 5}
    dtype_ids = dtype_ids or {}

    def string(text: str) -> bytes:
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    chunks = [struct.pack("<I", version), string(spec), struct.pack("<II", revision, len(variables))]
    for name, array in variables.items():
        type_id = dtype_ids[name] if name in dtype_ids else type_id_of[array.dtype.newbyteorder("<")]
        chunks += [string(name), struct.pack("<B", array.ndim), struct.pack(f"<{array.ndim}I", *array.shape),
                   struct.pack("<BI", type_id, array.nbytes), array.tobytes()]
    chunks.append(struct.pack("<I", len(aliases)))
    chunks += [string(alias) + string(target) for alias, target in aliases.items()]
    path.write_bytes(b"".join(chunks))


def fp16_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: tensor.detach().to(torch.float16).numpy() for name, tensor in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(ENGINE_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return resolve_packaged("packaged:tiny.en")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """(model fp32, processor, generation config) of the real tiny.en, through the public loader."""
    return load_whisper("packaged:tiny.en")


@pytest.fixture(scope="module")
def speech(jfk_wav: str, librivox_clips: list[tuple[str, str]]) -> list[str]:
    shortest = sorted(librivox_clips, key=lambda clip: len(clip[1]))[:LIBRIVOX_CLIPS_COMPARED]
    return [jfk_wav, *(wav for wav, _ in shortest)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir, tiny, speech) -> dict[str, tuple[np.ndarray, list[int], np.ndarray]]:
    """Per clip: (features, ctranslate2 greedy ids, ctranslate2 per-step logits), computed once."""
    _, processor, generation_config = tiny
    whisper = ct2_reference(tiny_dir)
    prompt = decoder_prompt(generation_config)
    reference = {}
    for clip in speech:
        features = log_mel(processor, clip)
        reference[clip] = (features, *ct2_greedy(whisper, features, prompt))
    return reference


@pytest.fixture(scope="module")
def synthetic_whisper(tmp_path_factory, tiny_dir):
    """A 1-layer, 2-head, d_model 8 Whisper (random weights) written as a CTranslate2 directory.

    Its variable names are the real tiny.en names of layer 0; values come from a random transformers model
    through the importer's own routes, so a different geometry exercises the config derivation.
    """
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51864, d_model=8, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                           decoder_ffn_dim=16, pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
                           decoder_start_token_id=50257)
    reference = WhisperForConditionalGeneration(config).eval()
    real = read_ct2_model_bin(tiny_dir / "model.bin")
    layer_zero_only = [name for name in real.variables if not re.search(r"/layer_[1-9]", name)]
    switches = {name: real.variables[name] for name in layer_zero_only if real.variables[name].ndim == 0}
    switches |= {name: np.array(2, dtype="<i2") for name in switches if name.endswith("num_heads")}
    routes, _ = plan_tensor_routes([name for name in layer_zero_only if name not in switches])
    state = fp16_state(reference)
    variables = {route.ct2_name: route.join(state) for route in routes} | switches
    directory = tmp_path_factory.mktemp("synthetic_ct2")
    for sidecar in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copyfile(tiny_dir / sidecar, directory / sidecar)
    write_model_bin(directory / "model.bin", variables, TIED_ALIAS)
    return directory, variables, reference


# ----------------------------------------------------------------------------------------------- real tiny.en


def test_tiny_en_greedy_transcription_matches_ctranslate2(tiny, tiny_reference):
    model, processor, generation_config = tiny
    for clip, (features, ct2_ids, _) in tiny_reference.items():
        hf_ids = hf_greedy_ids(model, features, generation_config)
        assert hf_ids == ct2_ids, f"{clip}: transformers {hf_ids} != ctranslate2 {ct2_ids}"
        assert hf_ids, f"{clip}: empty transcription"
    jfk_ids = next(iter(tiny_reference.values()))[1]
    assert JFK_PHRASE in processor.tokenizer.decode(jfk_ids, skip_special_tokens=True).lower()


def test_tiny_en_teacher_forced_logits_match_ctranslate2(tiny, tiny_reference):
    model, _, generation_config = tiny
    prompt = decoder_prompt(generation_config)
    for clip, (features, ct2_ids, ct2_logits) in tiny_reference.items():
        with torch.inference_mode():
            logits = model(input_features=torch.from_numpy(features),
                           decoder_input_ids=torch.tensor([prompt + ct2_ids])).logits[0].numpy()
        predicting = logits[len(prompt) - 1:]  # positions that predict each generated token and end-of-text
        assert predicting.shape == ct2_logits.shape
        allowed = ct2_logits > np.finfo(np.float32).min / 2  # ctranslate2 reports suppressed ids as -FLT_MAX
        max_diff = float(np.abs(predicting - ct2_logits)[allowed].max())
        assert max_diff < MAX_LOGIT_DIFF, f"{clip}: logits differ by {max_diff}"


def test_fp16_weights_reproduce_ct2_file_bit_for_bit(tiny, tiny_dir):
    model, _, _ = tiny
    checkpoint = read_ct2_model_bin(tiny_dir / "model.bin")
    tensors = [name for name, array in checkpoint.variables.items() if array.ndim > 0]
    routes, unrouted = plan_tensor_routes(tensors)
    assert unrouted == []
    state = fp16_state(model)
    for route in routes:
        stored = checkpoint.variables[route.ct2_name]
        rebuilt = route.join(state)
        assert rebuilt.dtype == stored.dtype and rebuilt.tobytes() == stored.tobytes(), route.ct2_name
    assert checkpoint.aliases == TIED_ALIAS
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()


def test_tokenizer_has_timestamps_and_whisper_special_layout(tiny):
    model, processor, generation_config = tiny
    tokenizer = processor.tokenizer
    assert len(tokenizer) == model.config.vocab_size == 51864
    assert tokenizer.convert_tokens_to_ids("<|0.00|>") == generation_config.no_timestamps_token_id + 1
    assert tokenizer.convert_tokens_to_ids("<|30.00|>") == model.config.vocab_size - 1
    assert tokenizer.all_special_ids[-1] == generation_config.no_timestamps_token_id
    ids = tokenizer("ask not").input_ids
    with_times = [ids[0], ids[1], generation_config.no_timestamps_token_id + 1, *ids[2:-1], 51863, ids[-1]]
    assert tokenizer.decode(with_times, decode_with_timestamps=True, skip_special_tokens=True) == \
        "<|0.00|>ask not<|30.00|>"
    assert processor.feature_extractor.feature_size == model.config.num_mel_bins == 80
    assert not generation_config.is_multilingual and model.config.max_target_positions == 448


# ----------------------------------------------------------------------------------------------- file errors


def test_truncated_model_bin_raises_value_error_naming_file(tmp_path, tiny_dir):
    real = (tiny_dir / "model.bin").read_bytes()
    for cut in (3, 40, 1 << 20, len(real) - 1):
        broken = tmp_path / f"cut{cut}" / "model.bin"
        broken.parent.mkdir()
        broken.write_bytes(real[:cut])
        with pytest.raises(ValueError, match="truncated") as error:
            read_ct2_model_bin(broken)
        assert str(broken) in str(error.value)


def test_bad_version_dtype_size_and_trailing_bytes_raise_value_error(tmp_path):
    weight = {"encoder/conv1/bias": np.zeros(4, dtype=np.float16)}
    cases = {
        "version": (dict(version=5), "binary version 5"),
        "dtype": (dict(dtype_ids={"encoder/conv1/bias": 9}), "dtype id 9"),
    }
    for label, (options, message) in cases.items():
        path = tmp_path / f"{label}.bin"
        write_model_bin(path, weight, {}, **options)
        with pytest.raises(ValueError, match=message) as error:
            read_ct2_model_bin(path)
        assert str(path) in str(error.value)
    good = tmp_path / "good.bin"
    write_model_bin(good, weight, {})
    assert read_ct2_model_bin(good).variables["encoder/conv1/bias"].shape == (4,)
    trailing = tmp_path / "trailing.bin"
    trailing.write_bytes(good.read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match="unexpected bytes"):
        read_ct2_model_bin(trailing)
    wrong_size = bytearray(good.read_bytes())
    size_offset = wrong_size.index(b"encoder/conv1/bias\0") + len("encoder/conv1/bias\0") + 1 + 4 + 1
    wrong_size[size_offset:size_offset + 4] = struct.pack("<I", 7)
    (tmp_path / "size.bin").write_bytes(bytes(wrong_size))
    with pytest.raises(ValueError, match="declares 7 bytes"):
        read_ct2_model_bin(tmp_path / "size.bin")


def test_reader_parses_header_and_bfloat16(tmp_path):
    bf16_bits = np.array([0x3F80, 0xC000], dtype="<u2")  # 1.0, -2.0
    path = tmp_path / "model.bin"
    write_model_bin(path, {"w": bf16_bits, "n": np.array(6, dtype="<i2")}, {"alias": "w"},
                    spec="SomeSpec", revision=7, dtype_ids={"w": 5})
    checkpoint = read_ct2_model_bin(path)
    assert isinstance(checkpoint, Ct2Checkpoint)
    assert (checkpoint.spec_name, checkpoint.revision, checkpoint.aliases) == ("SomeSpec", 7, {"alias": "w"})
    assert checkpoint.variables["w"].tolist() == [1.0, -2.0] and checkpoint.scalar("n") == 6


# ----------------------------------------------------------------------------------------------- strict mapping


def test_synthetic_geometry_loads_exactly(synthetic_whisper):
    directory, _, reference = synthetic_whisper
    model, processor, _ = load_ct2_whisper(directory)
    assert (model.config.encoder_layers, model.config.decoder_attention_heads, model.config.d_model) == (1, 2, 8)
    expected = {name: tensor.to(torch.float16).to(torch.float32) for name, tensor in reference.state_dict().items()}
    for name, tensor in model.state_dict().items():
        if name.endswith("k_proj.bias"):
            continue
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert len(processor.tokenizer) == 51864


def test_synthetic_geometry_matches_ctranslate2_logits(synthetic_whisper):
    directory, _, _ = synthetic_whisper
    model, _, generation_config = load_ct2_whisper(directory)
    features = np.random.default_rng(0).standard_normal((1, 80, 3000)).astype(np.float32)
    prompt = decoder_prompt(generation_config)
    ids, ct2_logits = ct2_greedy(ct2_reference(directory), features, prompt, max_length=SYNTHETIC_STEPS)
    with torch.inference_mode():
        logits = model(input_features=torch.from_numpy(features),
                       decoder_input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:].numpy()
    logits = logits[:len(ct2_logits)]  # random weights rarely emit end-of-text; the run stops at max_length
    allowed = ct2_logits > np.finfo(np.float32).min / 2
    assert float(np.abs(logits - ct2_logits)[allowed].max()) < MAX_LOGIT_DIFF


@pytest.mark.parametrize("change, message", [
    ("drop", "missing parameters: \\['model.decoder.layers.0.fc2.bias'\\]"),
    ("extra", "no transformers counterpart: \\['decoder/layer_0/ffn/linear_9/weight'\\]"),
    ("switch", "decoder/activation = 1"),
])
def test_strict_loading_names_missing_and_extra(tmp_path, synthetic_whisper, change, message):
    directory, variables, _ = synthetic_whisper
    variables = dict(variables)
    if change == "drop":
        del variables["decoder/layer_0/ffn/linear_1/bias"]
    elif change == "extra":
        variables["decoder/layer_0/ffn/linear_9/weight"] = np.zeros((2, 2), dtype=np.float16)
    else:
        variables["decoder/activation"] = np.array(1, dtype=np.int8)
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    write_model_bin(broken / "model.bin", variables, TIED_ALIAS)
    with pytest.raises(ValueError, match=message) as error:
        load_ct2_whisper(broken)
    assert str(broken / "model.bin") in str(error.value)


# ----------------------------------------------------------------------------------------------- loader


def test_loader_round_trips_through_transformers_directory(tmp_path, tiny, tiny_dir):
    model, _, generation_config = tiny
    out_dir = save_as_transformers(tiny_dir, tmp_path / "tiny-en-hf")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    reloaded, processor, reloaded_generation = load_whisper(str(out_dir))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    assert len(processor.tokenizer) == 51864
    assert processor.tokenizer.convert_tokens_to_ids("<|0.00|>") == generation_config.no_timestamps_token_id + 1
    assert reloaded_generation.suppress_tokens == generation_config.suppress_tokens
    with pytest.raises(FileExistsError):
        save_as_transformers(tiny_dir, out_dir)


def test_loader_rejects_unknown_local_paths_and_names(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="neither a CTranslate2 Whisper directory"):
        load_whisper(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_whisper(str(tmp_path / "missing"))
    with pytest.raises(PackagedModelError, match="packaged:tiny.en"):
        load_whisper("packaged:large-v3")


def test_missing_package_names_the_pip_extra(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged.importlib.metadata, "distribution", not_installed)
    with pytest.raises(PackagedModelError, match=r"tarq-deploy\[models\]"):
        resolve_packaged("packaged:tiny.en")


# ----------------------------------------------------------------------------------------------- real base


def test_packaged_base_assembles_and_matches_ctranslate2_on_jfk(tmp_path, monkeypatch, jfk_wav):
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path))
    directory = resolve_packaged("packaged:base")
    assert directory == tmp_path / "packaged" / "base"
    assert (directory / "model.bin").stat().st_size == packaged.PACKAGED_MODELS["base"].model_bin_size
    assembled_at = (directory / "model.bin").stat().st_mtime_ns
    assert resolve_packaged("base") == directory and (directory / "model.bin").stat().st_mtime_ns == assembled_at
    assert sorted(p.name for p in (tmp_path / "packaged").iterdir()) == ["base"]

    model, processor, generation_config = load_whisper("packaged:base")
    assert generation_config.is_multilingual and len(processor.tokenizer) == model.config.vocab_size == 51865
    features = log_mel(processor, jfk_wav)
    ct2_ids, _ = ct2_greedy(ct2_reference(directory), features, decoder_prompt(generation_config))
    hf_ids = hf_greedy_ids(model, features, generation_config)
    assert hf_ids == ct2_ids
    assert JFK_PHRASE in processor.tokenizer.decode(hf_ids, skip_special_tokens=True).lower()
