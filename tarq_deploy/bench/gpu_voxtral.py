"""GPU benchmark: Voxtral-Mini-3B dimensions, FP16 vs INT4 (PyTorch tinygemm), end to end and per Linear.

    python -m tarq_deploy.bench.gpu_voxtral [--layers 30] [--audio-layers 32] [--new-tokens 128] [--repeats 3]
                                [--out bench/results/gpu_voxtral.json]

Model: ``VoxtralForConditionalGeneration`` with the real Voxtral-Mini-3B-2507 configuration (transformers'
``VoxtralConfig`` defaults: language model hidden 3072, 30 layers, 32 heads / 8 kv heads, head_dim 128, intermediate
8192, vocab 131072, rope theta 1e8; audio encoder whisper-large-v3-like: 32 layers, d 1280, 20 heads, ffn 5120,
128 mel bins) and random weights (seeded); ``--layers`` / ``--audio-layers`` cut layers for memory or time.

Lattice: every language-model decoder Linear (q/k/v/o/gate/up/down) is rounded to the symmetric int4 g128 lattice
with scales snapped to values exact in bfloat16 (tinygemm computes in bfloat16: such a scale reaches the kernel
unchanged). The FP16 model holds the dequantized lattice (exact in fp16: a bf16-exact scale times a code in [-8, 7]
needs at most 11 significant bits), so FP16 and INT4 compute the same weights; INT4 swaps those Linears for
``tarq_deploy.runtimes.int4_linear.Int4Linear`` (``torch.ops.aten._weight_int4pack_mm``; activations cast to bf16).

Measured, per variant: end-to-end latency for 30 s of audio and ``--new-tokens`` greedy tokens (mel features on
the CPU, timed with perf_counter; prefill and generate on the GPU, timed with CUDA events; ``min_new_tokens`` forces
the full count), median over ``--repeats`` after ``--warmup``; peak VRAM (torch.cuda.max_memory_allocated, reset
before each variant) and the bytes of the model's own tensors. Agreement: teacher-forced logits of INT4 against the
FP16 model over the prompt and 32 text tokens, relative Frobenius error (goal < 1e-2) and top-1 agreement. Kernels:
each decoder Linear shape, M = 1 (decode) and M = 384 (prefill), fp16 F.linear vs Int4Linear, CUDA events.

Prompt ids are Voxtral's transcription prompt with the real Tekken ids: <s> 1, [INST] 3, [BEGIN_AUDIO] 25,
[AUDIO] 24 x 375, [/INST] 4, "lang:en" = 9909 1058 1262, [TRANSCRIBE] 34.
Without CUDA the script prints "CUDA not available: nothing measured" and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import numpy as np
import torch

from tarq_deploy.fileio import write_json_atomic
from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight, codes_for, scales_for
from tarq_deploy.runtimes.int4_linear import Int4Linear, replace_linears

__all__ = ["TEXT_CONFIG", "main", "snap_layers", "synthetic_audio"]

SAMPLE_RATE = 16000
AUDIO_TOKENS_PER_CHUNK = 375
PROMPT_HEAD = [1, 3, 25]  # <s> [INST] [BEGIN_AUDIO]
PROMPT_TAIL = [4, 9909, 1058, 1262, 34]  # [/INST] lang:en [TRANSCRIBE]
AUDIO_TOKEN_ID = 24
TEACHER_TOKENS = 32
DECODER_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
KERNEL_M = (1, 384)
KERNEL_ITERS = 50
AGREEMENT_GOAL = 1e-2


# ------------------------------------------------------------------------------------------------------ the model
# Voxtral-Mini-3B-2507's language model (a Llama) and audio encoder, written out (the VoxtralConfig defaults)
TEXT_CONFIG = {"model_type": "llama", "vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 8192,
               "num_hidden_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
               "max_position_embeddings": 131072, "rope_theta": 1e8, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False}
AUDIO_CONFIG = {"model_type": "voxtral_encoder", "hidden_size": 1280, "intermediate_size": 5120,
                "num_hidden_layers": 32, "num_attention_heads": 20, "num_mel_bins": 128, "max_source_positions": 1500}


def voxtral_mini_config(text_layers: int, audio_layers: int):
    """Voxtral-Mini-3B-2507's configuration, layers cut as asked."""
    from transformers import VoxtralConfig

    text = {**TEXT_CONFIG, "num_hidden_layers": text_layers}
    audio = {**AUDIO_CONFIG, "num_hidden_layers": audio_layers}
    return VoxtralConfig(text_config=text, audio_config=audio, audio_token_id=AUDIO_TOKEN_ID)


def build_model(config, seed: int):
    from transformers import VoxtralForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = VoxtralForConditionalGeneration._from_config(config, dtype=torch.float16)
    return model.eval()


def snap_to_lattice(model, spec: LatticeSpec) -> dict[str, QuantizedWeight]:
    """Round every decoder Linear onto the lattice with bf16-exact scales; the fp16 weights become its values."""
    return snap_layers(model.model.language_model.layers, "model.language_model.layers", spec)


def snap_layers(layers, prefix: str, spec: LatticeSpec) -> dict[str, QuantizedWeight]:
    """snap_to_lattice for any Llama decoder layer list; names ``{prefix}.{i}.{linear}.weight``."""
    lattice = {}
    for i, layer in enumerate(layers):
        for rel in DECODER_LINEARS:
            linear = layer.get_submodule(rel)
            w = linear.weight.detach().float()
            scales = scales_for(w, spec).to(torch.bfloat16).to(torch.float16)  # exact in bf16 and fp16
            q = QuantizedWeight(codes_for(w, scales, spec), scales, spec)
            with torch.no_grad():
                linear.weight.copy_(q.dequantize().to(torch.float16))
            lattice[f"{prefix}.{i}.{rel}.weight"] = q.to("cpu")  # off the GPU: not in FP16's peak
    return lattice


def tensor_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# ------------------------------------------------------------------------------------------------------- inputs
def prompt_ids(n_chunks: int) -> list[int]:
    return PROMPT_HEAD + [AUDIO_TOKEN_ID] * (AUDIO_TOKENS_PER_CHUNK * n_chunks) + PROMPT_TAIL


def synthetic_audio(seconds: float, seed: int) -> np.ndarray:
    """Deterministic speech-band noise (the weights are random: what the audio says does not matter)."""
    rng = np.random.default_rng(seed)
    return (0.05 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)


def mel_features(audio: np.ndarray) -> torch.Tensor:
    """[chunks, 128, 3000] as VoxtralProcessor makes them (padded to whole 30 s chunks)."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=128)
    features = extractor(audio, sampling_rate=SAMPLE_RATE, padding=True, truncation=False,
                         pad_to_multiple_of=30 * SAMPLE_RATE, return_tensors="pt").input_features
    return features.reshape(128, -1, 3000).transpose(0, 1).contiguous()


# ------------------------------------------------------------------------------------------------------ timing
def cuda_ms(fn) -> tuple[float, object]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), out


def end_to_end(model, audio: np.ndarray, new_tokens: int) -> dict:
    """One transcription: CPU mel features, then prefill (one forward) and generate (prefill + all tokens)."""
    t0 = time.perf_counter()
    features = mel_features(audio)
    features_ms = 1e3 * (time.perf_counter() - t0)
    ids = torch.tensor([prompt_ids(features.shape[0])], device="cuda")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "input_features": features.to("cuda", torch.float16)}
    with torch.no_grad():
        prefill_ms, _ = cuda_ms(lambda: model(**inputs, logits_to_keep=1))
        generate_ms, out = cuda_ms(lambda: model.generate(**inputs, max_new_tokens=new_tokens,
                                                          min_new_tokens=new_tokens, do_sample=False, num_beams=1))
    produced = int(out.shape[1] - ids.shape[1])
    return {"features_ms": features_ms, "prefill_ms": prefill_ms, "generate_ms": generate_ms,
            "e2e_ms": features_ms + generate_ms, "new_tokens": produced,
            "decode_ms_per_token": (generate_ms - prefill_ms) / max(produced - 1, 1)}


def measure_variant(model, audio: np.ndarray, new_tokens: int, warmup: int, repeats: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        end_to_end(model, audio, new_tokens)
    runs = [end_to_end(model, audio, new_tokens) for _ in range(repeats)]
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return {"runs": runs, "median": median, "peak_vram_bytes": torch.cuda.max_memory_allocated(),
            "model_tensor_bytes": tensor_bytes(model), "allocated_bytes": torch.cuda.memory_allocated()}


def teacher_forced_logits(model, features: torch.Tensor, seed: int) -> torch.Tensor:
    text = torch.randint(1000, 131072, (TEACHER_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = torch.tensor([prompt_ids(features.shape[0]) + text], device="cuda")
    with torch.no_grad():
        return model(input_ids=ids, input_features=features.to("cuda", torch.float16)).logits[0].float()


def agreement(int4: torch.Tensor, fp16: torch.Tensor) -> dict:
    relative = float((int4 - fp16).norm() / fp16.norm())
    return {"relative_error": relative, "max_abs_diff": float((int4 - fp16).abs().max()),
            "top1_agreement": float((int4.argmax(-1) == fp16.argmax(-1)).float().mean()),
            "goal": AGREEMENT_GOAL, "passed": relative < AGREEMENT_GOAL}


# ------------------------------------------------------------------------------------------------------ kernels
def kernel_rows(lattice: dict[str, QuantizedWeight]) -> list[dict]:
    """fp16 F.linear vs Int4Linear for each distinct decoder Linear shape (taken from layer 0)."""
    rows = []
    for rel in DECODER_LINEARS:
        q = lattice[f"model.language_model.layers.0.{rel}.weight"]
        n, k = q.codes.shape
        weight = q.dequantize().to("cuda", torch.float16)
        int4 = Int4Linear.from_lattice(q, device="cuda")
        for m in KERNEL_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            fp16_ms = _median_ms(lambda: torch.nn.functional.linear(x, weight))
            int4_ms = _median_ms(lambda: int4(x))
            rows.append({"linear": rel, "n_out": n, "k_in": k, "m": m, "fp16_ms": fp16_ms, "int4_ms": int4_ms,
                         "speedup": fp16_ms / int4_ms})
    return rows


def _median_ms(fn) -> float:
    for _ in range(5):
        fn()
    return statistics.median(cuda_ms(fn)[0] for _ in range(KERNEL_ITERS))


# --------------------------------------------------------------------------------------------------------- main
def machine() -> dict:
    import transformers

    return {"platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}


def run(args: argparse.Namespace) -> dict:
    config = voxtral_mini_config(args.layers, args.audio_layers)
    spec = LatticeSpec(4, args.group_size)
    model = build_model(config, args.seed)
    lattice = snap_to_lattice(model, spec)
    audio = synthetic_audio(args.audio_seconds, args.seed)
    features = mel_features(audio)
    fp16 = measure_variant(model, audio, args.new_tokens, args.warmup, args.repeats)
    fp16_logits = teacher_forced_logits(model, features, args.seed)
    kernels = kernel_rows(lattice)
    replace_linears(model, lattice, device="cuda")  # the fp16 weights go with the replaced modules
    del lattice
    int4 = measure_variant(model, audio, args.new_tokens, args.warmup, args.repeats)
    result = {"benchmark": "gpu_voxtral", "machine": machine(), "measured": True,
              "config": {"text_layers": args.layers, "audio_layers": args.audio_layers, "group_size": args.group_size,
                         "audio_seconds": args.audio_seconds, "new_tokens": args.new_tokens, "warmup": args.warmup,
                         "repeats": args.repeats, "seed": args.seed,
                         "prompt_tokens": len(prompt_ids(features.shape[0]))},
              "fp16": fp16, "int4": int4,
              "agreement": agreement(teacher_forced_logits(model, features, args.seed), fp16_logits),
              "kernels": kernels}
    result["speedup_e2e"] = fp16["median"]["e2e_ms"] / int4["median"]["e2e_ms"]
    result["vram_ratio"] = int4["peak_vram_bytes"] / fp16["peak_vram_bytes"]
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="language-model decoder layers (real: 30)")
    parser.add_argument("--audio-layers", type=int, default=32, help="audio encoder layers (real: 32)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--audio-seconds", type=float, default=30.0)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--out", default="runs/bench/gpu_voxtral.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA not available: nothing measured")
        return 0
    result = run(args)
    out = write_json_atomic(args.out, result, indent=2)
    f, q = result["fp16"], result["int4"]
    print(f"e2e (30 s audio, {args.new_tokens} tokens): fp16 {f['median']['e2e_ms']:.0f} ms, "
          f"int4 {q['median']['e2e_ms']:.0f} ms (x{result['speedup_e2e']:.2f}); peak VRAM fp16 "
          f"{f['peak_vram_bytes'] / 2**30:.2f} GiB, int4 {q['peak_vram_bytes'] / 2**30:.2f} GiB; logits rel. error "
          f"{result['agreement']['relative_error']:.2e} ({'ok' if result['agreement']['passed'] else 'ABOVE GOAL'}); "
          f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
