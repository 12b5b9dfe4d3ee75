"""Weights kept in their stored precision, arithmetic in float32.

A model is held in the dtype its source stores (float16 for the packaged and hub Whisper checkpoints): large-v3 is
3.1 GB so, not 6.2 GB. Calibration still computes in float32 throughout, with exactly the values a float32 copy would
hold (float16 and bfloat16 widen to float32 exactly), so the same source gives the same lattice bytes as before:

* ``float32_compute(model)``: every module with parameters of its own is widened to float32 just before it runs and
  narrowed back just after (forward hooks), so a whole-model pass (the rare-word alignment, a stage's entry) holds
  one module's float32 copy at a time; an embedding widens the rows it looked up instead of its table;
* ``widened(module)``: a module held in float32 for a stretch of work (the block being calibrated: its weights take
  lattice values that its stored dtype may not hold, and must keep them until the streams have left the block).

Both are nestable: a parameter already in float32 is left alone and not narrowed afterwards. Narrowing gives a
tensor back the very data it held (no copy), and the pages of that data, when the loader memory-mapped them from the
source's .safetensors file (transformers does), leave the resident set again (``release_mapped_pages``): a model is
then resident one module at a time, not whole and twice over (a bfloat16 Voxtral-Mini-3B is 9.4 GB). So after
calibration a narrow model holds its source's values; a float32 model, never widened, holds the lattice's.

The one exception, an opt-in (``--compute-dtype bfloat16``): the calibration's forward passes under bfloat16
autocast (``compute_in``), 4x float32's matmul rate where the processor multiplies bfloat16 natively (AVX512-BF16 or
AMX; a 2-core EPYC of family 26). The second moments and the solver stay float32/float64 (``full_precision``): CPU
torch has no bfloat16 x bfloat16 -> float32 product, and products rounded to bfloat16 left a Hessian indefinite. On
the dev split the forward passes in bfloat16 raised common-word KLD by 4-7 %, beyond the intervals, in two of four
cells (and lowered rare-word KLD in a third; bench/results/precision), so float32 stays the default.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..machine import cpu_isa, resident_bytes

__all__ = ["NARROW_DTYPES", "compute_in", "float32_compute", "freed_memory_held", "freed_memory_returned",
           "full_precision", "hold_threshold_once_memory_is_scarce", "is_memory_mapped", "release_mapped_pages",
           "resolve_compute_dtype", "widened"]

NARROW_DTYPES = (torch.float16, torch.bfloat16)
TORCH_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --compute-dtype, less auto
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CPU with AVX512-BF16 or AMX-BF16. Elsewhere (AVX2, plain
    AVX-512) oneDNN emulates it, slower than float32; a GPU is not claimed (never measured here)."""
    return torch.device(device).type == "cpu" and any(flag in cpu_isa() for flag in NATIVE_BF16_FLAGS)


def resolve_compute_dtype(choice: str, device: str = "cpu") -> str:
    """--compute-dtype: auto is bfloat16 where the device multiplies it natively, else float32."""
    if choice == "auto":
        return "bfloat16" if native_bfloat16(device) else "float32"
    if choice not in TORCH_COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be auto or one of {tuple(TORCH_COMPUTE_DTYPES)}, got {choice!r}")
    return choice


@contextlib.contextmanager
def compute_in(dtype: str, device: str | torch.device = "cpu") -> Iterator[None]:
    """Forward passes in ``dtype``: bfloat16 autocast (matmuls, convolutions and attention in bfloat16 with float32
    accumulation; normalisations and softmax in float32), or nothing for float32."""
    if TORCH_COMPUTE_DTYPES[dtype] == torch.float32:
        yield
        return
    with torch.autocast(torch.device(device).type, dtype=TORCH_COMPUTE_DTYPES[dtype]):
        yield


def full_precision(device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """Autocast off: the solver and the statistics' sums choose their own dtypes."""
    return torch.autocast(torch.device(device).type, enabled=False)


def _widen(params: Iterator[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Widen each narrow tensor to float32 in place (its object kept, so tied parameters follow); each widened tensor
    with the data it held (its stored values: memory-mapped from the source file where the loader mapped it)."""
    widened = []
    for tensor in params:
        if tensor.dtype in NARROW_DTYPES:
            widened.append((tensor, tensor.data))
            tensor.data = tensor.data.to(torch.float32)
    return widened


def _narrow(widened: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each tensor its stored data back (no copy), whatever its float32 copy took meanwhile, and let the pages
    of stored data mapped from the source file leave the resident set until they are read again."""
    for tensor, stored in widened:
        tensor.data = stored
    release_mapped_pages(stored for _, stored in widened)


_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now; clean file-backed pages are simply dropped
_PAGE = 4096
# Both caches may go stale (a file unmapped, its addresses reused): harmless, since MADV_PAGEOUT never loses data
# (an anonymous page is swapped out or left alone) and a missed release only leaves pages resident.
_mapped_files: list[tuple[int, int]] = []  # address ranges of memory-mapped .safetensors files (refreshed on a miss)
_not_mapped: set[tuple[int, int]] = set()  # (address, bytes) of tensors found in anonymous memory


def _safetensors_mappings() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                low, high = fields[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return ranges


def _in_mapped_file(address: int, size: int) -> bool:
    global _mapped_files
    if (address, size) in _not_mapped:
        return False
    for refresh in (False, True):
        if refresh:
            _mapped_files = _safetensors_mappings()
        if any(low <= address and address + size <= high for low, high in _mapped_files):
            return True
    _not_mapped.add((address, size))
    return False


def is_memory_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data lies in a memory-mapped .safetensors file (a source's weights, never written)."""
    size = tensor.numel() * tensor.element_size()
    return tensor.device.type == "cpu" and size > 0 and _in_mapped_file(tensor.data_ptr(), size)


def release_mapped_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Take the pages of tensors memory-mapped from a .safetensors file out of this process's resident set (they are
    clean copies of the file: the next read faults them back from the page cache or the disk); bytes released.

    A source loaded with memory-mapped weights (transformers does so for safetensors) costs no memory until a weight
    is read, but every page read stays resident: calibrating a model block by block would end holding the whole
    model twice over. Released after each use, the weights cost one module at a time. Only ranges inside a mapped
    .safetensors file are touched (anonymous memory is never advised), and MADV_PAGEOUT never discards data."""
    if not sys.platform.startswith("linux"):
        return 0
    released = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size < _PAGE or not is_memory_mapped(tensor):
            continue
        start = -(-tensor.data_ptr() // _PAGE) * _PAGE  # whole pages inside the tensor only
        end = (tensor.data_ptr() + size) // _PAGE * _PAGE
        if end > start and _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT) == 0:
            released += end - start
    return released


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _tensors(module: nn.Module, recurse: bool) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
        if id(tensor) not in seen and tensor.is_floating_point():
            seen.add(id(tensor))
            yield tensor


@contextlib.contextmanager
def widened(module: nn.Module) -> Iterator[nn.Module]:
    """``module``'s narrow parameters and buffers in float32 for the duration; afterwards they hold their stored
    data again (the source's values: what a calibrated block's Linears took meanwhile lives in the lattice, and
    nothing reads the block's weights after its streams have left it)."""
    done = _widen(_tensors(module, recurse=True))
    try:
        yield module
    finally:
        _narrow(done)


@contextlib.contextmanager
def float32_compute(model: nn.Module) -> Iterator[nn.Module]:
    """Each module of ``model`` that owns parameters runs with them widened to float32 (one module at a time)."""
    if not any(t.dtype in NARROW_DTYPES for t in _tensors(model, recurse=True)):
        yield model  # a float32 model: nothing to do
        return
    handles, pending = [], {}

    def before(module: nn.Module, _args: tuple) -> None:
        pending.setdefault(id(module), []).append(_widen(_tensors(module, recurse=False)))

    def after(module: nn.Module, _args: tuple, _output: object) -> None:
        _narrow(pending[id(module)].pop())

    def widened_rows(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return output.to(torch.float32) if output.dtype in NARROW_DTYPES else None

    for module in model.modules():
        if isinstance(module, nn.Embedding):
            # A lookup reads a few rows: those are widened, not the table (Whisper's 51,865 x 512 token table was
            # widened and narrowed again for every window of every pass). The same values either way.
            handles.append(module.register_forward_hook(widened_rows))
        elif any(True for _ in _tensors(module, recurse=False)):
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after, always_call=True))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


MMAP_THRESHOLD_BYTES = 4 << 20
# Where glibc's dynamic thresholds settle in a process that frees large blocks (malloc.c: DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit, and the trim threshold it keeps at twice the mmap threshold). glibc has no way back to its dynamic mode
# once a threshold is set, so a calibration leaves these behind it.
MMAP_THRESHOLD_AFTER_BYTES = 32 << 20
TRIM_THRESHOLD_AFTER_BYTES = 2 * MMAP_THRESHOLD_AFTER_BYTES
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@dataclass
class _ThresholdState:
    """The process-wide state of freed_memory_returned: glibc's thresholds are per process, so this is too."""

    depth: int = 0  # how many blocks are open
    applied: bool = False  # whether glibc holds the threshold now
    from_resident_bytes: int = 0  # the outermost block's mark: resident memory past which the threshold is set


_THRESHOLD = _ThresholdState()


@contextlib.contextmanager
def freed_memory_returned(from_resident_bytes: int = 0) -> Iterator[Callable[[], bool]]:
    """Within the block, have glibc give large freed blocks back to the system once the process's resident memory has
    passed ``from_resident_bytes`` (0: from the start; Linux with glibc only). Yields ``check``: call it where the
    work is between steps (the calibration does after each block); it sets the threshold once the mark is passed and
    says whether the threshold is held.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MB), after which blocks of that
    size come from the heap, where a freed one stays resident as long as anything above it lives. Calibration makes
    and drops many such tensors (a window's activations: 7.7 MB each in large-v3, its MLP inputs 31 MB): on
    large-v3-turbo the freed ones held 2-3 GB of resident memory. A fixed threshold of 4 MB maps every larger block on
    its own and unmaps it when freed; the values computed are the same.

    It costs time: every such block is then a fresh mapping whose pages fault in one by one. A calibration of tiny.en
    (TARQ Q5_1, 3 clips, one thread) took 28.7 s under it against 19.8 s without, for 1.19 against 1.29 GB; base
    (TARQ IQ2_S, 128 utterances, two threads) 111 s against 97 s, for 6.7 against 7.3 GB (2-core AMD EPYC, family
    25). So the calibration sets it only once memory is getting scarce (pipeline.py: half the memory budget), and
    hands the heap's free pages back then (malloc_trim). PyTorch beam search of base on four clips after the threshold
    took 70-71 s against 39-42 s (sys 31 s against 1-3 s): so only within the block, after which glibc's thresholds
    are set where its dynamic ones settle (39-40 s then, like a process that never set one).

    Blocks nest: only the outermost sets the mark and puts glibc's settled thresholds back, so a caller that runs a
    calibration inside a block of its own keeps the threshold after the calibration's block ends. (The lookup pass
    runs its two calibrations inside one block.)"""
    if _THRESHOLD.depth == 0:
        _THRESHOLD.from_resident_bytes = from_resident_bytes
    _THRESHOLD.depth += 1
    try:
        hold_threshold_once_memory_is_scarce()
        yield hold_threshold_once_memory_is_scarce
    finally:
        _THRESHOLD.depth -= 1
        if _THRESHOLD.depth == 0 and _THRESHOLD.applied:
            libc = _glibc()
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER_BYTES)
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_AFTER_BYTES)
            _THRESHOLD.applied = False


def hold_threshold_once_memory_is_scarce() -> bool:
    """Inside a freed_memory_returned block: set glibc's 4 MB mmap threshold if resident memory has passed the
    block's mark (and give the heap's free pages back, which the dynamic threshold kept resident until now); whether
    the threshold is held. Outside any block: nothing, False."""
    state = _THRESHOLD
    if state.depth == 0 or state.applied or (resident_bytes() or 0) < state.from_resident_bytes:
        return state.applied
    libc = _glibc()
    state.applied = libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if state.applied and state.from_resident_bytes:
        libc.malloc_trim(0)
    return state.applied


def freed_memory_held() -> bool:
    """Whether this process is inside a freed_memory_returned block whose threshold glibc holds."""
    return _THRESHOLD.applied


@functools.cache  # a C library that fails to load is not looked for again at every block
def _glibc() -> ctypes.CDLL | None:
    """The C library (_libc's, the one madvise goes through), where it is glibc on Linux (mallopt with glibc's
    parameter numbers); else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = _libc()
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None
