"""The GPU bench's decode (tarq_deploy/bench/gpu.py) on the CPU: ``max_new_tokens`` holds, and the INT4 kernel
choice (tinygemm / triton / marlin) skips with the reason where a kernel cannot run.

The 662-token run (bench/results/h100/bench-gpu-large-v3-dims.md: INT4 decoded 662 tokens against a cap of 64):
Whisper's generate cuts a window at its last timestamp token whenever two timestamp tokens follow each other, and
decodes again from there, ``max_new_tokens`` per call; random or badly quantized weights emit timestamps even after
<|notimestamps|>. A tiny random Whisper whose head always picks one timestamp token reproduces it on the CPU.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tarq_deploy.bench import gpu
from tarq_deploy.bench.gpu import (GpuBenchConfig, KernelUnavailable, greedy_config, _variants, build_variant,
                                   generated_token_count, greedy_generate, kernel_unavailable_reason)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_TIMESTAMPS = 50362  # tiny.en's <|notimestamps|>; timestamps start at the next id
PROMPT = [50257, NO_TIMESTAMPS]  # <|startoftranscript|> <|notimestamps|>


@pytest.fixture(scope="module")
def timestamp_whisper():
    """A random 1-layer Whisper with tiny.en's vocabulary whose every step picks the timestamp <|10.00|>."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51864, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256,
                           bos_token_id=50256)
    model = WhisperForConditionalGeneration(config).eval()
    timestamp = NO_TIMESTAMPS + 1 + 500  # 10.00 s: each cut window resumes 1000 frames later

    def always_the_timestamp(module, inputs, logits):
        logits = logits.clone()
        logits[..., timestamp] += 1e4
        return logits

    model.proj_out.register_forward_hook(always_the_timestamp)
    generation_config = copy.deepcopy(model.generation_config)
    generation_config.no_timestamps_token_id = NO_TIMESTAMPS
    generation_config.is_multilingual = False
    return model, generation_config


def test_max_new_tokens_holds_when_the_model_emits_timestamps(timestamp_whisper):
    model, generation_config = timestamp_whisper
    features = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))  # one 30 s window
    old = copy.deepcopy(generation_config)  # what greedy_config set before the fix
    old.max_new_tokens, old.do_sample, old.num_beams = 8, False, 1
    cut = greedy_generate(model, features, PROMPT, old)
    assert generated_token_count(cut, PROMPT) > 8  # the bug: the window decoded again after each cut
    row = greedy_generate(model, features, PROMPT, greedy_config(generation_config, 8))
    assert generated_token_count(row, PROMPT) == 8
    assert not hasattr(generation_config, "force_unique_generate_call") or \
        not generation_config.force_unique_generate_call  # greedy_config changed a copy only


def test_kernel_choices_skip_with_their_reason(monkeypatch):
    assert gpu.KERNELS == ("tinygemm", "triton", "marlin")
    config = GpuBenchConfig("packaged:tiny.en", [], checkpoint="ckpt")
    assert _variants(config) == [("FP16", "cublas-fp16"), ("INT4", "tinygemm"), ("INT4", "triton"),
                                 ("INT4", "marlin")]
    assert kernel_unavailable_reason("tinygemm") is None
    assert "vllm or gptqmodel" in kernel_unavailable_reason("marlin").lower() or \
        "not wired" in kernel_unavailable_reason("marlin")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = kernel_unavailable_reason("triton", "cpu")
    assert reason is not None and ("triton is not installed" in reason or "runs on CUDA" in reason)
    with pytest.raises(KernelUnavailable, match="triton|Triton"):  # before any model is loaded
        build_variant("packaged:tiny.en", "no-such-checkpoint", "triton", "cpu", torch.float32)
    if not torch.cuda.is_available():
        assert kernel_unavailable_reason("triton", "cuda") is not None
