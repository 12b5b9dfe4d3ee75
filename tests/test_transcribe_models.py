"""Qwen3-ASR and Voxtral for transcribe.cpp (formats/transcribe_llm.py) on tiny random models with the real
architecture (tarq_deploy/models/qwen3_asr_shapes.py, tarq_deploy/models/voxtral_shapes.py): ``export --target transcribe.cpp`` of lattice
checkpoints (Qwen3-ASR uniform Q4_0; Voxtral a Q4_K language model with a Q8_0 audio tower) keeps every matrix's
lattice type, ``verify`` is exact, the transcribe-cpp wheel loads and decodes both through the runtime adapter's
worker subprocess, the Voxtral logits agree with PyTorch holding the same lattice, a type the loader rejects is
refused before any file exists, and verify survives damaged files (hypothesis).

The wheel shows no logits through its API; its release build dumps named tensors when TRANSCRIBE_DUMP_DIR is set
(the log-mel it computed, ``enc.mel.in``, and the last prompt position's logits, ``dec.logits_raw``), so PyTorch is
given the runtime's own log-mel and the same prompt, and the two logit vectors are compared."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tarq_deploy.checkpoint import load_checkpoint
from tarq_deploy.cli import main as cli
from tarq_deploy.formats.gguf_file import read_gguf
from tarq_deploy.formats.transcribe_llm import tekken_merges, transcribe_name
from tarq_deploy.formats.verification import VERIFY_ERRORS, verify_model_file
from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
from tarq_deploy.runtimes.registry import infer_runtime, open_transcriber

sys.path.insert(0, str(Path(__file__).parent))
from tarq_deploy.models import qwen3_asr_shapes as tiny_qwen  # noqa: E402
from tarq_deploy.models.voxtral_shapes import AUDIO_TOKEN_ID, load_tiny_voxtral, write_tiny_voxtral  # noqa: E402

pytest.importorskip("transcribe_cpp")
Q4_0, Q8_0, Q4_K, F16, F32 = 2, 8, 12, 1, 0
# Voxtral's last-position logits, runtime vs PyTorch, as a share of the largest |logit|: measured 0.0084-0.0112
# over 12 noise inputs (3 s and 8 s, 6 seeds; 2-core AMD EPYC, the wheel's haswell kernels), the runtime's log-mel
# within 2.3e-5 of transformers'. ggml quantizes activations to Q8_K / Q8_0 for the quantized matmuls, so agreement
# is close, not bitwise; the bound leaves ~2.7x for other CPUs' kernels (AVX-512 on Intel Xeon), as for CrispASR
VOXTRAL_LOGIT_BOUND = 0.03


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("transcribe_models")


@pytest.fixture(scope="module")
def qwen_dir(work) -> Path:
    try:
        tiny_qwen.qwen_tokenizer_dir()
    except OSError as error:
        pytest.fail(f"the Qwen tokenizer source is unavailable: {error}", pytrace=False)
    return tiny_qwen.write_tiny_qwen3_asr(work / "qwen3_asr")


@pytest.fixture(scope="module")
def voxtral_dir(work) -> Path:
    out = write_tiny_voxtral(work / "voxtral")
    model, _ = load_tiny_voxtral(out)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())  # the F16 tensors of the file hold them exactly
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(qwen_dir, voxtral_dir, work) -> dict[str, Path]:
    recipes = {"qwen3_asr": (qwen_dir, ["--type", "q4_0"]),
               "voxtral": (voxtral_dir, ["--type", "q4_k", "--quantize-audio-tower", "--tensor-type",
                                         "audio_tower=q8_0"])}
    for name, (model, recipe) in recipes.items():
        assert cli(["quantize", "--model", str(model), "--method", "rtn", "--target", "crispasr", *recipe,
                    "--out", str(work / f"{name}-ckpt")]) == 0
    return {name: work / f"{name}-ckpt" for name in recipes}


@pytest.fixture(scope="module")
def exports(checkpoints, work) -> dict[str, Path]:
    files = {name: work / f"{name}.gguf" for name in checkpoints}
    for name, ckpt in checkpoints.items():
        assert cli(["export", str(ckpt), "--target", "transcribe.cpp", "-o", str(files[name])]) == 0
    return files


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


# ------------------------------------------------------------------------------------------------------- files
def test_each_matrix_keeps_its_lattice_type_under_transcribe_cpps_names(exports):
    qwen = read_gguf(exports["qwen3_asr"])
    kinds = {name: record.ggml_type for name, record in qwen.tensors.items()}
    assert qwen.arch == "qwen3_asr" and qwen.integer("stt.qwen3_asr.decoder.vocab_size") == 151936
    assert kinds["enc.blocks.1.attn.q.weight"] == kinds["dec.blocks.0.ffn.gate.weight"] == Q4_0
    assert kinds["dec.token_embd.weight"] == kinds["enc.conv_out.weight"] == Q4_0  # the tied head is quantized too
    assert kinds["enc.conv.2.weight"] == F16 and kinds["enc.blocks.0.norm_attn.bias"] == F32
    assert "dec.output.weight" not in kinds  # tied: the loader projects with the embedding
    voxtral = read_gguf(exports["voxtral"])
    kinds = {name: record.ggml_type for name, record in voxtral.tensors.items()}
    assert kinds["dec.blocks.1.ffn.up.weight"] == kinds["dec.blocks.0.attn.o.weight"] == Q4_K
    assert kinds["enc.blocks.0.ffn.fc1.weight"] == Q8_0 and kinds["enc.pos_emb.weight"] == F32
    assert kinds["proj.linear_1.weight"] == kinds["dec.output.weight"] == F16  # kept float by the recipe
    assert voxtral.integer("stt.voxtral.projector.input_dim") == 4 * 128
    for model in (qwen, voxtral):
        assert model.tensors["frontend.mel_filterbank"].shape == (128, 201)


@pytest.mark.parametrize("name", ["qwen3_asr", "voxtral"])
def test_verify_is_exact(name, exports, checkpoints, capsys):
    assert cli(["verify", str(exports[name]), "--against", str(checkpoints[name]), "--json"]) == 0
    diffs, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)
    assert len(diffs) == len(read_gguf(exports[name]).tensors) and max(diffs.values()) == 0.0


def test_names_and_tekken_merges():
    assert transcribe_name("audio.conv.1.weight") == "enc.conv.0.weight"
    assert transcribe_name("audio.blk.3.ffn_down.bias") == "enc.blocks.3.ffn.fc2.bias"
    assert transcribe_name("blk.2.attn_output.weight") == "dec.blocks.2.attn.o.weight"
    assert transcribe_name("proj2.weight") == "proj.linear_2.weight"
    from tarq_deploy.formats.crispasr_voxtral import TekkenVocab

    vocab = TekkenVocab("", ["<unk>"], [b"a", b"b", b" ", b"ab", b" ab", b"abab"])
    assert tekken_merges(vocab) == ["a b", "Ġ ab", "ab ab"]  # by the merged piece's rank; byte-level spelling


# ----------------------------------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("name", ["qwen3_asr", "voxtral"])
def test_the_wheel_loads_and_decodes_through_the_adapter(name, exports):
    assert infer_runtime(str(exports[name])) == "transcribe.cpp"
    transcriber = open_transcriber(ModelSpec(name, str(exports[name]), "transcribe.cpp"), DecodeOptions(threads=1))
    try:
        text = transcriber.transcribe(noise(2.0, 0), "noise")
        assert transcriber.describe()["loaded_as"].startswith("transcribe.cpp ")
    finally:
        transcriber.close()
    assert text  # a random model: some text, any text


def test_crispasr_leaves_transcribe_cpps_voxtral_alone(exports):
    from tarq_deploy.runtimes.crispasr import is_crispasr_file
    from tarq_deploy.runtimes.transcribe_cpp import describe_transcribe_cpp_file

    assert not is_crispasr_file(str(exports["voxtral"]))
    info = describe_transcribe_cpp_file(exports["voxtral"])
    assert info.details["arch"] == "voxtral" and info.details["text_layers"] == 2


def test_voxtral_logits_agree_with_pytorch(exports, checkpoints, work, monkeypatch):
    """The runtime's log-mel and last-prompt-position logits (its debug dumps) against PyTorch fed that log-mel and
    the same prompt: <s> [INST] [BEGIN_AUDIO] [AUDIO]*375 [/INST] [TRANSCRIBE]."""
    from tarq_deploy.models.voxtral import VoxtralBackbone, load_dequantized_voxtral

    dump = work / "dump"
    dump.mkdir()
    monkeypatch.setenv("TRANSCRIBE_DUMP_DIR", str(dump))  # the worker inherits it
    transcriber = open_transcriber(ModelSpec("v", str(exports["voxtral"]), "transcribe.cpp"), DecodeOptions())
    try:
        transcriber.transcribe(noise(3.0, 1), "noise")
    finally:
        transcriber.close()
    mel = _dumped(dump, "enc.mel.in")
    got = _dumped(dump, "dec.logits_raw")
    model, processor = load_dequantized_voxtral(checkpoints["voxtral"])
    backbone = VoxtralBackbone(model, processor, language=None)
    ids = backbone.prompt_ids(backbone.audio_token_count(1))
    assert ids.count(AUDIO_TOKEN_ID) == 375 and mel.shape == (128, 3000)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), input_features=torch.from_numpy(mel)[None]).logits[0, -1].numpy()
    spread = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"voxtral logits: max |runtime - pytorch| / max |logit| = {spread:.4g}")
    assert spread <= VOXTRAL_LOGIT_BOUND
    top = np.argsort(want)[::-1]
    if want[top[0]] - want[top[1]] > 2 * VOXTRAL_LOGIT_BOUND * np.abs(want).max():  # a clear winner wins there too
        assert got.argmax() == top[0]


def _dumped(directory: Path, name: str) -> np.ndarray:
    shape = json.loads((directory / f"{name}.json").read_text())["shape"]
    return np.fromfile(directory / f"{name}.f32", dtype="<f4").reshape(shape)


# ------------------------------------------------------------------------------------------------------ refusals
def test_a_type_the_loader_rejects_is_refused_before_any_file_exists(qwen_dir, work, capsys):
    ckpt = work / "qwen3_asr-iq4_nl"
    assert cli(["quantize", "--model", str(qwen_dir), "--method", "rtn", "--target", "crispasr", "--type", "iq4_nl",
                "--out", str(ckpt)]) == 0
    out = work / "refused" / "iq4_nl.gguf"
    out.parent.mkdir()
    capsys.readouterr()
    assert cli(["export", str(ckpt), "--target", "transcribe.cpp", "-o", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "iq4_nl" in error and "transcribe.cpp" in error and "--type" in error
    assert not list(out.parent.iterdir())  # no file, no temporary


def test_a_layers_gate_and_up_in_two_types_are_refused(voxtral_dir, work, capsys):
    """The loader fuses them into one matrix; the export names both and writes nothing."""
    ckpt = work / "voxtral-gate-q8_0"
    assert cli(["quantize", "--model", str(voxtral_dir), "--method", "rtn", "--target", "crispasr", "--type", "q4_k",
                "--tensor-type", "gate_proj=q8_0", "--out", str(ckpt)]) == 0
    out = work / "gate" / "mixed.gguf"
    out.parent.mkdir()
    capsys.readouterr()
    assert cli(["export", str(ckpt), "--target", "transcribe.cpp", "-o", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "gate_proj.weight is q8_0" in error and "up_proj.weight is q4_k" in error
    assert not list(out.parent.iterdir())


def test_float_models_export_f16_with_qwen3_asrs_tied_head_left_out(qwen_dir, work):
    """A float Qwen3-ASR's state dict lists lm_head beside the embedding it shares: the file has no slot for it."""
    out = work / "qwen3_asr-f16.gguf"
    assert cli(["export", "--model", str(qwen_dir), "--target", "transcribe.cpp", "-o", str(out)]) == 0
    kinds = {name: record.ggml_type for name, record in read_gguf(out).tensors.items()}
    assert kinds["dec.token_embd.weight"] == kinds["enc.blocks.0.attn.q.weight"] == F16
    assert "dec.output.weight" not in kinds


# ------------------------------------------------------------------------------------------------------ fuzzing
@pytest.fixture(scope="module")
def voxtral_bytes(exports, checkpoints) -> tuple[bytes, object]:
    return exports["voxtral"].read_bytes(), load_checkpoint(checkpoints["voxtral"])


@settings(max_examples=40)
@given(data=st.data())
def test_verify_names_any_damage(voxtral_bytes, tmp_path_factory, data):
    """A truncated or byte-changed transcribe.cpp Voxtral file: verify returns its differences or raises one of its
    named errors (exit 2 in the CLI), never another exception."""
    original, checkpoint = voxtral_bytes
    damaged = bytearray(original)
    if data.draw(st.booleans(), label="truncate"):
        damaged = damaged[:data.draw(st.integers(0, len(original) - 1), label="length")]
    else:
        header = min(len(original), 200_000)  # keys and tensor infos: where structure lies
        for _ in range(data.draw(st.integers(1, 4), label="edits")):
            at = data.draw(st.integers(0, header - 1), label="at")
            damaged[at] = data.draw(st.integers(0, 255), label="byte")
    path = tmp_path_factory.mktemp("fuzz") / "damaged.gguf"
    path.write_bytes(bytes(damaged))
    try:
        result = verify_model_file(path, checkpoint)
    except VERIFY_ERRORS:
        return
    assert isinstance(result.diffs, dict)
