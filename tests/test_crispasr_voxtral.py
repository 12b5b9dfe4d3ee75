"""Voxtral -> CrispASR GGUF (formats/crispasr_voxtral.py) on a tiny random Voxtral with the real architecture
(tarq_deploy/models/voxtral_shapes.py; weights rounded to fp16-representable values, so the F16 tensors are exact too): the export
command on a per-tensor mix (Q4_K language model, Q8_0 audio tower) and a uniform Q4_0 lattice, ``verify`` max |diff|
0, the crispasr wheel's voxtral backend loading the file and decoding, its logits on a forced prompt agreeing with
the PyTorch model holding the same lattice, and the writer refusing a wrong shape and a missing tensor.

The tiny model is the smallest the backend takes in the dimensions it hard-codes: 128 mel bins, 1500 encoder
positions (3000 mel frames per 30 s chunk), 4 encoder frames per projector input; everything else is small."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tarq_deploy.cli import main as cli
from tarq_deploy.formats.crispasr_voxtral import (HF_PROJECTOR, VoxtralSource, build_crispasr_voxtral,
                                                  checkpoint_source)
from tarq_deploy.formats.gguf_file import GGUFExportError, read_gguf
from tarq_deploy.models.voxtral import VoxtralBackbone, load_dequantized_voxtral

sys.path.insert(0, str(Path(__file__).parent))
from crispasr_voxtral_ggml import VoxtralGGML  # noqa: E402
from tarq_deploy.models.voxtral_shapes import AUDIO_TOKEN_ID, load_tiny_voxtral, write_tiny_voxtral  # noqa: E402

pytest.importorskip("crispasr")
Q4_K, Q8_0, Q4_0, F16 = 12, 8, 2, 1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = write_tiny_voxtral(tmp_path_factory.mktemp("voxtral") / "tiny")
    model, _ = load_tiny_voxtral(out)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())  # F16 tensors of the file hold these exactly
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    recipes = {"mix": ["--type", "q4_k", "--quantize-audio-tower", "--tensor-type", "audio_tower=q8_0"],
               "q4_0": ["--type", "q4_0"]}
    for name, recipe in recipes.items():
        assert cli(["quantize", "--model", str(tiny_dir), "--method", "rtn", "--target", "crispasr", *recipe,
                    "--out", str(root / name)]) == 0
    return {name: root / name for name in recipes}


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for name, ckpt in checkpoints.items():
        files[name] = root / f"{name}.gguf"
        assert cli(["export", str(ckpt), "--target", "crispasr", "-o", str(files[name])]) == 0
    return files


def test_export_keeps_each_tensors_lattice_type(exports):
    mix = {n: r.ggml_type for n, r in read_gguf(exports["mix"]).tensors.items()}
    assert mix["blk.0.attn_q.weight"] == mix["blk.1.ffn_down.weight"] == Q4_K
    assert mix["audio.blk.0.attn_q.weight"] == mix["audio.blk.1.ffn_up.weight"] == Q8_0
    assert mix["proj1.weight"] == mix["token_embd.weight"] == mix["output.weight"] == mix["audio.conv.1.weight"] == F16
    uniform = {n: r.ggml_type for n, r in read_gguf(exports["q4_0"]).tensors.items()}
    assert uniform["blk.0.ffn_gate.weight"] == Q4_0 and uniform["audio.blk.0.attn_q.weight"] == F16
    model = read_gguf(exports["mix"])
    assert model.arch == "voxtral" and model.integer("voxtral.proj.in_dim") == 4 * 128
    assert model.integer("tokenizer.tekken.n_specials") == 1000 and model.integer("voxtral.audio_token_id") == 24
    for table in ("audio.mel_filters", "audio.mel_window", "tokenizer.tekken.vocab_tensor"):
        assert table in model.tensors


@pytest.mark.parametrize("name", ["mix", "q4_0"])
def test_verify_is_exact(name, exports, checkpoints, capsys):
    assert cli(["verify", str(exports[name]), "--against", str(checkpoints[name]), "--json"]) == 0
    diffs, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)
    assert diffs and max(diffs.values()) == 0.0


def test_crispasr_wheel_loads_and_decodes(exports):
    import crispasr

    assert crispasr.detect_backend_from_gguf(str(exports["mix"])) == "voxtral"
    session = crispasr.Session(str(exports["mix"]), n_threads=1)
    audio = (np.random.default_rng(0).standard_normal(16000 * 2) * 0.1).astype(np.float32)
    segments = session.transcribe(audio, language="en")
    assert sum(len(s.tokens) for s in segments) > 0  # a random model: some tokens, any text


@pytest.mark.parametrize("name", ["mix", "q4_0"])
def test_runtime_logits_agree_with_pytorch_on_a_forced_prompt(name, exports, checkpoints):
    """The same log-mel features through the runtime's encoder + projector and through PyTorch; then the forced
    transcription prompt (audio embeddings at the [AUDIO] positions) and two forced text tokens, last-position
    logits compared step by step. ggml quantizes activations for quantized matmuls (Q8_K / Q8_0), so agreement is
    close, not bitwise."""
    model, processor = load_dequantized_voxtral(checkpoints[name])
    backbone = VoxtralBackbone(model, processor)
    audio = (np.random.default_rng(1).standard_normal(16000 * 3) * 0.1).astype(np.float32)
    features = backbone.audio_features(audio)
    ids = backbone.prompt_ids(backbone.audio_token_count(1))
    hidden = model.config.text_config.hidden_size
    runtime = VoxtralGGML(exports[name])
    try:
        encoded = runtime.encode(features[0].numpy())
        reference = backbone.audio_embeddings(features).numpy()
        assert encoded.shape == reference.shape == (375, hidden)
        assert np.abs(encoded - reference).max() <= 0.02 * np.abs(reference).max()
        embeds = runtime.embed(ids, hidden)
        embeds[[i for i, t in enumerate(ids) if t == AUDIO_TOKEN_ID]] = encoded
        runtime.kv_init(len(ids) + 8)
        forced = [1100, 1200]
        steps = [runtime.step(embeds, 0)]
        for k, token in enumerate(forced):
            steps.append(runtime.step(runtime.embed([token], hidden), len(ids) + k))
    finally:
        runtime.close()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + forced]), input_features=features).logits[0]
    for k, got in enumerate(steps):
        want = logits[len(ids) - 1 + k].numpy()
        assert np.abs(got - want).max() <= 0.03 * np.abs(want).max(), k
        top = np.argsort(want)[::-1]
        if want[top[0]] - want[top[1]] > 0.05 * np.abs(want).max():  # a clear winner must win in the runtime too
            assert got.argmax() == top[0]


# ------------------------------------------------------------------------------------------------------ refusals
def test_writer_refuses_a_wrong_shape_and_a_missing_tensor(checkpoints, tmp_path):
    source = checkpoint_source(__import__("tarq_deploy.checkpoint", fromlist=["x"]).load_checkpoint(
        checkpoints["q4_0"]))
    name = f"{HF_PROJECTOR}.linear_2.weight"
    wrong = VoxtralSource(source.config, source.tokenizer, source.feature_extractor,
                          {**source.floats, name: source.floats[name][:, :-1]}, source.lattice, origin="bad")
    with pytest.raises(GGUFExportError, match=r"linear_2\.weight has shape \[256, 255\].*proj2\.weight"):
        build_crispasr_voxtral(wrong)
    floats = {k: v for k, v in source.floats.items() if k != "model.audio_tower.embed_positions.weight"}
    missing = VoxtralSource(source.config, source.tokenizer, source.feature_extractor, floats, source.lattice,
                            origin="bad")
    with pytest.raises(GGUFExportError, match=r"embed_positions\.weight missing.*audio\.embed_positions"):
        build_crispasr_voxtral(missing)
    out = tmp_path / "refused.gguf"
    assert cli(["export", str(checkpoints["q4_0"]), "--target", "crispasr", "--type", "q8_0", "-o", str(out)]) != 0
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no temporary left


def test_runtime_adapter_claims_the_file(exports):
    from tarq_deploy.runtimes.crispasr import describe_crispasr_file, is_crispasr_file

    assert is_crispasr_file(str(exports["mix"]))
    info = describe_crispasr_file(exports["mix"])
    assert info.details["arch"] == "voxtral" and info.details["text_layers"] == 2


def test_float_model_exports_f16_and_loads(tiny_dir, tmp_path):
    import crispasr

    out = tmp_path / "f16.gguf"
    assert cli(["export", "--model", str(tiny_dir), "--target", "crispasr", "-o", str(out)]) == 0
    kinds = {n: r.ggml_type for n, r in read_gguf(out).tensors.items()}
    assert kinds["blk.0.attn_q.weight"] == kinds["audio.blk.0.attn_q.weight"] == F16
    session = crispasr.Session(str(out), n_threads=1)
    assert session.backend == "voxtral"
