"""Weights memory-mapped from a source's .safetensors file cost memory only while a module uses them (issue 37 item 1):
widening reads them in, narrowing gives the tensor its very stored data back (no copy, whatever values the float32
copy took) and takes the pages out of the resident set again; anonymous memory is never advised. glibc's 4 MB mmap
threshold holds during a calibration and not after it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tarq_deploy.quant.precision import (float32_compute, freed_memory_held, freed_memory_returned, is_memory_mapped,
                                         release_mapped_pages, widened)

MIB = 2**20
ROWS = COLUMNS = 4096  # 32 MiB in bfloat16: far above the page noise of a Python process


def rss_file_bytes() -> int:
    """Pages of mapped files this process has resident (the part of its RSS a mapped model adds)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile line in /proc/self/status")


def mapped_linear(tmp_path: Path) -> tuple[nn.Linear, torch.Tensor]:
    """A Linear whose bfloat16 weight lies in a memory-mapped .safetensors file, as transformers loads one."""
    path = tmp_path / "weight.safetensors"
    save_file({"weight": torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0)).bfloat16()}, path)
    with open(path, "rb") as written:
        os.fsync(written.fileno())  # clean pages: what a model downloaded earlier has
    with safe_open(str(path), framework="pt") as source:
        stored = source.get_tensor("weight")
    linear = nn.Linear(COLUMNS, ROWS, bias=False)
    linear.weight = nn.Parameter(stored, requires_grad=False)
    return linear, stored


def test_a_widened_mapped_weight_gets_its_stored_data_back_and_leaves_the_resident_set(tmp_path):
    linear, stored = mapped_linear(tmp_path)
    expected = stored.clone()  # read once here: an anonymous copy, outside the mapping
    release_mapped_pages([stored])
    assert is_memory_mapped(linear.weight) and not is_memory_mapped(expected)
    before = rss_file_bytes()
    with widened(linear):
        assert linear.weight.dtype == torch.float32
        linear.weight.mul_(2)  # as a calibrated block's Linear takes lattice values
        read_in = rss_file_bytes() - before
    left_resident = rss_file_bytes() - before  # measured before anything below reads the weight again
    assert read_in > 24 * MIB, read_in  # the widening read the 32 MiB in
    assert left_resident < 4 * MIB, left_resident  # and they left again
    assert linear.weight.data_ptr() == stored.data_ptr() and torch.equal(linear.weight, expected)


def test_a_forward_pass_reads_a_mapped_model_one_module_at_a_time(tmp_path):
    linear, stored = mapped_linear(tmp_path)
    release_mapped_pages([stored])
    before = rss_file_bytes()
    x = torch.randn(3, COLUMNS)
    with float32_compute(linear), torch.no_grad():
        y = linear(x)
    left_resident = rss_file_bytes() - before
    assert left_resident < 4 * MIB, left_resident
    assert linear.weight.dtype == torch.bfloat16 and linear.weight.data_ptr() == stored.data_ptr()
    assert torch.equal(y, x @ stored.float().T)  # the float32 copy's arithmetic


def test_anonymous_memory_is_never_released():
    weight = torch.randn(ROWS, COLUMNS).bfloat16()
    copy = weight.clone()
    assert not is_memory_mapped(weight)
    assert release_mapped_pages([weight]) == 0 and torch.equal(weight, copy)


def test_a_mapped_source_is_hashed_without_staying_resident_and_hashes_as_its_float32_copy(tmp_path, monkeypatch):
    from tarq_deploy.calibration import pipeline

    monkeypatch.setattr(pipeline, "HASH_CHUNK_ELEMENTS", 3_000_017)  # slices that end mid-row
    linear, stored = mapped_linear(tmp_path)
    release_mapped_pages([stored])
    before = rss_file_bytes()
    digest = pipeline.state_sha256(linear)
    left_resident = rss_file_bytes() - before
    assert left_resident < 4 * MIB, left_resident
    wide = nn.Linear(COLUMNS, ROWS, bias=False)
    wide.weight = nn.Parameter(stored.float(), requires_grad=False)
    assert digest == pipeline.state_sha256(wide)


# In a process of its own: the thresholds are process-wide, and this test's own must not reach the other tests.
REALLOCATING = """
import ctypes, json, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the machine's THP setting
import torch
from tarq_deploy.cli import main
from tarq_deploy.quant.precision import freed_memory_returned

def faults_of_reallocating(times=40, settled=10, mib=16):
    # page faults of the last `settled` allocations: glibc's heap takes a few to settle (without any threshold too)
    faults = []
    for _ in range(times):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.ones(mib << 18)  # every page written
        del block
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(faults[-settled:])

with freed_memory_returned() as held:
    applied = held()
    inside = faults_of_reallocating()
between = faults_of_reallocating()
assert main(["quantize", "--model", sys.argv[1], "--method", "rtn", "--out", sys.argv[2]]) == 0
after = faults_of_reallocating()
print(json.dumps({"applied": applied, "inside": inside, "between": between, "after": after}))
"""


def test_the_4_mb_mmap_threshold_holds_during_a_calibration_only(models, tmp_path):
    """Inside the block every freed 16 MiB tensor goes back to the system, so the next one faults all its pages in
    again; after it -- and after a whole `quantize` -- the heap settles and reuses them, as in a process that never
    set a threshold (there: the first 8 fault, then none; PyTorch beam search after the threshold ran 1.8 times as long:
    precision.py)."""
    done = subprocess.run([sys.executable, "-c", REALLOCATING, str(models["clean"]), str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    faults = json.loads(done.stdout.strip().splitlines()[-1])
    assert faults["applied"], faults
    pages_each = 16 * MIB // os.sysconf("SC_PAGE_SIZE")
    assert faults["inside"] >= 10 * pages_each * 0.9, faults  # the last 10: each a fresh mapping
    assert faults["between"] <= 2 * pages_each and faults["after"] <= 2 * pages_each, faults  # settled: none seen


def test_the_threshold_waits_for_its_mark_and_blocks_nest(monkeypatch):
    """The threshold costs a calibration 13-31 % of its time (precision.py), so a block sets it only once resident
    memory passes the block's mark, then hands the heap's free pages back; a calibration run inside a caller's own
    block must not end the outer block's threshold, and only the outermost puts glibc's back."""
    from tarq_deploy.quant import precision

    calls = []
    libc = precision._glibc()
    assert libc is not None  # these machines run glibc: the blocks below must take effect

    class Recording:
        def mallopt(self, parameter: int, value: int) -> int:
            calls.append((parameter, value))
            return libc.mallopt(parameter, value)

        def malloc_trim(self, pad: int) -> int:
            calls.append(("trim", pad))
            return libc.malloc_trim(pad)

    monkeypatch.setattr(precision, "_glibc", Recording)
    resident = precision.resident_bytes()
    with freed_memory_returned(from_resident_bytes=2 * resident) as check:
        assert not check() and not freed_memory_held() and calls == []
        monkeypatch.setattr(precision, "resident_bytes", lambda: 2 * resident)  # the mark is reached
        assert check() and freed_memory_held()
        with freed_memory_returned() as inner:
            assert inner() and freed_memory_held()
        assert freed_memory_held()
        assert calls == [(precision._M_MMAP_THRESHOLD, precision.MMAP_THRESHOLD_BYTES), ("trim", 0)]
    assert not freed_memory_held() and not precision.hold_threshold_once_memory_is_scarce()
    assert calls[2:] == [(precision._M_MMAP_THRESHOLD, precision.MMAP_THRESHOLD_AFTER_BYTES),
                         (precision._M_TRIM_THRESHOLD, precision.TRIM_THRESHOLD_AFTER_BYTES)]
    calls.clear()
    with freed_memory_returned(from_resident_bytes=4 * resident) as check:  # never reached: glibc left alone
        assert not check()
    assert calls == []


def test_large_models_take_the_threshold_from_the_start_small_ones_at_half_the_budget():
    """large-v3-turbo's 5.7 GB peak (bench/results/scale) was measured with the threshold from the start; tiny.en and
    base run faster without it until memory is scarce (precision.py)."""
    from tarq_deploy.calibration.options import QuantizeOptions
    from tarq_deploy.calibration.pipeline import THRESHOLD_FROM_THE_START_PARAMETERS, _scarce_from

    options = QuantizeOptions(method="tarq", max_memory=6 << 30)
    large = nn.Linear(25_000, THRESHOLD_FROM_THE_START_PARAMETERS // 25_000, bias=False, device="meta")
    small = nn.Linear(25_000, THRESHOLD_FROM_THE_START_PARAMETERS // 25_000 - 1, device="meta")
    assert _scarce_from(large, options) == 0
    assert _scarce_from(small, options) == 3 << 30
