"""GPU benchmark: Whisper in FP16 (transformers, cuBLAS) against the INT4 lattice on INT4 kernels.

    tarq-deploy bench --gpu --model packaged:tiny.en --checkpoint CKPT_DIR --audio jfk.wav \
        [--kernels tinygemm,triton,marlin]

Variants, each measured on every audio: ``FP16`` (the float model from ``--model``), and per kernel ``INT4`` = the
same model with every Linear on the checkpoint's lattice swapped for an INT4 module:

* ``tinygemm`` -- PyTorch's own ``_weight_int4pack_mm``; it stores a symmetric group lattice exactly (zero point 0,
  codes + 8 as unsigned nibbles, the fp16 scales). Always tried when CUDA is present.
* ``triton`` -- our own W4A16 Triton kernel (``tarq_deploy.runtimes.triton_w4a16.TritonInt4Linear``): fp16
  activations as the float model has them, any fp16 scale held exactly (codes times activations on the tensor
  cores, the group scale applied in fp32), split-K for decode shapes. "skipped" with the reason when triton is not
  installed.
* ``marlin`` -- Marlin through vLLM or GPTQModel: not wired yet, the row is "skipped" with the reason (not
  installed, or installed but needing the GPTQ / compressed-tensors export served by that runtime).

The INT4 swap is ``tarq_deploy.runtimes.int4_linear.swap_in_int4_linears(model, checkpoint, kernel=...)``
(``tinygemm``: Int4Linear over torch's int4pack ops; on CUDA it computes in bfloat16 and refuses a lattice whose fp16
scales are not exact in bfloat16 -- that row is then an error naming it; ``triton``: TritonInt4Linear).

Per run: end-to-end latency (feature extraction + generate, perf_counter), generate latency with CUDA events, tokens
decoded (greedy, English, no timestamps, one 30 s window: at most ``max_new_tokens``, see ``greedy_config``), peak VRAM
from ``torch.cuda.max_memory_allocated`` and, when NVML is available (pynvml), the largest per-process device memory
NVML reported while the run was going (it includes the CUDA context and the caching allocator's reserve). Median /
min / max over the timed runs after warm-ups.

Without CUDA the runner says so and measures nothing (status "skipped"); the CLI exits 0 then: never a CPU number
dressed up as a GPU one.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from tarq_deploy.runtimes.base import dist_version
from tarq_deploy.runtimes.child import read_wav_float32
from tarq_deploy.runtimes.whisper_cpp import whisper_backbone

from .cpu import AudioInfo, Stat, check_audio, machine_description

__all__ = ["GpuBenchConfig", "KernelUnavailable", "build_variant", "generated_token_count", "greedy_config",
           "greedy_generate", "kernel_unavailable_reason", "run_gpu_bench"]

KERNELS = ("tinygemm", "triton", "marlin")
MARLIN_PROVIDERS = ("vllm", "gptqmodel")
FP16_KERNEL = "cublas-fp16"  # the float model's own matmuls
INT4_MODULE = "tarq_deploy.runtimes.int4_linear"
INT4_SWAP = "swap_in_int4_linears"
SAMPLE_RATE = 16_000
_MB = 1024 * 1024


@dataclass
class GpuBenchConfig:
    model: str  # transformers / packaged / CTranslate2 source: the FP16 model, the architecture and the processor
    audios: list[str]
    checkpoint: str | None = None  # lattice checkpoint directory for the INT4 rows (none: FP16 only)
    kernels: list[str] = field(default_factory=lambda: list(KERNELS))
    warmup: int = 1
    runs: int = 3
    max_new_tokens: int = 128


@dataclass
class GpuCell:
    backbone: str
    variant: str  # "FP16" | "INT4"
    kernel: str  # "cublas-fp16" | "tinygemm" | "triton" | "marlin"
    audio: str
    audio_label: str
    audio_s: float
    status: str = "pending"  # "ok" | "error" | "skipped"
    error: str | None = None
    load_s: float | None = None
    summary: dict[str, Stat | None] = field(default_factory=dict)
    text: str | None = None
    runs: list[dict] = field(default_factory=list)


@dataclass
class GpuBenchResult:
    kind: str
    status: str  # "ran" | "skipped"
    reason: str | None
    config: dict
    machine: dict
    versions: dict
    cells: list[GpuCell]
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------------- availability
def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device can be used, else why not (in words for the report)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        return f"no CUDA device available (torch {torch.__version__}, CUDA runtime in this build: {built})"
    return None


# Int4Linear runs tinygemm only; Marlin lives inside vLLM / GPTQModel, which load the GPTQ or compressed-tensors
# export and repack it at load time: measuring it means serving that export, a different runner
MARLIN_NOT_WIRED = ("vLLM / GPTQModel is installed, but the Marlin row is not wired yet: Int4Linear runs tinygemm "
                    "only; Marlin is measured by serving the GPTQ / compressed-tensors export in vLLM or GPTQModel")


def marlin_unavailable_reason() -> str | None:
    if any(importlib.util.find_spec(name) is not None for name in MARLIN_PROVIDERS):
        return None
    return f"Marlin needs {' or '.join(MARLIN_PROVIDERS)} installed; neither is"


def kernel_unavailable_reason(kernel: str, device: str = "cuda") -> str | None:
    """None when ``kernel`` can serve the INT4 row on ``device``, else why not (the row is then "skipped")."""
    if kernel == "marlin":
        return marlin_unavailable_reason() or MARLIN_NOT_WIRED
    if kernel == "triton":
        from tarq_deploy.runtimes.triton_w4a16 import triton_unavailable_reason

        return triton_unavailable_reason(device)
    return None


def int4_swap_function() -> Callable[..., Any]:
    """The INT4 module's swap function, or ImportError saying which module/function is missing."""
    module = importlib.import_module(INT4_MODULE)
    swap = getattr(module, INT4_SWAP, None)
    if swap is None:
        raise ImportError(f"{INT4_MODULE} has no {INT4_SWAP}(model, checkpoint, kernel=...)")
    return swap


# ------------------------------------------------------------------------------------------------------ the runner
def run_gpu_bench(config: GpuBenchConfig, log: Callable[[str], None] = print) -> GpuBenchResult:
    audios = [check_audio(a) for a in config.audios]  # bad input is an error whatever the machine
    reason = cuda_unavailable_reason()
    if reason is not None:
        log(f"GPU bench: nothing measured: {reason}")
        return GpuBenchResult("gpu", "skipped", reason, asdict(config), machine_description(), _versions(), [], [])
    import torch

    cells: list[GpuCell] = []
    for variant, kernel in _variants(config):
        started = time.perf_counter()
        try:
            model, processor, generation_config = build_variant(config.model, config.checkpoint, kernel, "cuda",
                                                                torch.float16)
            torch.cuda.synchronize()
        except Exception as e:  # one variant failing (kernel missing, lattice refused) must not end the bench
            cells += [_failed_cell(config.model, variant, kernel, a, e) for a in audios]
            log(f"{variant} {kernel}: {cells[-1].status}: {cells[-1].error}")
            continue
        load_s = time.perf_counter() - started
        for audio in audios:
            cell = GpuCell(_backbone_name(model.config), variant, kernel, audio.path, audio.label, audio.duration_s,
                           load_s=load_s)
            _measure_cell(cell, model, processor, generation_config, config, log)
            cells.append(cell)
        del model
        torch.cuda.empty_cache()
    return GpuBenchResult("gpu", "ran", None, asdict(config), _gpu_machine(), _versions(), cells, _notes(config))


def build_variant(model_source: str, checkpoint_dir: str | None, kernel: str, device: str, dtype: Any) -> tuple:
    """(model, processor, generation_config) on ``device``: the float model for kernel "cublas-fp16", else the
    checkpoint's model with its lattice Linears swapped for Int4Linear. Device-agnostic so that the INT4 swap can be
    checked on a CPU; only run_gpu_bench measures, and only on CUDA."""
    from tarq_deploy.formats.model_loader import load_whisper

    reason = kernel_unavailable_reason(kernel, device) if kernel != FP16_KERNEL else None
    if reason is not None:  # before loading anything: the row is skipped either way
        raise KernelUnavailable(reason)
    model, processor, generation_config = load_whisper(model_source, dtype=dtype)
    model = model.to(device).eval()
    if kernel != FP16_KERNEL:
        _swap_to_int4(model, checkpoint_dir, kernel)
    return model, processor, generation_config


def _variants(config: GpuBenchConfig) -> list[tuple[str, str]]:
    variants = [("FP16", FP16_KERNEL)]
    if config.checkpoint:
        variants += [("INT4", k) for k in config.kernels]
    return variants


def _failed_cell(model: str, variant: str, kernel: str, audio: AudioInfo, error: BaseException) -> GpuCell:
    status = "skipped" if isinstance(error, KernelUnavailable) else "error"
    return GpuCell(model, variant, kernel, audio.path, audio.label, audio.duration_s, status=status,
                   error=f"{type(error).__name__}: {error}")


class KernelUnavailable(RuntimeError):
    """The kernel cannot run in this runner here (provider not installed, or not wired): skipped, not failed."""


def _swap_to_int4(model: Any, checkpoint_dir: str | None, kernel: str) -> None:
    from tarq_deploy.checkpoint import load_checkpoint

    try:
        swap = int4_swap_function()
    except ImportError as e:
        raise RuntimeError(f"INT4 path not available: {e}") from None
    ckpt = load_checkpoint(checkpoint_dir)
    _load_checkpoint_floats(model, ckpt)
    replaced = swap(model, ckpt, kernel=kernel)
    if not replaced:
        raise RuntimeError(f"{INT4_SWAP} replaced no Linear layer: does {checkpoint_dir} belong to this model?")


def _load_checkpoint_floats(model: Any, ckpt: Any) -> None:
    """The checkpoint's own values for every tensor (s * q for lattice weights), so the INT4 model is the checkpoint's
    model whatever float weights --model had; the swap then replaces the lattice Linears."""
    dtype = next(model.parameters()).dtype
    state = {k: v.to(dtype) for k, v in ckpt.dequantized_state_dict().items()}  # 4-bit s * q is exact in fp16
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "proj_out.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _backbone_name(model_config: Any) -> str:
    return whisper_backbone(model_config.encoder_layers, model_config.d_model, model_config.decoder_layers,
                            model_config.vocab_size, model_config.num_mel_bins)


def _measure_cell(cell: GpuCell, model: Any, processor: Any, generation_config: Any, config: GpuBenchConfig,
                  log: Callable[[str], None]) -> None:
    audio = read_wav_float32(cell.audio)
    try:
        for index in range(config.warmup + config.runs):
            run = measure_generate(model, processor, generation_config, audio, config.max_new_tokens)
            run.update(index=index, warmup=index < config.warmup, audio_s=cell.audio_s)
            cell.runs.append(run)
    except Exception as e:  # e.g. a kernel that rejects a shape at run time
        cell.status, cell.error = "error", f"{type(e).__name__}: {e}"
        log(f"{cell.variant} {cell.kernel} {cell.audio_label}: {cell.error}")
        return
    timed = [r for r in cell.runs if not r["warmup"]]
    names = ("generate_ms", "end_to_end_ms", "ms_per_token", "tokens", "peak_vram_mb", "nvml_used_mb")
    cell.summary = {n: Stat.of([float(r[n]) for r in timed if r.get(n) is not None]) for n in names}
    cell.summary["load_s"] = Stat.of([cell.load_s]) if cell.load_s is not None else None
    cell.status, cell.text = "ok", timed[-1]["text"]
    log(f"{cell.variant} {cell.kernel} {cell.audio_label}: {cell.summary['generate_ms'].median:.1f} ms, "
        f"{cell.summary['peak_vram_mb'].median:.0f} MB")


def measure_generate(model: Any, processor: Any, generation_config: Any, audio: Any, max_new_tokens: int) -> dict:
    """One greedy English transcription on the GPU, timed with CUDA events."""
    import torch

    from tarq_deploy.models.whisper import WhisperBackbone

    gc = greedy_config(generation_config, max_new_tokens)
    prompt = WhisperBackbone(model, processor, gc, device="cuda").prompt_ids()  # the project's one greedy prompt
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with _NvmlPeak() as nvml:
        wall = time.perf_counter()
        features = processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        features = features.to("cuda", torch.float16)
        start.record()
        row = greedy_generate(model, features, prompt, gc)
        end.record()
        torch.cuda.synchronize()
        end_to_end_ms = (time.perf_counter() - wall) * 1000
    tokens = generated_token_count(row, prompt)
    if tokens > max_new_tokens:  # never report a per-token figure over a different amount of work
        raise RuntimeError(f"generate produced {tokens} tokens against max_new_tokens={max_new_tokens}")
    generate_ms = start.elapsed_time(end)
    return {"generate_ms": generate_ms, "end_to_end_ms": end_to_end_ms, "tokens": tokens,
            "ms_per_token": generate_ms / tokens if tokens else None,
            "peak_vram_mb": torch.cuda.max_memory_allocated() / _MB, "nvml_used_mb": nvml.peak_mb,
            "text": processor.tokenizer.decode(row, skip_special_tokens=True).strip()}


def greedy_config(generation_config: Any, max_new_tokens: int) -> Any:
    """A copy set for greedy decoding of ONE 30 s window (settings on the config, not as generate() kwargs:
    transformers 5 warns when both are given).

    ``force_unique_generate_call``: Whisper's generate runs a seek loop even for short-form audio. Whenever the
    decoded window holds two consecutive timestamp tokens (ids >= <|notimestamps|> + 1; random or badly quantized
    weights emit them even after <|notimestamps|>), it cuts the window at the last timestamp, seeks there and
    decodes again, up to ``max_new_tokens`` per call, then returns every segment concatenated. That is how the INT4
    large-v3-dims run decoded 662 tokens against a cap of 64 (bench/results/h100). One generate call keeps the cap
    and the work per run the same for every variant."""
    gc = copy.deepcopy(generation_config)
    gc.max_new_tokens, gc.do_sample, gc.num_beams = max_new_tokens, False, 1
    gc.force_unique_generate_call = True
    return gc


def greedy_generate(model: Any, features: Any, prompt: list[int], generation_config: Any) -> list[int]:
    """The token ids of one greedy decode (``generation_config`` from :func:`greedy_config`) of ``features`` [1, mels,
    frames] after ``prompt``, on the model's device; the prompt may or may not lead the row (transformers
    versions differ: see generated_token_count)."""
    import torch

    device = features.device
    with torch.inference_mode():
        ids = model.generate(features, decoder_input_ids=torch.tensor([prompt], device=device),
                             generation_config=generation_config)
    ids = ids["sequences"] if isinstance(ids, dict) else ids
    return ids[0].tolist()


def generated_token_count(ids: list[int], prompt: list[int]) -> int:
    """Tokens the decoder produced: transformers 5 returns them without the prompt, older versions with it."""
    return len(ids) - len(prompt) if ids[:len(prompt)] == prompt else len(ids)


class _NvmlPeak:
    """Largest device memory NVML reports for this process while the block runs (sampled every 5 ms); None when
    pynvml is not installed or NVML has no per-process figure."""

    def __init__(self) -> None:
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "_NvmlPeak":
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(_cuda_index())
        except Exception:  # no pynvml, no driver access: NVML figures stay None
            return self
        self._thread = threading.Thread(target=self._sample, args=(pynvml, handle), daemon=True)
        self._thread.start()
        return self

    def _sample(self, pynvml: Any, handle: Any) -> None:
        pid = os.getpid()
        while not self._stop.is_set():
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    self.peak_mb = max(self.peak_mb or 0.0, proc.usedGpuMemory / _MB)
            self._stop.wait(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _cuda_index() -> int:
    import torch

    return torch.cuda.current_device()


def _gpu_machine() -> dict:
    import torch

    props = torch.cuda.get_device_properties(_cuda_index())
    info = machine_description()
    info.update(gpu=props.name, gpu_memory_mb=props.total_memory / _MB, compute_capability=f"{props.major}."
                f"{props.minor}", cuda_runtime=torch.version.cuda)
    try:
        import pynvml

        pynvml.nvmlInit()
        info["nvidia_driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        pass
    return info


def _versions() -> dict:
    names = ("torch", "transformers", "triton", "vllm", "gptqmodel", "nvidia-ml-py", "tarq-deploy")
    return {name: dist_version(name) for name in names}


def _notes(config: GpuBenchConfig) -> list[str]:
    notes = [f"greedy English decoding without timestamps, at most {config.max_new_tokens} new tokens"]
    if not config.checkpoint:
        notes.append("no --checkpoint: FP16 only, no INT4 rows")
    return notes
