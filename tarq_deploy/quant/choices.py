"""The names a user picks from on the command line (solver methods, reweighting sources, export targets' default
group sizes), kept free of torch so that building `tarq-deploy --help` imports nothing heavy. quant/tarq.py and
quantize.py take them from here."""

from __future__ import annotations

METHODS = ("rtn", "gptq", "rarebal", "residual", "tarq", "imatrix")
SCALE_RULES = ("max", "search")
ALPHA_RULES = ("closed-form", "one")
SOURCES = ("rare", "random", "common")

# Group size by export target: ggml Q4_0 stores one fp16 scale per 32 weights anyway, so a 32-group lattice costs
# nothing extra there (and rounds 1.6x more finely than 128); GPU INT4 kernels use the paper's W4G128.
DEFAULT_GROUP_SIZE = {"whisper.cpp": 32, "qwen3-asr.cpp": 32, "crispasr": 32, "gptq": 128, "compressed-tensors": 128,
                      "marlin": 128}
