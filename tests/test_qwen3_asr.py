"""Qwen3-ASR end to end on a tiny random model with the real architecture and the real Qwen tokenizer
(tarq_deploy/models/qwen3_asr_shapes.py) and real speech: tokenizer, prompt and rare tags, stages that reproduce the model's own
forward, TARQ calibration into a lattice checkpoint, both GGUF flavours through the CLI (export, verify max |diff| = 0),
the CrispASR wheel transcribing the export with the same tokens as transformers, real-dimension 0.6B / 1.7B
configurations (2 layers) exported and verified, the eval and bench plug-ins, and the patched qwen3-asr.cpp binary
when ``QWEN3_ASR_CPP_BIN`` points to one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tarq_deploy.formats.gguf_file import read_gguf
from tarq_deploy.checkpoint import load_checkpoint, save_checkpoint
from tarq_deploy.cli import main as cli
from tarq_deploy.data.corpus import Utterance, load_audio
from tarq_deploy.data.rarity import reference_words
from tarq_deploy.data.real_clips import RealClipError
from tarq_deploy.models.qwen3_asr import (Qwen3ASRBackbone, audio_token_count, load_dequantized_qwen3_asr,
                                          load_qwen3_asr_backbone)
from tarq_deploy.models.common import TextAudio
from tarq_deploy.quant.ggml_types import type_by_name
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.calibration.options import QuantizeOptions
from tarq_deploy.calibration.pipeline import quantize_backbone

sys.path.insert(0, str(Path(__file__).parent))
from tarq_deploy.models import qwen3_asr_shapes as tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = LatticeSpec(4, 32)  # ggml targets: one fp16 scale per 32-value Q4_0 block
CLIP_SUFFIXES = ("0870", "0880", "0930")  # rare words: dashwood, prudently | none | amiable
COMPARE_SECONDS = 4  # one 8-second attention window, whole 1 s chunks: no padding inside the conv front end
COMPARED_TOKENS = 8
MIN_COMPARED_TOKENS = 5
BINARY_ENV = "QWEN3_ASR_CPP_BIN"
UPSTREAM_PROMPT_HEAD = [151644, 8948, 198, 151645, 198, 151644, 872, 198, 151669]  # qwen3-asr.cpp's hard-coded ids
UPSTREAM_PROMPT_TAIL = [151670, 151645, 198, 151644, 77091, 198]
ENCODER = [f"model.audio_tower.layers.{i}.{rel}.weight" for i in range(2)
           for rel in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")]
DECODER = [f"model.language_model.layers.{i}.{rel}.weight" for i in range(2)
           for rel in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
LATTICE_NAMES = sorted(["model.audio_tower.conv_out.weight", *ENCODER, *DECODER, "lm_head.weight"])


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    try:
        return tiny.qwen_tokenizer_dir()
    except (RealClipError, OSError) as error:
        pytest.fail(f"the Qwen tokenizer source (llama-cpp-python 0.3.36 sdist) is unavailable: {error}",
                    pytrace=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return tiny.write_tiny_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr") / "tiny")


@pytest.fixture(scope="module")
def k_quant_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return tiny.write_tiny_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr_k") / "k", tiny.k_quant_config())


@pytest.fixture(scope="module")
def utterances(librivox_clips) -> list[TextAudio]:
    chosen = [(path, text) for path, text in librivox_clips if Path(path).stem.endswith(CLIP_SUFFIXES)]
    assert len(chosen) == len(CLIP_SUFFIXES)
    return [TextAudio(Path(path).stem, load_audio(path), text) for path, text in chosen]


@pytest.fixture(scope="module")
def clip(jfk_wav) -> np.ndarray:
    return load_audio(jfk_wav)[: COMPARE_SECONDS * 16000]


def fresh_backbone(tiny_dir: Path, **options) -> Qwen3ASRBackbone:
    return Qwen3ASRBackbone(*tiny.load_tiny_qwen3_asr(tiny_dir), **options)


@pytest.fixture(scope="module")
def tarq_checkpoint(tiny_dir, librivox_clips, tmp_path_factory) -> tuple[Path, Qwen3ASRBackbone, list]:
    """`quantize` on the tiny model: TARQ over every default Linear (group 32), three real clips packed into one
    window, saved as a lattice checkpoint."""
    backbone = load_qwen3_asr_backbone(tiny_dir)
    corpus = [Utterance(Path(path).stem, path, text) for path, text in librivox_clips
              if Path(path).stem.endswith(CLIP_SUFFIXES)]
    options = QuantizeOptions(method="tarq", group_size=SPEC.group_size, n_calib=len(corpus))
    checkpoint, _ = quantize_backbone(backbone, corpus, options, str(tiny_dir), log=lambda _: None)
    out = tmp_path_factory.mktemp("qwen3_ckpt") / "tarq"
    save_checkpoint(checkpoint, out)
    windows = backbone.build_windows([TextAudio(u.id, load_audio(u.audio), u.text) for u in corpus])
    return out, backbone, windows


@pytest.fixture(scope="module")
def exports(tarq_checkpoint, tiny_dir, tmp_path_factory) -> dict[str, Path]:
    """Both GGUF flavours of the TARQ checkpoint (Q4_0) and of the float model (F16), through the CLI."""
    out = tmp_path_factory.mktemp("qwen3_gguf")
    files = {}
    for target in ("qwen3-asr.cpp", "crispasr"):
        files[f"{target}-q4_0"] = out / f"tiny-{target}-q4_0.gguf"
        assert cli(["export", str(tarq_checkpoint[0]), "--target", target, "-o", str(files[f"{target}-q4_0"])]) == 0
        files[f"{target}-f16"] = out / f"tiny-{target}-f16.gguf"
        assert cli(["export", "--model", str(tiny_dir), "--target", target, "-o", str(files[f"{target}-f16"])]) == 0
    return files


@pytest.fixture(scope="module")
def real_dimension_exports(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """0.6B and 1.7B shapes with 2 layers each: synthetic lattice checkpoints (in memory) and their qwen3-asr.cpp
    Q4_0 exports (the CLI path is the tiny model's; here only shapes and sizes are new)."""
    from tarq_deploy.formats.qwen3_asr_cpp import export_qwen3_asr_cpp

    out = tmp_path_factory.mktemp("qwen3_real")
    files = {}
    for size in tiny.REAL_DIMENSIONS:
        checkpoint = tiny.synthetic_checkpoint(tiny.real_dimension_config(size))
        files[size] = (export_qwen3_asr_cpp(checkpoint, out / f"qwen3-asr-{size}-2layers-q4_0.gguf"), checkpoint)
    files["1.7B-upstream-keys"] = (_upstream_keys_only(files["1.7B"][1], out / "qwen3-asr-1.7B-upstream-keys.gguf"),
                                   files["1.7B"][1])
    return files


def _upstream_keys_only(checkpoint, path: Path) -> Path:
    """The export with only the metadata upstream's converter writes (no ``audio.*`` / ``text.*`` loader keys): an
    unpatched qwen3-asr.cpp reads 0.6B defaults from such a file (18 encoder layers, d 896) and crashes on it."""
    from tarq_deploy.formats.gguf_file import write_gguf
    from tarq_deploy.formats.qwen3_asr_cpp import build_qwen3_asr_cpp

    model = build_qwen3_asr_cpp(checkpoint)
    model.kv = [kv for kv in model.kv if not kv.key.startswith(("audio.", "text."))]
    return write_gguf(model, path)


# ---------------------------------------------------------------------------------------- tokenizer and prompt
def test_tokenizer_reproduces_llama_cpp_reference_ids(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cases = tiny.vocab_test_cases()
    assert len(cases) > 40
    assert [tokenizer.encode(text, add_special_tokens=False) for text, _ in cases] == [ids for _, ids in cases]
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>",
                                            "<|audio_pad|>"]) == [151644, 151645, 151669, 151670, 151676]


def test_prompt_matches_the_runtimes_and_the_audio_token_count(tiny_dir, clip):
    backbone = fresh_backbone(tiny_dir)
    prefill = backbone.encode("language English<asr_text>")
    assert backbone.prompt_ids(3) == UPSTREAM_PROMPT_HEAD + [151676] * 3 + UPSTREAM_PROMPT_TAIL + prefill
    assert Qwen3ASRBackbone(backbone.model, backbone.processor, language=None).prompt_ids(1) == (
        UPSTREAM_PROMPT_HEAD + [151676] + UPSTREAM_PROMPT_TAIL)
    for seconds in (0.7, 1.0, 2.35, COMPARE_SECONDS):
        features, mask = backbone.audio_features(clip[: int(seconds * 16000)])
        embeds = backbone.audio_embeddings(features, mask)
        assert embeds.shape[0] == audio_token_count(int(mask.sum()))


def test_windows_tag_only_rare_transcript_tokens(tiny_dir, utterances):
    backbone = fresh_backbone(tiny_dir)
    windows = backbone.build_windows(utterances, pack=False)
    tokenizer = backbone.tokenizer
    for window, utterance in zip(windows, utterances):
        ids, mask = window.inputs["input_ids"][0], window.masks["tokens"]
        prompt = backbone.prompt_ids(window.info["audio_tokens"])
        assert ids.tolist() == prompt + tokenizer.encode(utterance.text, add_special_tokens=False)
        assert mask.shape == ids.shape and not mask[: len(prompt) - 1].any()
        assert window.masks["frames"].shape == (window.info["audio_tokens"],) and not window.masks["frames"].any()
        predicted = [tokenizer.decode([int(ids[t + 1])]) for t in torch.nonzero(mask[:-1]).flatten()]
        assert "".join(predicted).split() == [w.normalized for w in reference_words(utterance.text) if w.rare]
    assert windows[0].info["rare_words"] == 2 and windows[1].info["rare_tokens"] == 0


def test_stages_reproduce_the_models_own_forward(tiny_dir, utterances):
    backbone = fresh_backbone(tiny_dir, quantize_projector=True)
    model = backbone.model
    window = backbone.build_windows(utterances[:1], pack=False)[0]
    stages = backbone.stages()
    assert [s.name for s in stages] == ["audio_frontend", "audio_encoder", "projector", "language_model", "head"]
    stream: dict = {}
    with torch.no_grad():
        for stage in stages[:-1]:
            h = stage.enter(window, stream)
            for block in stage.blocks:
                h = stage.call_block(block.module, h, window, stream)
            stage.leave(h, window, stream)
        inputs = window.inputs
        assert torch.equal(stream["audio_embeds"], backbone.audio_embeddings(inputs["input_features"],
                                                                             inputs["input_features_mask"]))
        logits = model(input_ids=inputs["input_ids"], input_features=inputs["input_features"],
                       input_features_mask=inputs["input_features_mask"]).logits
        assert torch.allclose(model.lm_head(stream["decoder_out"]), logits, rtol=0, atol=1e-5)


# -------------------------------------------------------------------------------------------------- calibration
def test_tarq_calibrates_the_audio_tower_decoder_and_tied_head(tarq_checkpoint):
    path, backbone, windows = tarq_checkpoint
    ckpt = load_checkpoint(path)
    assert sorted(ckpt.quantized) == LATTICE_NAMES
    assert ckpt.aliases == {"model.language_model.embed_tokens.weight": "lm_head.weight"}
    assert "model.multi_modal_projector.linear_1.weight" in ckpt.tensors  # kept in 16 bits by default
    records = {r["name"]: r for r in ckpt.metadata["layers"]}
    assert {r["method"] for r in records.values()} == {"tarq"}
    assert ckpt.metadata["source_model"]["architecture"] == "qwen3_asr"
    assert ckpt.metadata["calibration"]["rare_words"] == 3 and ckpt.metadata["calibration"]["windows"] == 1
    assert records["lm_head"]["n_tail"] > 0 and records["model.audio_tower.layers.0.fc1"]["n_tail"] == 0
    model, _ = load_dequantized_qwen3_asr(path)
    inputs = windows[0].inputs
    with torch.no_grad():
        ours = model(**inputs).logits
        calibrated = backbone.model(**inputs).logits  # the backbone's weights now hold the lattice values
    assert torch.equal(ours, calibrated)


# ------------------------------------------------------------------------------------------------------ exports
@pytest.mark.parametrize("target", ["qwen3-asr.cpp", "crispasr"])
def test_q4_0_exports_hold_the_lattice_exactly(target, exports, tarq_checkpoint, capsys):
    path = exports[f"{target}-q4_0"]
    assert cli(["verify", str(path), "--against", str(tarq_checkpoint[0]), "--json"]) == 0
    diffs, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)  # the JSON, then the OK line
    assert diffs and max(diffs.values()) == 0.0
    gguf = read_gguf(path)
    kinds = {name: rec.ggml_type for name, rec in gguf.tensors.items()}
    assert kinds["token_embd.weight"] == kinds["output.weight"] == 2  # Q4_0, the same lattice written twice
    assert np.array_equal(gguf.raw("token_embd.weight"), gguf.raw("output.weight"))
    assert {t for n, t in kinds.items() if ".conv" in n and n.endswith("weight") and "conv_out" not in n} == {1}
    assert {t for n, t in kinds.items() if n.endswith(".bias") or "norm" in n or "ln_post" in n} == {0}
    assert {t for n, t in kinds.items() if "proj" in n and n.endswith("weight")} == {1}  # projector kept F16


def test_qwen3_asr_cpp_file_carries_both_loaders_keys(exports):
    kv = read_gguf(exports["qwen3-asr.cpp-q4_0"]).kv
    assert kv["general.architecture"] == "qwen3-asr"
    assert kv["qwen3-asr.audio.encoder.embedding_length"] == kv["audio.d_model"] == 64
    assert kv["qwen3-asr.embedding_length"] == kv["text.hidden_size"] == 64
    assert kv["qwen3-asr.audio.encoder.layer_count"] == kv["audio.encoder_layers"] == 2
    assert len(kv["tokenizer.ggml.tokens"]) == 151936 and len(kv["tokenizer.ggml.merges"]) == 151387


def test_verify_reports_a_changed_tensor_and_a_foreign_checkpoint(exports, tarq_checkpoint, tmp_path, capsys):
    path = exports["crispasr-q4_0"]
    damaged = tmp_path / "damaged.gguf"
    data = bytearray(path.read_bytes())
    record = read_gguf(path).tensors["blk.0.attn_q.weight"]
    data[record.offset + 5] ^= 0x11  # a nibble pair of the first Q4_0 block
    damaged.write_bytes(bytes(data))
    assert cli(["verify", str(damaged), "--against", str(tarq_checkpoint[0])]) == 1
    assert "blk.0.attn_q.weight" in capsys.readouterr().out
    other = tmp_path / "other"
    save_checkpoint(tiny.synthetic_checkpoint(tiny.tiny_config(), seed=1), other)
    assert cli(["verify", str(exports["qwen3-asr.cpp-q4_0"]), "--against", str(other)]) == 1


def test_export_refuses_what_it_cannot_hold_exactly(tiny_dir, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert cli(["export", "--model", str(tiny_dir), "--target", "crispasr", "--type", "q4_0", "-o", str(out)]) == 2
    assert "no lattice weights" in capsys.readouterr().err and not out.exists()


# ---------------------------------------------------------------------------------------------------- CrispASR
def _visible(tokens: list[str]) -> list[str]:
    """One entry per run of identical tokens (CrispASR shortens long runs of one token in its output)."""
    return [t for i, t in enumerate(tokens) if i == 0 or t != tokens[i - 1]]


def _crispasr_tokens(path: Path, audio: np.ndarray, max_new_tokens: int) -> list[str]:
    from tarq_deploy.runtimes.crispasr import open_session

    session = open_session(str(path), threads=2, max_new_tokens=max_new_tokens)
    segments = session.transcribe(audio, language="en")
    return [token.text for segment in segments for token in segment.tokens]


def _transformers_tokens(backbone: Qwen3ASRBackbone, audio: np.ndarray, max_new_tokens: int) -> list[str]:
    """Greedy tokens as CrispASR reports them: special and unnamed ids are not shown."""
    ids = backbone.generate_ids(audio, max_new_tokens)
    return [backbone.tokenizer.decode([i]) for i in ids if i < backbone.special_id("<|endoftext|>")]


def test_crispasr_transcribes_the_f16_export_with_the_transformers_tokens(exports, tiny_dir, clip):
    ours = _visible(_transformers_tokens(fresh_backbone(tiny_dir), clip, 2 * COMPARED_TOKENS))
    theirs = _visible(_crispasr_tokens(exports["crispasr-f16"], clip, 2 * COMPARED_TOKENS))
    n = min(COMPARED_TOKENS, len(ours), len(theirs))
    assert n >= MIN_COMPARED_TOKENS, (ours, theirs)
    assert theirs[:n] == ours[:n]


def test_crispasr_runs_the_tarq_q4_0_export(exports, clip):
    tokens = _crispasr_tokens(exports["crispasr-q4_0"], clip, 4)
    assert tokens and all(isinstance(t, str) for t in tokens)


@pytest.mark.parametrize("type_name", ["q4_1", "q5_0", "q5_1", "q8_0"])
def test_every_one_level_type_exports_exactly_and_runs_in_crispasr(type_name, tiny_dir, clip, tmp_path, capsys):
    """Issue 16: a lattice of each one-level ggml type in CrispASR's GGUF, copied bit for bit, run by the wheel."""
    from tarq_deploy.quant.choices import GGML_TYPES

    scheme, bits, group = GGML_TYPES[type_name]
    options = QuantizeOptions(method="rtn", bits=bits, group_size=group, scheme=scheme)
    checkpoint, _ = quantize_backbone(load_qwen3_asr_backbone(tiny_dir), [], options, str(tiny_dir), log=lambda _: None)
    ckpt, out = save_checkpoint(checkpoint, tmp_path / "ck"), tmp_path / f"tiny-{type_name}.gguf"
    assert cli(["export", str(ckpt), "--target", "crispasr", "-o", str(out)]) == 0  # the checkpoint's own type
    _assert_exact_typed_and_transcribing(out, ckpt, "token_embd.weight", type_name, clip, capsys)


def test_a_per_tensor_mix_exports_exactly_and_runs_in_crispasr(tiny_dir, clip, tmp_path, capsys):
    """--tensor-type keeps the audio tower at Q8_0 while the decoder takes Q4_1; CrispASR's GGUF holds the mix bit
    for bit and runs it; whisper.cpp's one-type .bin refuses such a recipe up front."""
    ckpt, out = tmp_path / "ck", tmp_path / "mix.gguf"
    assert cli(["quantize", "--model", str(tiny_dir), "--target", "crispasr", "--method", "rtn", "--type", "q4_1",
                "--tensor-type", "audio_tower=q8_0", "--out", str(ckpt)]) == 0
    manifest = json.loads((ckpt / "manifest.json").read_text())
    overridden = manifest["lattice_overrides"]
    assert overridden and all("audio_tower" in name and r["ggml_type"] == "q8_0" for name, r in overridden.items())
    assert manifest["lattice"]["ggml_type"] == "q4_1"
    assert cli(["export", str(ckpt), "--target", "crispasr", "-o", str(out)]) == 0
    capsys.readouterr()
    assert cli(["verify", str(out), "--against", str(ckpt), "--json"]) == 0
    diffs, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)
    assert diffs and max(diffs.values()) == 0.0
    types = {name: rec.ggml_type for name, rec in read_gguf(out).tensors.items() if name.endswith("attn_q.weight")}
    assert {t for n, t in types.items() if n.startswith("audio.")} == {int(type_by_name("q8_0"))}
    assert {t for n, t in types.items() if not n.startswith("audio.")} == {int(type_by_name("q4_1"))}
    tokens = _crispasr_tokens(out, clip, 4)
    assert tokens and all(isinstance(t, str) for t in tokens)
    status = cli(["quantize", "--model", str(tiny_dir), "--method", "rtn", "--tensor-type", "audio_tower=q8_0",
                  "--out", str(tmp_path / "bin-ck")])
    assert status == 2 and "holds one type for all weight matrices" in capsys.readouterr().err


def test_auto_recipe_spends_the_budget_where_measured_loss_is_highest(tiny_dir, tarq_checkpoint, exports, clip,
                                                                     tmp_path, capsys):
    from tarq_deploy.quant.recipe import auto_recipe, bits_per_weight, layer_score

    manifest = json.loads((tarq_checkpoint[0] / "manifest.json").read_text())
    scored = {f"{r['name']}.weight": layer_score(r) for r in manifest["layers"]}
    every = auto_recipe(manifest["layers"], manifest["quantized"], "q4_0", "q8_0", float("inf"))
    assert {c.name for c in every} == set(scored)  # an unbounded budget promotes everything
    budget_mib = sum(c.extra_bytes for c in every) / 4 / (1 << 20)  # a quarter of what promoting all would cost
    ckpt, out = tmp_path / "ck", tmp_path / "auto.gguf"
    assert cli(["quantize", "--model", str(tiny_dir), "--target", "crispasr", "--method", "rtn", "--tensor-type",
                "auto", "--recipe-from", str(tarq_checkpoint[0]), "--size-budget", str(budget_mib), "--out",
                str(ckpt)]) == 0
    promoted = set(json.loads((ckpt / "manifest.json").read_text())["lattice_overrides"])
    assert promoted and promoted < set(scored)
    extra = (bits_per_weight("q8_0") - bits_per_weight("q4_0")) / 8
    sizes = {n: manifest["quantized"][n][0] * manifest["quantized"][n][1] * extra for n in scored}
    assert sum(sizes[n] for n in promoted) <= budget_mib * (1 << 20)
    best_left_out = max(scored[n] / sizes[n] for n in set(scored) - promoted)
    assert min(scored[n] / sizes[n] for n in promoted) >= best_left_out or \
        all(sizes[n] > budget_mib * (1 << 20) - sum(sizes[p] for p in promoted) for n in set(scored) - promoted)
    assert cli(["export", str(ckpt), "--target", "crispasr", "-o", str(out)]) == 0
    grown = out.stat().st_size - exports["crispasr-q4_0"].stat().st_size
    assert 0 < grown <= budget_mib * (1 << 20)
    assert _crispasr_tokens(out, clip, 4)
    capsys.readouterr()
    assert cli(["quantize", "--model", str(tiny_dir), "--target", "crispasr", "--method", "rtn", "--type", "q5_0",
                "--tensor-type", "auto", "--recipe-from", str(tarq_checkpoint[0]), "--size-budget", "1", "--out",
                str(tmp_path / "x")]) == 2
    assert "measured on q4_0, not on a uniform q5_0" in capsys.readouterr().err


@pytest.mark.parametrize("type_name", ["q4_k", "q5_k", "q6_k", "q3_k", "q2_k"])
def test_k_quants_export_exactly_and_run_in_crispasr(type_name, k_quant_dir, clip, tmp_path, capsys):
    ckpt, out = tmp_path / "ck", tmp_path / f"k-{type_name}.gguf"
    assert cli(["quantize", "--model", str(k_quant_dir), "--target", "crispasr", "--method", "rtn", "--type", type_name,
                "--out", str(ckpt)]) == 0
    assert cli(["export", str(ckpt), "--target", "crispasr", "-o", str(out)]) == 0
    _assert_exact_typed_and_transcribing(out, ckpt, "blk.0.ffn_down.weight", type_name, clip, capsys)


def _assert_exact_typed_and_transcribing(gguf: Path, ckpt: Path, tensor: str, type_name: str, clip, capsys) -> None:
    """verify finds max|diff| = 0 on every array, ``tensor`` is stored as ``type_name``, and CrispASR decodes."""
    capsys.readouterr()
    assert cli(["verify", str(gguf), "--against", str(ckpt), "--json"]) == 0
    diffs, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)
    assert diffs and max(diffs.values()) == 0.0
    assert read_gguf(gguf).tensors[tensor].ggml_type == int(type_by_name(type_name))
    tokens = _crispasr_tokens(gguf, clip, 4)
    assert tokens and all(isinstance(t, str) for t in tokens)


def test_k_quants_refuse_the_64_wide_tiny_model(tiny_dir, tmp_path, capsys):
    status = cli(["quantize", "--model", str(tiny_dir), "--target", "crispasr", "--method", "rtn", "--type", "q4_k",
                  "--out", str(tmp_path / "ck")])
    assert status == 2 and "not a multiple of 256" in capsys.readouterr().err and not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------------------------- real dimensions
@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
def test_real_dimension_configuration_exports_and_verifies(size, real_dimension_exports):
    from tarq_deploy.formats.qwen3_asr_cpp import verify

    path, checkpoint = real_dimension_exports[size]
    diffs = verify(path, checkpoint)
    assert max(diffs.values()) == 0.0
    kv = read_gguf(path).kv
    audio_d, _, _, _ = tiny.REAL_DIMENSIONS[size]["audio"]
    assert kv["audio.d_model"] == kv["qwen3-asr.audio.encoder.embedding_length"] == audio_d
    assert kv["qwen3-asr.embedding_length"] == tiny.REAL_DIMENSIONS[size]["text"][0]


# --------------------------------------------------------------------------------------------- eval and bench
def test_eval_backends_claim_and_run_the_new_files(exports, tarq_checkpoint, tiny_dir, clip):
    from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
    from tarq_deploy.runtimes.registry import BY_NAME, infer_runtime, open_transcriber

    claimed = {name: [b for b in ("crispasr", "qwen3-asr.cpp") if BY_NAME[b].claims(str(exports[name]))]
               for name in ("crispasr-q4_0", "qwen3-asr.cpp-q4_0")}
    assert claimed == {"crispasr-q4_0": ["crispasr"], "qwen3-asr.cpp-q4_0": ["qwen3-asr.cpp"]}
    assert infer_runtime(str(tarq_checkpoint[0])) == "qwen3-asr-torch"
    assert infer_runtime(str(tiny_dir)) == "qwen3-asr-torch"
    options = DecodeOptions(threads=2, max_new_tokens=6)
    for source, backend in ((str(exports["crispasr-q4_0"]), "crispasr"), (str(tarq_checkpoint[0]), "qwen3-asr-torch")):
        transcriber = open_transcriber(ModelSpec("m", source, backend), options)
        try:
            assert isinstance(transcriber.transcribe(clip, "jfk"), str)
        finally:
            transcriber.close()


def test_bench_runtimes_describe_and_measure_the_new_files(exports, jfk_wav, tmp_path):
    from tarq_deploy.bench.cpu import BenchConfig, get_runtime, run_cpu_bench

    info = get_runtime("qwen3-asr.cpp").describe_model(exports["qwen3-asr.cpp-q4_0"])
    assert (info.backbone, info.precision) == ("qwen3-asr-a2x64-t2x64", "Q4_0")
    with pytest.raises(ValueError):
        get_runtime("crispasr").describe_model(exports["qwen3-asr.cpp-q4_0"])  # the other flavour
    config = BenchConfig(models=[str(exports["crispasr-q4_0"])], audios=[jfk_wav], threads=[1], runtime="crispasr",
                         warmup=0, runs=1, decode={"max_new_tokens": 4})
    result = run_cpu_bench(config, log=lambda _: None)
    cell = result.cells[0]
    assert cell.status == "ok", cell.error
    assert cell.precision == "Q4_0" and cell.summary["transcribe_s"].n == 1


# --------------------------------------------------------------------------------------- patched qwen3-asr.cpp
def _binary() -> str:
    binary = os.environ.get(BINARY_ENV)
    if not binary:
        pytest.skip(f"{BINARY_ENV} is not set: build predict-woo/qwen3-asr.cpp with third_party/qwen3-asr.cpp's "
                    f"loader patch and point {BINARY_ENV} to its qwen3-asr-cli")
    return binary


def _run_binary(model: Path, wav: str) -> subprocess.CompletedProcess:
    command = [_binary(), "-m", str(model), "-f", wav, "-t", "2", "--max-tokens", "4", "--tokens"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})


@pytest.mark.parametrize("name", ["qwen3-asr.cpp-q4_0", "qwen3-asr.cpp-f16"])
def test_patched_binary_runs_the_tiny_exports(name, exports, jfk_wav):
    done = _run_binary(exports[name], jfk_wav)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Tokens (4):" in done.stderr


@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
def test_patched_binary_loads_and_runs_real_dimension_configurations(size, real_dimension_exports, jfk_wav):
    done = _run_binary(real_dimension_exports[size][0], jfk_wav)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    assert "Tokens (4):" in done.stderr and "in the tensors; using the tensors" not in done.stderr


def test_patched_binary_reads_the_upstream_converters_keys(real_dimension_exports, jfk_wav):
    """A 1.7B file with only the keys upstream's converter writes: the unpatched loader takes 0.6B defaults from it
    and crashes (SIGSEGV); the patched one reads qwen3-asr.audio.encoder.* and decodes as from our full file."""
    ours = _run_binary(real_dimension_exports["1.7B"][0], jfk_wav)
    upstream_style = _run_binary(real_dimension_exports["1.7B-upstream-keys"][0], jfk_wav)
    assert upstream_style.returncode == 0, f"exit status {upstream_style.returncode}: {upstream_style.stderr[-2000:]}"
    assert _token_lines(upstream_style.stderr) == _token_lines(ours.stderr) != []


def _token_lines(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.split("Tokens (", 1)[-1].splitlines()[1:] if line.strip()]


def test_patched_binary_through_eval_and_bench(exports, jfk_wav, clip):
    _binary()
    from tarq_deploy.bench.cpu import BenchConfig, run_cpu_bench
    from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
    from tarq_deploy.runtimes.registry import open_transcriber

    transcriber = open_transcriber(ModelSpec("m", str(exports["qwen3-asr.cpp-q4_0"]), "qwen3-asr.cpp"),
                                   DecodeOptions(threads=2, max_new_tokens=4))
    try:
        assert isinstance(transcriber.transcribe(clip, "jfk"), str)
    finally:
        transcriber.close()
    config = BenchConfig(models=[str(exports["qwen3-asr.cpp-q4_0"])], audios=[jfk_wav], threads=[1],
                         runtime="qwen3-asr.cpp", warmup=0, runs=1, decode={"max_new_tokens": 4})
    cell = run_cpu_bench(config, log=lambda _: None).cells[0]
    assert cell.status == "ok", cell.error
    assert cell.summary["transcribe_s"].n == 1 and cell.summary["tokens"].median == 4


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_loader_patch_refuses_to_apply_without_unidiff_zero(tmp_path):
    patch = REPO / "third_party" / "qwen3-asr.cpp" / "loader-patch.diff"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("gguf_loader.cpp", "text_decoder.cpp"):  # stand-ins: the hunks carry no context to match
        (src / name).write_text("".join(f"// upstream line {i}\n" for i in range(1, 301)))
    git = ["git", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    plain = subprocess.run(git + ["apply", "--check", str(patch)], capture_output=True, text=True)
    assert plain.returncode != 0 and "patch does not apply" in plain.stderr
    subprocess.run(git + ["apply", "--unidiff-zero", str(patch)], check=True)
    lines = (src / "gguf_loader.cpp").read_text().splitlines()
    assert "--unidiff-zero" in lines[0] and lines[2] == "// upstream line 1"
    assert lines[lines.index("// upstream line 5") + 1] == "#include <map>"
