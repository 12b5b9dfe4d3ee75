"""transcribe.cpp's mixed presets (``Q4_K_M``, ``Q5_K_M``) as a per-tensor type policy, so that ``quantize --target
transcribe.cpp --tensor-type q4_k_m`` gives every tensor the type transcribe.cpp's own ``transcribe-quantize`` would
give it -- each one then calibrated by our solvers instead of rounded.

The policy, as read from transcribe.cpp's tools/transcribe-quantize/policy.cpp (0.2.1) and its
docs/tools/quantization.md, for the tensors of a Whisper GGUF:

* weight matrices take the preset's main type (Q4_K, Q5_K); those whose name ends in ``attn.out.weight`` (encoder
  attention output, decoder self- and cross-attention outputs) take Q8_0;
* the decoder token embedding ``dec.token_embd.weight`` (also the tied output head) takes Q6_K;
* a matrix whose rows (ne0, the input width) the chosen type's block does not divide falls back to Q8_0, and to F16
  where 32 does not divide them either -- per tensor, by shape, so tiny's 384-wide rows get Q8_0 rather than a
  refusal;
* conv kernels, norms, biases, positional and front-end tables stay F32;
* ``general.file_type`` is llama.cpp's tag of the preset (15 = MOSTLY_Q4_K_M, 17 = MOSTLY_Q5_K_M).

Kept free of torch (the CLI's option parsing imports it).
"""
from __future__ import annotations

from dataclasses import dataclass

from .choices import GGML_TYPES, K_QUANT_ROW

__all__ = ["PRESETS", "Preset", "find_preset", "matrix_type"]

FLOAT_TYPES = ("f32", "f16")
LEGACY_BLOCK = 32  # q4_0 ... q8_0 store blocks of 32 values
# names whose matrices the _M presets bump to attn_out (transcribe.cpp's spellings over its families; Whisper's are
# enc.blocks.N.attn.out, dec.blocks.N.self_attn.out and dec.blocks.N.cross_attn.out)
ATTENTION_OUTPUT_SUFFIXES = ("attn.linear_out.weight", "attn.out.weight", "attn.o.weight")
TOKEN_EMBEDDINGS = ("dec.token_embd.weight", "dec.embed.token.weight")


@dataclass(frozen=True)
class Preset:
    """One row of transcribe.cpp's preset table, for the buckets a lattice can hold."""

    name: str  # transcribe.cpp's spelling, e.g. "Q4_K_M"
    main: str  # weight matrices
    attn_out: str  # attention output projections
    embed: str  # the decoder token embedding (tied output head)
    file_type: int  # general.file_type (llama.cpp's LlamaFileType)
    fallback: str = "q8_0"  # rows the chosen type's block does not divide
    conv: str = "f32"  # conv kernels (no quantized im2col)


PRESETS = {"q4_k_m": Preset("Q4_K_M", "q4_k", "q8_0", "q6_k", 15),
           "q5_k_m": Preset("Q5_K_M", "q5_k", "q8_0", "q6_k", 17)}


def find_preset(text: str) -> str | None:
    """The preset's key for a --tensor-type value in any case ("Q4_K_M", "q4_k_m"), as transcribe-quantize's own
    lookup is case-insensitive; None when the value names none."""
    key = text.strip().lower()
    return key if key in PRESETS else None


def block_size(type_name: str) -> int:
    """Values per block of a type: a row must be a whole number of them."""
    if type_name in FLOAT_TYPES:
        return 1
    scheme = GGML_TYPES[type_name][0]
    return K_QUANT_ROW if scheme.startswith("k-") else LEGACY_BLOCK


def matrix_type(preset: Preset, name: str, columns: int) -> str:
    """The type of weight matrix ``name`` (its GGUF name) whose rows hold ``columns`` values: the bucket's type, the
    fallback where its block does not divide the row, F16 where the fallback's does not either."""
    if name in TOKEN_EMBEDDINGS:
        chosen = preset.embed
    elif name.endswith(ATTENTION_OUTPUT_SUFFIXES):
        chosen = preset.attn_out
    else:
        chosen = preset.main
    for floor in (preset.fallback, "f16"):
        if columns % block_size(chosen) == 0:
            return chosen
        chosen = floor
    return chosen
