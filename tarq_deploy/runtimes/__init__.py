"""The runtimes layer: one adapter per speech runtime (whisper.cpp, CrispASR, qwen3-asr.cpp, PyTorch Whisper, PyTorch
Qwen3-ASR) listed in ``registry``, which evaluation and the CPU bench both use, and modules that execute lattice
weights directly (``int4_linear``: PyTorch's int4 kernels). Imports core and formats only."""
