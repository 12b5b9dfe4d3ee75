"""GPU int4 formats (Marlin tiles, GPTQ v1, compressed-tensors pack-quantized) hold the lattice bit for bit.

The Marlin layout is checked against references written here from the published algorithm (IST-DASLab/marlin
``Layer.pack``, vLLM ``marlin_utils_test.marlin_weights`` / ``get_weight_perm`` and ``marlin_utils.get_scale_perms``):
one straightforward numpy re-implementation and one element-by-element derivation of where each code lands; the
GPTQ layout against a numpy re-implementation of the v1 dequantization runtimes use; compressed-tensors against the
``compressed-tensors`` library itself and a transformers model loaded from the written checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tarq_deploy.formats.compressed_tensors import (compressed_tensors_dequantize, compressed_tensors_layer,
                                           compressed_tensors_to_lattice, write_compressed_tensors_checkpoint)
from tarq_deploy.formats.int4_checkpoint import scales_exact_in_bf16
from tarq_deploy.formats.gptq_safetensors import (ExportError, gptq_dequantize, gptq_tensors, gptq_to_lattice,
                             write_gptq_checkpoint)
from tarq_deploy.formats.marlin import (SCALE_PERM, SCALE_PERM_SINGLE, WEIGHT_PERM, check_marlin_shape, marlin_pack,
                               marlin_unpack, write_marlin_checkpoint)
from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight

# Voxtral-Mini-3B decoder Linears as (K in, N out).
VOXTRAL_DECODER_SHAPES = {
    "q_proj": (3072, 4096),
    "k_proj": (3072, 1024),
    "v_proj": (3072, 1024),
    "o_proj": (4096, 3072),
    "gate_proj": (3072, 8192),
    "up_proj": (3072, 8192),
    "down_proj": (8192, 3072),
}
SYM_INT4_QZEROS_WORD = 0x77777777  # eight nibbles of zero point 8 minus one


# ------------------------------------------------------------------------------------------------------- helpers
def random_codes(k: int, n: int, seed: int) -> torch.Tensor:
    """Random codes int8 [N, K] covering [-8, 7]."""
    return torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def random_scales(k: int, n: int, group_size: int, seed: int) -> torch.Tensor:
    """Random positive fp16 scales [N, K/g], all distinct in practice (so a misplaced scale shows)."""
    groups = 1 if group_size == -1 else k // group_size
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.rand(n, groups, generator=gen) * 0.02 + 1e-4).to(torch.float16)


def random_lattice(k: int, n: int, group_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return random_codes(k, n, seed), random_scales(k, n, group_size, seed)


def lattice_value(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float().repeat_interleave(codes.shape[1] // scales.shape[1], dim=1)


def reference_weight_perm() -> np.ndarray:
    """``_perm`` exactly as the published loops build it."""
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    interleave = [0, 2, 4, 6, 1, 3, 5, 7]
    return np.array(perm).reshape(-1, 8)[:, interleave].ravel()


def reference_scale_perms() -> tuple[list[int], list[int]]:
    grouped = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return grouped, single


def reference_marlin_pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Straightforward numpy Marlin packing: K x N uint4b8, 16x16 tiles, _perm per 1024, shift-or into uint32."""
    w = codes.numpy().T.astype(np.int64) + 8
    k, n = w.shape
    w = w.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    w = w.reshape(-1, 1024)[:, reference_weight_perm()].reshape(k // 16, n * 16).astype(np.uint32)
    packed = np.zeros((w.shape[0], w.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= w[:, i::8] << np.uint32(4 * i)
    s = scales.numpy().T
    grouped, single = reference_scale_perms()
    perm = grouped if s.shape[0] > 1 else single
    s = s.reshape(-1, len(perm))[:, perm].reshape(-1, n)
    return packed.view(np.int32), s


def marlin_word_contents(k: int, n: int) -> list[list[tuple[int, int]]]:
    """Element-wise derivation: for each int32 of B (row-major), the (k, n) of its 8 nibbles, low first."""
    perm = reference_weight_perm()
    words = []
    for r in range(k // 16):
        for w in range(2 * n):
            nibbles = []
            for j in range(8):
                pos = 8 * w + j  # position in the permuted tile row
                src = (pos // 1024) * 1024 + int(perm[pos % 1024])  # position in the tiled row
                tile_col, within = divmod(src, 256)
                nibbles.append((16 * r + within // 16, 16 * tile_col + within % 16))
            words.append(nibbles)
    return words


def reference_gptq_v1_dequantize(qweight, qzeros, scales, g_idx) -> np.ndarray:
    """The v1 runtime rule in numpy: w[k, n] = s[g, n] * (u[k, n] - (qzero[g, n] + 1)), g = g_idx[k]."""
    qw = qweight.numpy().view(np.uint32)
    qz = qzeros.numpy().view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    u = ((qw[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qw.shape[1]).astype(np.int64)
    z = ((qz[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qz.shape[0], -1).astype(np.int64) + 1
    g = g_idx.numpy().astype(np.int64)
    w = scales.numpy().astype(np.float32)[g] * (u - z[g]).astype(np.float32)
    return w.T


def small_checkpoint(group_size: int = 128, n_q: int = 128, scales_bf16_exact: bool = False,
                     config_dtype: str = "float16") -> LatticeCheckpoint:
    """Two quantized Linears (one with bias), an embedding in bf16, a norm in fp32, a 16-bit lm_head."""
    spec = LatticeSpec(4, group_size)
    quantized = {}
    for i, (name, (k, n)) in enumerate({"model.layers.0.self_attn.q_proj.weight": (128, n_q),
                                        "model.layers.0.mlp.down_proj.weight": (256, 128)}.items()):
        codes, scales = random_lattice(k, n, group_size, seed=i)
        if scales_bf16_exact:
            scales = scales.to(torch.bfloat16).to(torch.float16)
        quantized[name] = QuantizedWeight(codes, scales, spec)
    tensors = {
        "model.layers.0.self_attn.q_proj.bias": torch.randn(n_q).to(torch.float16),
        "model.embed_tokens.weight": torch.randn(32, 128).to(torch.bfloat16),
        "model.norm.weight": torch.randn(128),
        "lm_head.weight": torch.randn(32, 128).to(torch.float16),
    }
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": config_dtype}
    files = {"config.json": json.dumps(config).encode(), "tokenizer.json": b'{"version": "1.0"}'}
    return LatticeCheckpoint(spec, quantized, tensors, metadata={"method": "rtn"}, model_files=files)


def legacy_marlin_checkpoint(**kwargs) -> LatticeCheckpoint:
    """``small_checkpoint`` cut to what every writer (legacy Marlin too: N % 256) accepts."""
    ckpt = small_checkpoint(n_q=256, **kwargs)
    ckpt.quantized.pop("model.layers.0.mlp.down_proj.weight")  # N = 128 is below the legacy N % 256 rule
    return ckpt


# ------------------------------------------------------------------------------------------------------- Marlin
def test_marlin_permutations_match_published_tables():
    assert WEIGHT_PERM.tolist() == reference_weight_perm().tolist()
    assert WEIGHT_PERM[:8].tolist() == [0, 128, 8, 136, 16, 144, 24, 152]
    assert sorted(WEIGHT_PERM.tolist()) == list(range(1024))
    grouped, single = reference_scale_perms()
    assert SCALE_PERM.tolist() == grouped and SCALE_PERM_SINGLE.tolist() == single


@pytest.mark.parametrize("layer", list(VOXTRAL_DECODER_SHAPES))
def test_marlin_round_trip_is_identity_on_every_voxtral_decoder_shape(layer):
    k, n = VOXTRAL_DECODER_SHAPES[layer]
    seed = list(VOXTRAL_DECODER_SHAPES).index(layer)
    codes = random_codes(k, n, seed)
    for group_size in (128, -1):  # one code matrix, both scale layouts: the codes dominate the time
        scales = random_scales(k, n, group_size, seed)
        packed, marlin_scales = marlin_pack(codes, scales, group_size)
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (k // 16, 2 * n)
        assert tuple(marlin_scales.shape) == (scales.shape[1], n)
        codes_back, scales_back = marlin_unpack(packed, marlin_scales, k, n)
        assert torch.equal(codes_back, codes), group_size
        assert torch.equal(scales_back, scales), group_size


@pytest.mark.parametrize("group_size", [32, 64])
def test_marlin_round_trip_small_groups(group_size):
    codes, scales = random_lattice(3072, 1024, group_size, seed=7)
    codes_back, scales_back = marlin_unpack(*marlin_pack(codes, scales, group_size), 3072, 1024)
    assert torch.equal(codes_back, codes) and torch.equal(scales_back, scales)


@pytest.mark.parametrize("layer,group_size", [("k_proj", 128), ("o_proj", -1)])
def test_marlin_words_equal_the_reference_packer(layer, group_size):
    k, n = VOXTRAL_DECODER_SHAPES[layer]
    codes, scales = random_lattice(k, n, group_size, seed=3)
    packed, marlin_scales = marlin_pack(codes, scales, group_size)
    ref_packed, ref_scales = reference_marlin_pack(codes, scales)
    assert np.array_equal(packed.numpy(), ref_packed)
    assert np.array_equal(marlin_scales.numpy(), ref_scales)


def test_marlin_word_contents_element_by_element():
    k, n = 128, 64
    codes, scales = random_lattice(k, n, 32, seed=11)
    words = marlin_pack(codes, scales, 32)[0].numpy().view(np.uint32).ravel()
    contents = marlin_word_contents(k, n)
    assert len(words) == len(contents) == k // 16 * 2 * n
    u = codes.numpy().T.astype(np.int64) + 8  # [K, N]
    for word, nibbles in zip(words, contents):
        assert int(word) == sum(int(u[kk, nn]) << (4 * j) for j, (kk, nn) in enumerate(nibbles))
    assert sorted(set(sum(contents, []))) == [(kk, nn) for kk in range(k) for nn in range(n)]  # each code once


def test_marlin_shape_rules():
    for k, n in VOXTRAL_DECODER_SHAPES.values():
        check_marlin_shape(k, n, 128)
        check_marlin_shape(k, n, -1, legacy=True)
    with pytest.raises(ExportError, match="multiple of 64"):
        check_marlin_shape(128, 96, 128)
    with pytest.raises(ExportError, match="multiple of 128"):
        check_marlin_shape(192, 128, 64)
    with pytest.raises(ExportError, match="multiple of 256"):
        check_marlin_shape(128, 192, 128, legacy=True)
    with pytest.raises(ExportError, match="group size 32"):
        check_marlin_shape(128, 256, 32, legacy=True)


# --------------------------------------------------------------------------------------------------------- GPTQ
@pytest.mark.parametrize("layer,group_size", [("k_proj", 128), ("down_proj", 128), ("q_proj", -1), ("v_proj", 32)])
def test_gptq_dequantizes_to_the_lattice_exactly(layer, group_size):
    k, n = VOXTRAL_DECODER_SHAPES[layer]
    codes, scales = random_lattice(k, n, group_size, seed=5)
    t = gptq_tensors(codes, scales, LatticeSpec(4, group_size))
    groups = scales.shape[1]
    assert t["qweight"].dtype == torch.int32 and tuple(t["qweight"].shape) == (k // 8, n)
    assert t["qzeros"].dtype == torch.int32 and tuple(t["qzeros"].shape) == (groups, n // 8)
    assert (t["qzeros"].numpy().view(np.uint32) == SYM_INT4_QZEROS_WORD).all()
    assert t["scales"].dtype == torch.float16 and tuple(t["scales"].shape) == (groups, n)
    assert torch.equal(t["g_idx"], (torch.arange(k) // (k // groups)).to(torch.int32))
    expected = lattice_value(codes, scales)
    assert torch.equal(gptq_dequantize(**t), expected)
    if layer == "k_proj":  # the independent numpy rule on one shape is enough
        assert np.array_equal(reference_gptq_v1_dequantize(**t), expected.numpy())
    codes_back, scales_back = gptq_to_lattice(**t)
    assert torch.equal(codes_back, codes) and torch.equal(scales_back, scales)


def test_gptq_checkpoint_from_small_lattice_checkpoint(tmp_path):
    ckpt = small_checkpoint()
    out = write_gptq_checkpoint(ckpt, tmp_path / "gptq")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
    assert qc["modules_in_block_to_quantize"] == [["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]]
    assert json.loads((out / "quantize_config.json").read_text()) == qc
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float16"
    assert (out / "tokenizer.json").read_bytes() == ckpt.model_files["tokenizer.json"]
    tensors = load_file(str(out / "model.safetensors"))
    for name, q in ckpt.quantized.items():
        prefix = name[: -len(".weight")]
        assert name not in tensors
        parts = {s: tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        assert torch.equal(gptq_dequantize(**parts), q.dequantize())
    for name, t in ckpt.tensors.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_gptq_per_channel_config(tmp_path):
    out = write_gptq_checkpoint(small_checkpoint(group_size=-1), tmp_path / "gptq")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == -1
    tensors = load_file(str(out / "model.safetensors"))
    assert tuple(tensors["model.layers.0.mlp.down_proj.scales"].shape) == (1, 128)
    assert not tensors["model.layers.0.mlp.down_proj.g_idx"].any()


@pytest.mark.parametrize("writer,message", [
    (write_gptq_checkpoint, r"q_proj.weight: 96 outputs \(N\) are not a multiple of 64"),
    (write_compressed_tensors_checkpoint, r"q_proj.weight: 96 outputs \(N\) are not a multiple of 64"),
    (write_marlin_checkpoint, r"down_proj.weight: 128 outputs \(N\) are not a multiple of 256")])
def test_bad_shape_is_refused_and_nothing_written(tmp_path, writer, message):
    out = tmp_path / "export"
    with pytest.raises(ExportError, match=message):
        writer(small_checkpoint(n_q=96), out)
    assert list(tmp_path.iterdir()) == []


def test_tied_quantized_weight_and_other_bit_widths_are_refused(tmp_path):
    ckpt = small_checkpoint()
    ckpt.aliases["model.layers.0.self_attn.k_proj.weight"] = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ExportError, match="tied to the quantized"):
        write_gptq_checkpoint(ckpt, tmp_path / "a")
    ckpt = small_checkpoint()
    ckpt.spec = LatticeSpec(8, 128)
    with pytest.raises(ExportError, match="8 bits"):
        write_compressed_tensors_checkpoint(ckpt, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_not_overwritten_unless_asked(tmp_path):
    out = tmp_path / "gptq"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ExportError, match="already exists"):
        write_gptq_checkpoint(small_checkpoint(), out)
    assert (out / "keep").exists()
    write_gptq_checkpoint(small_checkpoint(), out, overwrite=True)
    assert not (out / "keep").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptq"]


# --------------------------------------------------------------------------------------------------- bf16 scales
def test_scales_exact_in_bf16():
    assert scales_exact_in_bf16(torch.tensor([1.0, 0.5, 0.0078125, 2.0**-20], dtype=torch.float16))
    assert not scales_exact_in_bf16(torch.tensor([1.0 + 2.0**-10], dtype=torch.float16))


@pytest.mark.parametrize("writer", [write_gptq_checkpoint, write_compressed_tensors_checkpoint,
                                    write_marlin_checkpoint])
def test_bf16_target_refuses_inexact_scales(tmp_path, writer):
    with pytest.raises(ExportError, match="not exactly representable in bfloat16"):
        writer(legacy_marlin_checkpoint(), tmp_path / "a", serve_dtype="bfloat16")
    with pytest.raises(ExportError, match="not exactly representable in bfloat16"):  # the config's dtype counts
        writer(legacy_marlin_checkpoint(config_dtype="bfloat16"), tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_bf16_target_with_exact_scales(tmp_path):
    ckpt = small_checkpoint(scales_bf16_exact=True, config_dtype="bfloat16")
    out = write_compressed_tensors_checkpoint(ckpt, tmp_path / "ct")
    tensors = load_file(str(out / "model.safetensors"))
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.dtype == torch.bfloat16
    assert torch.equal(scale.float(), ckpt.quantized["model.layers.0.mlp.down_proj.weight"].scales.float())


def test_float16_target_rewrites_config_dtype(tmp_path):
    out = write_gptq_checkpoint(small_checkpoint(config_dtype="bfloat16"), tmp_path / "g", serve_dtype="float16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"


# ----------------------------------------------------------------------------------------- compressed-tensors
@pytest.mark.parametrize("group_size", [128, -1])
def test_compressed_tensors_layer_is_qweight_transposed_and_exact(group_size):
    k, n = VOXTRAL_DECODER_SHAPES["o_proj"]
    codes, scales = random_lattice(k, n, group_size, seed=9)
    ct = compressed_tensors_layer(codes, scales, torch.float16)
    assert ct["weight_packed"].dtype == torch.int32 and tuple(ct["weight_packed"].shape) == (n, k // 8)
    assert ct["weight_shape"].tolist() == [n, k]
    assert torch.equal(ct["weight_packed"], gptq_tensors(codes, scales, LatticeSpec(4, group_size))["qweight"].T)
    assert torch.equal(compressed_tensors_dequantize(**ct), lattice_value(codes, scales))
    codes_back, scales_back = compressed_tensors_to_lattice(**ct)
    assert torch.equal(codes_back, codes) and torch.equal(scales_back, scales)


def test_compressed_tensors_library_unpacks_our_tensors(tmp_path):
    ct_lib = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    ckpt = small_checkpoint()
    out = write_compressed_tensors_checkpoint(ckpt, tmp_path / "ct")
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.symmetric, weights.strategy, weights.group_size) == (4, True, "group", 128)
    assert parsed.format == "pack-quantized" and "lm_head" in parsed.ignore
    tensors = load_file(str(out / "model.safetensors"))
    for name, q in ckpt.quantized.items():
        prefix = name[: -len(".weight")]
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
        codes = unpack_from_int32(tensors[f"{prefix}.weight_packed"], 4, shape)
        assert torch.equal(codes, q.codes), name
        assert torch.equal(tensors[f"{prefix}.weight_scale"], q.scales), name
    assert ct_lib.__version__


def tiny_llama_lattice(group_size: int = 128) -> LatticeCheckpoint:
    """A one-layer random Llama whose seven projections are on the lattice (shapes fit Marlin: N % 64, K % 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False,
                         torch_dtype="float16")
    state = LlamaForCausalLM(config).half().state_dict()
    spec = LatticeSpec(4, group_size)
    quantized = {}
    for i, name in enumerate(n for n in state if n.endswith("_proj.weight")):
        n_out, k_in = state[name].shape
        quantized[name] = QuantizedWeight(*random_lattice(k_in, n_out, group_size, seed=i), spec)
    tensors = {name: t for name, t in state.items() if name not in quantized}
    return LatticeCheckpoint(spec, quantized, tensors, model_files={"config.json": config.to_json_string().encode()})


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_transformers_loads_compressed_tensors_checkpoint(tmp_path):
    """A real loader: transformers + compressed-tensors decompress our files into the lattice weights (rounded
    to the scale dtype, as the library multiplies in it) and keep every other tensor."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ckpt = tiny_llama_lattice()
    out = write_compressed_tensors_checkpoint(ckpt, tmp_path / "ct")
    model = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True),
                                                 dtype=torch.float16)
    loaded = model.state_dict()
    for name, q in ckpt.quantized.items():
        assert torch.equal(loaded[name], q.dequantize().to(torch.float16)), name
    for name, t in ckpt.tensors.items():
        assert torch.equal(loaded[name], t), name


@pytest.mark.parametrize("group_size", [128, -1])
def test_transformers_loads_gptq_checkpoint(tmp_path, group_size):
    """A real loader on CPU: transformers + optimum + gptqmodel with its pure-torch kernel (backend "torch"; the
    default CPU kernel, aten int4pack, computes in bf16 and is not exact). Each quantized Linear applied to the
    identity gives its weight: the lattice value rounded to fp16, the model dtype."""
    pytest.importorskip("optimum")
    pytest.importorskip("gptqmodel")
    from transformers import AutoModelForCausalLM, GPTQConfig

    ckpt = tiny_llama_lattice(group_size)
    out = write_gptq_checkpoint(ckpt, tmp_path / "gptq")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16, device_map="cpu",
                                                 quantization_config=GPTQConfig(bits=4, backend="torch"))
    for name, q in ckpt.quantized.items():
        layer = model.get_submodule(name[: -len(".weight")])
        assert "qweight" in dict(layer.named_buffers()), name
        with torch.no_grad():
            weight = layer(torch.eye(q.codes.shape[1], dtype=torch.float16)).T
        assert torch.equal(weight, q.dequantize().to(torch.float16)), name
    loaded = model.state_dict()
    for name, t in ckpt.tensors.items():
        assert torch.equal(loaded[name], t), name


# --------------------------------------------------------------------------------------------- legacy Marlin
def test_legacy_marlin_checkpoint(tmp_path):
    ckpt = legacy_marlin_checkpoint()
    out = write_marlin_checkpoint(ckpt, tmp_path / "marlin")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "marlin" and qc["is_marlin_format"] is True and qc["group_size"] == 128
    tensors = load_file(str(out / "model.safetensors"))
    q = ckpt.quantized["model.layers.0.self_attn.q_proj.weight"]
    packed, scales = tensors["model.layers.0.self_attn.q_proj.B"], tensors["model.layers.0.self_attn.q_proj.s"]
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (128 // 16, 2 * 256)
    assert scales.dtype == torch.float16 and tuple(scales.shape) == (1, 256)
    codes, scales_back = marlin_unpack(packed, scales, 128, 256)
    assert torch.equal(codes, q.codes) and torch.equal(scales_back, q.scales)
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(tensors[bias], ckpt.tensors[bias])
