"""transcribe.cpp's presets as --tensor-type q4_k_m / q5_k_m (quant/presets.py): the per-tensor type plan for real
tiny.en and base dimensions against a table written out from transcribe.cpp's policy (tools/transcribe-quantize/
policy.cpp, 0.2.1), refusals of a preset where it does not apply, and, on real tiny.en with ggml's own quantizer
(--method ggml): the file verifies exact, carries the preset's general.file_type, loads and transcribes jfk in the
transcribe-cpp wheel, and holds the very bytes transcribe.cpp's own quantizer writes -- its `transcribe-quantize`
re-done here from its steps (dequantize the F16 GGUF to float32, ggml_quantize_chunk with no importance matrix into
the preset's type) with the ggml_quantize_chunk of the wheel's own libggml-base.so, tensor by tensor.

The wheel runs in child processes: a native abort must fail one test, not kill pytest.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jiwer
import numpy as np
import pytest

from tarq_deploy.cli import main
from tarq_deploy.data.normalize import normalized_words
from tarq_deploy.data.real_clips import JFK_TEXT
from tarq_deploy.formats.ggml_blocks import GGML_TYPE_NAMES
from tarq_deploy.formats.gguf_file import file_type_name, read_gguf
from tarq_deploy.formats.transcribe_whisper import preset_plan, preset_tensor_types
from tarq_deploy.models.whisper_shapes import WHISPER_DIMS
from tarq_deploy.quant.presets import PRESETS, find_preset

HAS_WHEEL = importlib.util.find_spec("transcribe_cpp_native") is not None
needs_wheel = pytest.mark.skipif(not HAS_WHEEL, reason="the transcribe-cpp wheel (dev extra) runs the files")

# Real dimensions: tiny.en (English-only vocabulary) and base (multilingual), with Whisper's positional tables.
CONFIGS = {"tiny.en": {**WHISPER_DIMS["tiny"], "vocab_size": 51864, "max_source_positions": 1500,
                       "max_target_positions": 448},
           "base": {**WHISPER_DIMS["base"], "vocab_size": 51865, "max_source_positions": 1500,
                    "max_target_positions": 448}}
# transcribe.cpp's policy worked out by hand for each weight matrix role (the rows: d_model 384 for tiny, 512 for
# base; fc2's rows are ffn_dim 1536 / 2048): a K-quant needs rows of a multiple of 256, else Q8_0; attention outputs
# Q8_0; the tied token embedding Q6_K (which 384 does not divide either: Q8_0).
MATRIX_TABLE = {
    ("tiny.en", "q4_k_m"): dict(q="q8_0", k="q8_0", v="q8_0", out="q8_0", fc1="q8_0", fc2="q4_k", embed="q8_0"),
    ("tiny.en", "q5_k_m"): dict(q="q8_0", k="q8_0", v="q8_0", out="q8_0", fc1="q8_0", fc2="q5_k", embed="q8_0"),
    ("base", "q4_k_m"): dict(q="q4_k", k="q4_k", v="q4_k", out="q8_0", fc1="q4_k", fc2="q4_k", embed="q6_k"),
    ("base", "q5_k_m"): dict(q="q5_k", k="q5_k", v="q5_k", out="q8_0", fc1="q5_k", fc2="q5_k", embed="q6_k"),
}
FILE_TYPES = {"q4_k_m": 15, "q5_k_m": 17}  # llama.cpp's MOSTLY_Q4_K_M / MOSTLY_Q5_K_M, as transcribe-quantize tags


def expected_type(model: str, preset: str, name: str) -> str:
    """The table's type of one GGUF tensor: matrices by role, everything else (conv kernels included) F32."""
    roles = MATRIX_TABLE[(model, preset)]
    if name == "dec.token_embd.weight":
        return roles["embed"]
    parts = name.split(".")
    if parts[-1] == "weight" and parts[-2] in ("q", "k", "v", "out", "fc1", "fc2"):
        return roles[parts[-2]]
    return "f32"


def matrix_count(config: dict) -> int:
    return 6 * config["encoder_layers"] + 10 * config["decoder_layers"] + 1


@pytest.mark.parametrize("model,preset", sorted(MATRIX_TABLE))
def test_the_plan_follows_transcribe_cpps_policy(model, preset):
    config = CONFIGS[model]
    plan = preset_plan(PRESETS[preset], config)
    assert plan == {name: expected_type(model, preset, name) for name in plan}
    assert plan["enc.conv.0.weight"] == plan["enc.conv.1.weight"] == "f32"
    assert sum(t != "f32" for t in plan.values()) == matrix_count(config)
    # the same types by transformers name, the tied output head with the embedding
    types = dict(preset_tensor_types(PRESETS[preset], config))
    assert types[r"^proj_out\.weight$"] == types[r"^model\.decoder\.embed_tokens\.weight$"] == plan[
        "dec.token_embd.weight"]
    assert types[r"^model\.decoder\.layers\.0\.encoder_attn\.out_proj\.weight$"] == "q8_0"
    assert types[r"^model\.encoder\.layers\.0\.fc2\.weight$"] == plan["enc.blocks.0.ffn.fc2.weight"]
    assert len(types) == matrix_count(config) + 1


def test_file_types_are_named_for_one_type_files_and_for_the_preset_mixes():
    """The bench and the model descriptions name a file by general.file_type: a preset's file type is llama.cpp's
    mix (15 Q4_K_M, 17 Q5_K_M), not "file_type 15"."""
    assert [file_type_name(t) for t in (1, 2, 15, 17, 99)] == ["F16", "Q4_0", "Q4_K_M", "Q5_K_M", "file_type 99"]


def test_preset_names_in_any_case():
    assert find_preset("Q4_K_M") == find_preset("q4_k_m") == "q4_k_m" and find_preset("Q5_k_M") == "q5_k_m"
    assert find_preset("q4_k") is None and find_preset("out_proj=q8_0") is None
    assert (PRESETS["q4_k_m"].file_type, PRESETS["q5_k_m"].file_type) == (15, 17)


@pytest.mark.parametrize("extra,needle", [
    (["--target", "whisper.cpp"], "--target transcribe.cpp"),
    (["--target", "transcribe.cpp", "--type", "q5_k"], "q4_k"),
    (["--target", "transcribe.cpp", "--tensor-type", "out_proj=q8_0"], "alone"),
])
def test_a_preset_where_it_does_not_apply_is_refused_in_one_line(tmp_path, capsys, extra, needle):
    out = tmp_path / "refused"
    status = main(["quantize", "--model", "packaged:tiny.en", "--method", "rtn", "--tensor-type", "q4_k_m", *extra,
                   "-o", str(out)])
    error = capsys.readouterr().err.strip()
    assert status == 2 and len(error.splitlines()) == 1 and needle in error, error
    assert not out.exists()


# ----------------------------------------------------------------------------------- real tiny.en, ggml's rounding
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("transcribe_presets")


@pytest.fixture(scope="module")
def f16_file(work) -> Path:
    """tiny.en as transcribe.cpp's converter would give it to its quantizer: F16 matrices, F32 the rest."""
    out = work / "tiny.en-f16.gguf"
    assert main(["export", "--model", "packaged:tiny.en", "--target", "transcribe.cpp", "-o", str(out),
                 "--quiet"]) == 0
    return out


@pytest.fixture(scope="module", params=["Q4_K_M", "q5_k_m"])  # both spellings
def preset_file(request, work) -> tuple[str, Path, Path]:
    """(preset, checkpoint, GGUF) of tiny.en by --method ggml under the preset."""
    preset = request.param.lower()
    ckpt, out = work / f"tiny.en-{preset}", work / f"tiny.en-{preset}.gguf"
    assert main(["quantize", "--model", "packaged:tiny.en", "--target", "transcribe.cpp", "--method", "ggml",
                 "--tensor-type", request.param, "-o", str(ckpt)]) == 0
    assert main(["export", str(ckpt), "--target", "transcribe.cpp", "-o", str(out), "--quiet"]) == 0
    return preset, ckpt, out


@pytest.fixture(scope="module")
def f16_values(f16_file, work) -> tuple[Path, list[str]]:
    """(an .npz of every tensor of the F16 file as float32, as transcribe-quantize dequantizes it; the names)."""
    model = read_gguf(f16_file)
    out = work / "tiny.en-f16-values.npz"
    np.savez(out, **{name: model.dequantize(name).astype(np.float32) for name in model.tensors})
    return out, list(model.tensors)


def test_the_preset_file_verifies_exact_and_carries_the_presets_types(preset_file, capsys):
    preset, ckpt, path = preset_file
    capsys.readouterr()
    assert main(["verify", str(path), "--checkpoint", str(ckpt)]) == 0
    assert "OK: all" in capsys.readouterr().out
    model = read_gguf(path)
    assert model.kv["general.file_type"] == FILE_TYPES[preset]
    found = {name: GGML_TYPE_NAMES[record.ggml_type].lower() for name, record in model.tensors.items()}
    assert found == {name: expected_type("tiny.en", preset, name) for name in found}
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["method"]["preset"] == preset


# One child: the wheel's libggml-base.so, loaded alone, quantizes every tensor of the F16 file (given as the float32
# values transcribe-quantize dequantizes it to) into the type the table gives it with ggml_quantize_chunk and no
# imatrix, as transcribe-quantize does (a float type is a plain conversion); the bytes come back in an .npz.
REQUANTIZE = """
import ctypes, json, sys
from pathlib import Path
import gguf, numpy as np
import transcribe_cpp_native
source, plan, out = np.load(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
lib = ctypes.CDLL(str(Path(transcribe_cpp_native.__file__).parent / "_native" / "libggml-base.so"))
chunk = lib.ggml_quantize_chunk
chunk.restype = ctypes.c_size_t
chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]
written = {}
for name in source.files:
    values, target = np.ascontiguousarray(source[name], dtype=np.float32), plan[name]
    if target in ("f32", "f16"):
        written[name] = np.frombuffer(values.astype(np.float32 if target == "f32" else np.float16).tobytes(), np.uint8)
        continue
    target = gguf.GGMLQuantizationType[target.upper()]
    n_per_row = values.shape[-1]
    rows = values.size // n_per_row
    block, size = gguf.GGML_QUANT_SIZES[target]
    dst = np.zeros(rows * n_per_row // block * size, np.uint8)
    assert chunk(int(target), values.ctypes.data, dst.ctypes.data, 0, rows, n_per_row, None) == dst.size
    written[name] = dst
np.savez(out, **written)
"""


@needs_wheel
def test_ggml_method_writes_the_bytes_of_transcribe_cpps_own_quantizer(preset_file, f16_values, work):
    preset, _, path = preset_file
    values, names = f16_values
    plan = {name: expected_type("tiny.en", preset, name) for name in names}
    out = work / f"requantized-{preset}.npz"
    done = subprocess.run([sys.executable, "-c", REQUANTIZE, str(values), json.dumps(plan), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = dict(np.load(out))
    model = read_gguf(path)
    assert set(model.tensors) == set(theirs)
    differing = [name for name in model.tensors if model.raw(name).tobytes() != theirs[name].tobytes()]
    assert not differing, f"{len(differing)} of {len(theirs)} tensors differ from transcribe.cpp's: {differing[:5]}"


WORKER = """
import json, sys, wave
import numpy as np
import transcribe_cpp
path, wav = sys.argv[1], sys.argv[2]
with wave.open(wav) as w:
    pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
with transcribe_cpp.Model(path) as model, model.session(n_threads=1) as session:
    print(json.dumps(session.run(pcm, language="en").text))
"""


@needs_wheel
def test_the_wheel_transcribes_jfk_from_the_preset_file(preset_file, jfk_wav):
    _, _, path = preset_file
    done = subprocess.run([sys.executable, "-c", WORKER, str(path), jfk_wav], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"transcribe-cpp on {path.name}: exit {done.returncode}\n{done.stderr[-2000:]}"
    text = json.loads(done.stdout.strip().splitlines()[-1])
    wer = jiwer.wer(" ".join(normalized_words(JFK_TEXT)), " ".join(normalized_words(text)) or "<empty>")
    assert wer <= 2 / 22, text  # tiny.en's F16 file reads jfk with at most 1 error (test_transcribe_cpp.py)
