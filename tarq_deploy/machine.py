"""What "same bytes" is promised for: the processor, torch's kernels, the thread count and the versions of a result.

The same inputs, seed, processor kind and thread count give the same bytes. Another processor may not: torch, oneDNN
and MKL pick other kernels on AVX-512 than on AVX2, float sums round in another order, and a near-tie code (two
lattice points almost equally good) can come out the other way. Every checkpoint manifest, eval report and sweep step
carries this record, so two results can be told apart by where they were made before anyone compares their bytes.

Only fields that stay put on one machine are recorded (no load, no free memory): the record is part of the output
bytes, and the same machine must write the same record."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["cpu_field", "cpu_isa", "cpu_model", "machine_record", "peak_rss_mb", "physical_memory_bytes",
           "resident_bytes"]

# Environment knobs that change which kernels torch, oneDNN and MKL run (and so the rounding of float sums).
KERNEL_KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
                "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG")
# Instruction sets that decide which kernels run; a VM's model name ("Intel(R) Xeon(R) Processor") may hide the rest.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16")
VERSIONED = ("torch", "transformers", "numpy", "gguf", "pywhispercpp", "crispasr")


def machine_record() -> dict[str, Any]:
    """The processor, torch's CPU capability and thread count, the kernel knobs set, and the versions in use."""
    record: dict[str, Any] = {"cpu_model": cpu_model(), "cpu_vendor": cpu_vendor(), "cpu_family": cpu_field("cpu family"),
                              "cpu_model_number": cpu_field("model"), "cpu_isa": cpu_isa(),
                              "machine": platform.machine(), "logical_cores": os.cpu_count()}
    record.update(_torch_state())
    record["knobs"] = {k: os.environ[k] for k in KERNEL_KNOBS if k in os.environ}
    record["versions"] = package_versions()
    return record


def cpu_model() -> str:
    model = cpu_field("model name")
    return model if model != "unknown" else platform.processor() or model


def cpu_vendor() -> str:
    return cpu_field("vendor_id")


@lru_cache(maxsize=None)
def cpu_field(key: str) -> str:
    """The first /proc/cpuinfo line ``key : value`` (exact key), or "unknown"."""
    for line in _cpuinfo_lines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return "unknown"


def cpu_isa() -> list[str]:
    flags = set(cpu_field("flags").split())
    return [f for f in ISA_FLAGS if f in flags]


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _torch_state() -> dict[str, Any]:
    """Read only when torch is already loaded: a record asked for by a torch-free command must not cost its import."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    state: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    try:
        state["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        state["torch_cpu_capability"] = "unknown"
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_device_name()
    return state


@lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Installed versions from package metadata (whisper.cpp's and ggml's code ship inside pywhispercpp, GGUF's
    constants inside gguf; their versions pin them)."""
    versions: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def peak_rss_mb() -> float | None:
    """This process's resident-memory high-water mark (VmHWM) in MiB; None where /proc does not tell. A progress
    figure for logs, never part of the output bytes."""
    kib = _status_kib("VmHWM")
    return kib / 1024 if kib is not None else None


def resident_bytes() -> int | None:
    """This process's resident memory now (VmRSS) in bytes; None where /proc does not tell."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def physical_memory_bytes() -> int | None:
    """The machine's memory in bytes; None where the system does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
