"""Device check for issue 29 (stage C of bench/gpu_decode_suite.sh): the GPU bench's Whisper decode on CUDA at large-v3
dimensions (random seeded fp16 weights), FP16 (cuBLAS) / INT4 tinygemm / INT4 triton, through the same calls as
``tarq-deploy bench --gpu`` (``tarq_deploy.bench.gpu.greedy_config`` + ``greedy_generate``):

- ``max_new_tokens`` holds (the 662-token run of bench/results/h100): tokens per run with the fixed config, and,
  for the record, with the config as it was before (``force_unique_generate_call`` unset, a cap of 16, at most 12
  inner generate calls);
- the Triton W4A16 layer inside transformers' Whisper (encoder M = 1500 tiles, decoder split-K), timed beside
  tinygemm and FP16 (eager generate: per-token figures here include Python's launches);
- agreement: greedy tokens of each INT4 kernel against FP16's.

Lattice: every Linear but proj_out, symmetric int4 g128 with bf16-exact scales (tinygemm's constraint), the FP16
model holding the same values. No tokenizer or checkpoint on disk is needed (the device has neither).

    PYTHONPATH=. python bench/gpu_whisper_decode_cap.py --out $OUT/whisper_check.json [--layers 32] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from tarq_deploy.bench.gpu import greedy_config, generated_token_count, greedy_generate
from tarq_deploy.bench.gpu_voxtral import synthetic_audio
from tarq_deploy.fileio import write_json_atomic
from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight, codes_for, scales_for

NO_TIMESTAMPS = 50364  # large-v3's <|notimestamps|>
PROMPT = [50258, NO_TIMESTAMPS]  # <|startoftranscript|> <|notimestamps|> (English-only prompt: no language token)


def build(layers: int, seed: int):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=51866, d_model=1280, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120,
                           decoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500,
                           max_target_positions=448, decoder_start_token_id=50258, eos_token_id=50257,
                           pad_token_id=50257, bos_token_id=50257)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = WhisperForConditionalGeneration._from_config(config, dtype=torch.float16).eval()
    gc = copy.deepcopy(model.generation_config)
    gc.no_timestamps_token_id, gc.is_multilingual = NO_TIMESTAMPS, False
    return model, gc


def snap(model) -> dict[str, QuantizedWeight]:
    spec = LatticeSpec(4, 128, scale_grid="bfloat16")
    lattice = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "proj_out":
            w = module.weight.detach().float()
            scales = scales_for(w, spec).to(torch.bfloat16).to(torch.float16)
            q = QuantizedWeight(codes_for(w, scales, spec), scales, spec)
            with torch.no_grad():
                module.weight.copy_(q.dequantize().to(torch.float16))
            lattice[f"{name}.weight"] = q.to("cpu")
    return lattice


def features_of(seconds: float, seed: int) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    audio = synthetic_audio(seconds, seed)
    extractor = WhisperFeatureExtractor(feature_size=128)
    return extractor(audio, sampling_rate=16000, return_tensors="pt").input_features.to("cuda", torch.float16)


def timed_generate(model, features, gc) -> tuple[list[int], float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    row = greedy_generate(model, features, PROMPT, gc)
    end.record()
    torch.cuda.synchronize()
    return row, start.elapsed_time(end)


def measure(model, features, gc, args) -> dict:
    fixed = greedy_config(gc, args.max_new_tokens)
    torch.cuda.reset_peak_memory_stats()
    runs = []
    for i in range(1 + args.runs):
        row, ms = timed_generate(model, features, fixed)
        tokens = generated_token_count(row, PROMPT)
        if i:
            runs.append({"generate_ms": ms, "tokens": tokens, "ms_per_token": ms / max(tokens, 1)})
    out = {"tokens": [r["tokens"] for r in runs], "max_new_tokens": args.max_new_tokens,
           "cap_held": all(r["tokens"] <= args.max_new_tokens for r in runs),
           "generate_ms_median": statistics.median(r["generate_ms"] for r in runs),
           "ms_per_token_median": statistics.median(r["ms_per_token"] for r in runs),
           "peak_vram_mb": torch.cuda.max_memory_allocated() / 2**20,
           "row": row, "timestamp_tokens_in_row": sum(t > NO_TIMESTAMPS for t in row)}
    return out


def old_config_tokens(model, features, gc, max_calls: int = 12) -> dict:
    """Tokens from the config as it was before the fix (cap 16): the seek loop may decode the window again after
    each cut. Its inner generate calls are counted and stopped at ``max_calls`` (a cut at <|0.00|> would not move)."""
    old = copy.deepcopy(gc)
    old.max_new_tokens, old.do_sample, old.num_beams = 16, False, 1
    inner = model.generate_with_fallback
    calls = 0

    def counted(*a, **k):
        nonlocal calls
        calls += 1
        if calls > max_calls:
            raise RuntimeError(f"more than {max_calls} generate calls for one window")
        return inner(*a, **k)

    model.generate_with_fallback = counted
    try:
        row, ms = timed_generate(model, features, old)
        return {"tokens": generated_token_count(row, PROMPT), "generate_calls": calls, "generate_ms": ms}
    except RuntimeError as e:
        return {"error": str(e), "generate_calls": calls}
    finally:
        del model.generate_with_fallback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--audio-seconds", type=float, default=11.0)
    parser.add_argument("--kernels", default="tinygemm,triton")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="whisper_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA not available: nothing measured")
        return 0
    from tarq_deploy.runtimes.int4_linear import replace_linears
    from tarq_deploy.runtimes.triton_w4a16 import replace_linears_triton

    result = {"config": vars(args), "variants": {}, "errors": {}}
    t0 = time.perf_counter()
    model, gc = build(args.layers, args.seed)
    lattice = snap(model)
    features = features_of(args.audio_seconds, args.seed)
    result["build_s"] = time.perf_counter() - t0
    for variant in ["fp16", *[k for k in args.kernels.split(",") if k]]:
        t1 = time.perf_counter()
        try:
            if variant == "tinygemm":
                replace_linears(model, lattice, device="cuda")
            elif variant == "triton":
                replace_linears_triton(model, lattice, device="cuda")
            figures = measure(model, features, gc, args)
            ref = result["variants"].get("fp16", {}).get("row")
            if ref is not None:
                same = sum(a == b for a, b in zip(figures["row"], ref))
                figures["tokens_equal_to_fp16"] = f"{same}/{min(len(ref), len(figures['row']))}"
            result["variants"][variant] = figures
            write_json_atomic(args.out, result, indent=1)
            print(variant, f"tokens {figures['tokens']} (cap held: {figures['cap_held']}), "
                  f"{figures['ms_per_token_median']:.2f} ms/token eager, peak {figures['peak_vram_mb']:.0f} MB, "
                  f"timestamps in row {figures['timestamp_tokens_in_row']}, "
                  f"vs fp16 {figures.get('tokens_equal_to_fp16')}", flush=True)
            figures["old_config_cap16"] = old_config_tokens(model, features, gc)
            print(variant, "config before the fix, cap 16:", figures["old_config_cap16"], flush=True)
        except Exception as e:  # one kernel failing must not lose the others
            result["errors"][variant] = f"{type(e).__name__}: {e}"
            print(variant, result["errors"][variant], flush=True)
        result.setdefault("stage_s", {})[variant] = time.perf_counter() - t1
        write_json_atomic(args.out, result, indent=1)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
