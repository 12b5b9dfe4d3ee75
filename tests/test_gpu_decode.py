"""tarq_deploy/bench/gpu_decode.py on the CPU: its own static-cache Llama decode loop (what the CUDA graph captures)
must compute transformers' logits, with float Linears and with the INT4 lattice swapped in; without CUDA the
benchmark measures nothing and exits 0. The graph capture and the timings themselves need CUDA (bench/gpu_decode_suite.sh).
"""
from __future__ import annotations

import pytest
import torch

from tarq_deploy.bench import gpu_decode
from tarq_deploy.bench.gpu_decode import StaticDecoder, build_text_model, weight_bytes
from tarq_deploy.bench.gpu_voxtral import snap_layers
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.runtimes.int4_linear import Int4Linear, replace_linears

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    return build_text_model(config, seed, device="cpu", dtype=torch.float32)


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def decode(model, context: list[int], forced: list[int]) -> torch.Tensor:
    dec = StaticDecoder(model, max_len=32)
    rows = [dec.prefill(torch.tensor([context]))]
    rows += [dec.forced_step(t) for t in forced]
    return torch.cat(rows)


def test_static_decoder_matches_transformers():
    model = tiny_llama()
    context, forced = [5, 17, 250, 3, 99, 42, 7], [11, 12, 13]
    got = decode(model, context, forced)
    full = full_forward_logits(model, context + forced)
    expected = full[len(context) - 1:]  # the logits after the context, then after each forced token
    assert got.shape == expected.shape == (1 + len(forced), 300)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_greedy_steps_advance_the_device_state():
    model = tiny_llama(1)
    dec = StaticDecoder(model, max_len=32)
    logits = dec.prefill(torch.tensor([[1, 2, 3]]))
    assert dec.token.item() == logits.argmax().item() and dec.position.item() == 3
    tokens = []
    for _ in range(4):
        dec.step()
        tokens.append(dec.token.item())
    assert dec.position.item() == 7
    full = full_forward_logits(model, [1, 2, 3, int(logits.argmax()), *tokens[:-1]])
    assert full[2:].argmax(-1).tolist()[1:] == tokens


def test_the_int4_lattice_in_the_decode_loop():
    """Snapped to the lattice (the bench's FP16 model) and then on Int4Linear (torch's CPU int4 kernel, float32):
    the same logits, and fewer weight bytes per token."""
    model = tiny_llama(2)
    lattice = snap_layers(model.model.layers, "model.layers", LatticeSpec(4, 32, scale_grid="bfloat16"))
    context, forced = [9, 8, 7, 6], [5, 4]
    fp = decode(model, context, forced)
    fp_bytes = weight_bytes(model)
    replace_linears(model, lattice)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 2 * 7
    int4 = decode(model, context, forced)
    assert torch.allclose(int4, fp, atol=1e-4, rtol=1e-4)
    assert weight_bytes(model) < fp_bytes


def test_fused_q_k_v_and_gate_up_compute_the_same_logits(monkeypatch):
    """q/k/v stacked into one matrix and gate/up into one (FP16 from the weights, INT4 from the lattice's rows):
    the same logits as the separate Linears, for float weights and for the lattice on Int4Linear."""
    monkeypatch.setattr(gpu_decode, "DEVICE", "cpu")
    model = tiny_llama(3)
    lattice = snap_layers(model.model.layers, "model.layers", LatticeSpec(4, 32, scale_grid="bfloat16"))
    context, forced = [4, 40, 140, 240], [1, 2]
    separate = decode(model, context, forced)
    fused = StaticDecoder(model, 32, gpu_decode.fused_linears(model, None, "fp16"))
    rows = [fused.prefill(torch.tensor([context]))] + [fused.forced_step(t) for t in forced]
    assert torch.allclose(torch.cat(rows), separate, atol=1e-5, rtol=1e-4)
    replace_linears(model, lattice)
    int4 = StaticDecoder(model, 32, gpu_decode.fused_linears(model, lattice, "tinygemm"))
    assert isinstance(int4.fused[0]["qkv"], Int4Linear) and int4.fused[0]["gate_up"].out_features == 2 * 256
    rows = [int4.prefill(torch.tensor([context]))] + [int4.forced_step(t) for t in forced]
    assert torch.allclose(torch.cat(rows), separate, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_nothing_is_measured(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert gpu_decode.main(["--layers", "1", "--out", str(out)]) == 0
    assert "CUDA not available" in capsys.readouterr().out and not out.exists()


def test_kernel_names_are_checked():
    with pytest.raises(SystemExit):
        gpu_decode.parse_args(["--kernels", "tinygemm,marlin"])
    assert gpu_decode.parse_args([]).kernels == ["tinygemm", "triton"]


def test_summary_and_markdown_from_partial_results():
    result = {"machine": {"gpu": "X"}, "config": {"layers": 1, "context": 8, "new_tokens": 4, "repeats": 2},
              "hbm": {"bytes_per_s": 3e12}, "kernels": [], "errors": {"triton": "RuntimeError: boom"},
              "variants": {"fp16": {"weight_bytes_per_token": 6e9, "kv_bytes_per_token": 6e7,
                                    "graph_ms_per_token": 2.5},
                           "tinygemm": {"weight_bytes_per_token": 2e9, "kv_bytes_per_token": 6e7,
                                        "graph_ms_per_token": 1.25}}}
    gpu_decode.summarize(result)
    assert result["variants"]["tinygemm"]["speedup_vs_fp16"] == 2.0 and result["goal"]["met"]
    assert abs(result["variants"]["fp16"]["floor_ms_per_token"] - 2.02) < 1e-9
    text = gpu_decode.markdown(result)
    assert "| tinygemm | 1.250 |" in text and "triton: RuntimeError: boom" in text
