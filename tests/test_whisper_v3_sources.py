"""large-v3-turbo's shape on the user's path (issue 37): a Whisper with turbo's real widths, 128 mel bins, large-v3's
51,866-token multilingual vocabulary and a 4-layer decoder (one encoder layer, random weights), saved as a transformers
folder in float32 (the hub's dtype), float16 and bfloat16, goes quantize -> export -> verify exact (max |diff| 0 on
every array) -> transcription in whisper.cpp and CrispASR.

Before the fix a float32 or bfloat16 source failed ``verify``: the files store the convolution kernels in F16 and the
checkpoint held them in the source's precision (2 arrays one fp16 ulp off). The kernels are now rounded to fp16 when
the model is loaded for quantizing, so calibration, checkpoint and file hold the same values.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tarq_deploy.formats.ggml_file import read_whisper_cpp
from tarq_deploy.formats.model_loader import load_whisper
from tarq_deploy.models.whisper_shapes import V3_VOCAB_SIZE, YUE_ID, random_whisper
from helpers import RUNTIME_TIMEOUT_S, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SOURCE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

WHISPER_CPP_LOG = """
import json, sys
from pywhispercpp.model import Model
model = Model(sys.argv[1], redirect_whispercpp_logs_to=False, n_threads=2, language="en", temperature=0.0,
              temperature_inc=0.0, no_timestamps=True, print_progress=False, print_realtime=False,
              max_tokens=24)
print(json.dumps(" ".join(s.text.strip() for s in model.transcribe(sys.argv[2]))))
"""


@pytest.fixture(scope="module")
def turbo_float32(tmp_path_factory) -> tuple:
    """A turbo-shaped Whisper (1280 wide, 128 mel bins, v3 vocabulary, 1 encoder and 4 decoder layers), float32."""
    _, processor, generation_config = load_whisper("packaged:base")
    model, processor, generation_config = random_whisper("large-v3-turbo", processor, generation_config,
                                                         encoder_layers=1)
    return model, processor, generation_config


def saved_source(bundle: tuple, dtype: torch.dtype, folder: Path) -> Path:
    model, processor, generation_config = bundle
    model.to(dtype).save_pretrained(folder)
    model.to(torch.float32)
    processor.save_pretrained(folder)
    generation_config.save_pretrained(folder)
    return folder


def whisper_cpp_run(model_file: Path, wav: str) -> tuple[str, str]:
    """(transcript, whisper.cpp's load log) from a fresh process."""
    read_whisper_cpp(model_file)  # whisper.cpp never sees a file our parser rejects
    run = subprocess.run([sys.executable, "-c", WHISPER_CPP_LOG, str(model_file), wav], capture_output=True,
                         text=True, timeout=RUNTIME_TIMEOUT_S, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert run.returncode == 0, f"pywhispercpp exited with {run.returncode}:\n{run.stderr[-2000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_the_v3_vocabulary_moves_every_special_token_after_yue(turbo_float32):
    _, processor, generation_config = turbo_float32
    tokenizer = processor.tokenizer
    assert len(tokenizer) == V3_VOCAB_SIZE
    assert tokenizer.convert_ids_to_tokens([YUE_ID - 1, YUE_ID, YUE_ID + 1, 50364, 50365, 51865]) == [
        "<|su|>", "<|yue|>", "<|translate|>", "<|notimestamps|>", "<|0.00|>", "<|30.00|>"]  # large-v3's own ids
    assert generation_config.task_to_id == {"translate": 50359, "transcribe": 50360}
    assert generation_config.no_timestamps_token_id == 50364 and len(generation_config.lang_to_id) == 100
    assert processor.feature_extractor.feature_size == 128


@pytest.mark.parametrize("dtype_name", list(SOURCE_DTYPES))
def test_a_turbo_shaped_source_goes_quantize_export_verify_exact_and_runs(turbo_float32, dtype_name, tmp_path,
                                                                         capsys, jfk_wav):
    source = saved_source(turbo_float32, SOURCE_DTYPES[dtype_name], tmp_path / f"turbo-{dtype_name}")
    stored = load_file(source / "model.safetensors")["model.encoder.conv2.weight"]
    assert stored.dtype == SOURCE_DTYPES[dtype_name]
    ckpt, out = tmp_path / "ck", tmp_path / "turbo-q4_0.bin"
    status, _, err = run_cli(capsys, "quantize", "--model", source, "--method", "rtn", "--type", "q4_0", "--out", ckpt)
    assert status == 0, err
    # only sources whose kernels fp16 cannot hold are rounded, and the log says so
    assert ("convolution kernel values rounded to fp16" in err) == (dtype_name == "float32"), err
    assert run_cli(capsys, "export", ckpt, "--target", "whisper.cpp", "-o", out, "--quiet")[0] == 0
    status, stdout, _ = run_cli(capsys, "verify", out, "--against", ckpt)
    assert status == 0 and "max|diff| = 0" in stdout, stdout
    text, log = whisper_cpp_run(out, jfk_wav)  # random weights: the words mean nothing, the run must complete
    for field, value in (("n_vocab", V3_VOCAB_SIZE), ("n_mels", 128), ("n_text_layer", 4), ("n_langs", 100),
                         ("n_audio_state", 1280), ("ftype", 2)):
        assert f"{field}" in log and any(line.split("=")[-1].strip() == str(value)
                                         for line in log.splitlines() if f" {field} " in line), (field, log[-3000:])
    assert text.strip(), "whisper.cpp returned no text"
    if dtype_name == "float32":
        runs_in_crispasr(ckpt, out, tmp_path, capsys, jfk_wav)


def runs_in_crispasr(ckpt: Path, whisper_cpp_file: Path, tmp_path: Path, capsys, wav: str) -> None:
    """The CrispASR export of the same checkpoint: whisper.cpp's file byte for byte, and the wheel transcribes it."""
    from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
    from tarq_deploy.runtimes.child import read_wav_float32
    from tarq_deploy.runtimes.registry import open_transcriber

    out = tmp_path / "turbo-crispasr.bin"
    assert run_cli(capsys, "export", ckpt, "--target", "crispasr", "-o", out, "--quiet")[0] == 0
    assert out.read_bytes() == whisper_cpp_file.read_bytes()
    transcriber = open_transcriber(ModelSpec("turbo", str(out), "crispasr"),
                                   DecodeOptions(threads=2, timeout_s=RUNTIME_TIMEOUT_S))
    try:
        assert transcriber.describe()["loaded_as"] == "whisper.cpp model file (CrispASR whisper backend)"
        transcriber.transcribe(read_wav_float32(wav), "jfk")  # completes without a native abort
    finally:
        transcriber.close()
