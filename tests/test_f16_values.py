"""fp16 tensors of F16 exports (formats/f16_values.py, f16_kernels.py): the compiled decoders give exactly what
ggml_types.unpack(...).dequantize() rounded by torch gives, for every ggml lattice type; float32 rounding is torch's
bit for bit over the whole float32 range (NaN and infinities, subnormals, overflow); the counts of changed values
are exact; large tensors cut into parts on threads give the same bytes; and the F16 tensors, made on threads a
bounded window ahead of the writer into buffers it gives back (MadeAhead), are each their own values and are named in
the rounding warning in the order they were asked for."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from tarq_deploy.formats import f16_values
from tarq_deploy.formats.f16_rounding import F16Rounding, F16Values, MadeAhead
from tarq_deploy.formats.f16_values import blocks_to_f16, float_to_f16
from tarq_deploy.quant.ggml_types import FP16_FIELDS, LATTICE_TYPES, unpack

SCALE_MAGNITUDES = [1e-7, 1e-5, 1e-3, 1.0, 300.0, 6e4]  # fp16 subnormal scales to the top of its range


def random_blocks(ggml_type: T, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random codes and finite fp16 scales of every magnitude: uint8 [rows, row bytes]."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, blocks_per_row, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[ggml_type]:
        scale = rng.standard_normal((rows, blocks_per_row)) * rng.choice(SCALE_MAGNITUDES, (rows, blocks_per_row))
        raw[:, :, offset:offset + 2] = np.clip(scale, -65504, 65504).astype(np.float16).view(np.uint8).reshape(
            rows, blocks_per_row, 2)
    return raw.reshape(rows, -1)


def changed_by_fp16(values: torch.Tensor) -> int:
    return int(((values.half().float() != values) & ~values.isnan()).sum())


@pytest.fixture
def small_parts(monkeypatch):
    """Cut tensors into parts from 4096 values on, so that small tensors take the threaded path too."""
    monkeypatch.setattr(f16_values, "MIN_PART_VALUES", 1 << 12)


@pytest.mark.parametrize("ggml_type", LATTICE_TYPES, ids=lambda t: t.name)
def test_decoded_blocks_are_the_dequantized_lattice_rounded_by_torch(ggml_type, small_parts):
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    blocks = random_blocks(ggml_type, rows=37, blocks_per_row=3 * 1024 // block_size, seed=int(ggml_type))
    exact = unpack(blocks, ggml_type).dequantize()
    values, changed = blocks_to_f16(blocks, ggml_type)
    assert values.dtype == np.float16 and values.shape == tuple(exact.shape)
    assert np.array_equal(values.view(np.uint16), exact.half().numpy().view(np.uint16))
    assert changed == changed_by_fp16(exact) > 0


def test_float32_rounds_as_torch_does_over_the_whole_range(small_parts):
    """Every 4099th float32 bit pattern (a million values, every exponent, NaN payloads and signs) and the edges."""
    bits = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25,
                      2.0**-14 - 2.0**-25, np.inf, -np.inf, np.nan], dtype=np.float32)
    values = torch.from_numpy(np.concatenate([bits.view(np.float32), edges]))
    converted, changed = float_to_f16(values)
    assert np.array_equal(converted.view(np.uint16), values.half().numpy().view(np.uint16))
    assert changed == changed_by_fp16(values)


def test_parts_on_threads_give_the_bytes_of_one_pass(monkeypatch):
    blocks = random_blocks(T.Q4_K, rows=64, blocks_per_row=8, seed=1)
    whole, changed = blocks_to_f16(blocks, T.Q4_K)
    monkeypatch.setattr(f16_values, "MIN_PART_VALUES", 1 << 10)
    parts, changed_in_parts = blocks_to_f16(blocks, T.Q4_K)
    assert np.array_equal(whole.view(np.uint16), parts.view(np.uint16)) and changed == changed_in_parts


def test_output_array_is_filled_in_place_and_checked():
    values = torch.linspace(-3, 3, 1000).reshape(10, 100)
    out = np.zeros(1000, dtype=np.float16)
    converted, _ = float_to_f16(values, out)
    assert converted.shape == (10, 100) and np.shares_memory(converted, out)
    assert np.array_equal(out, values.half().numpy().reshape(-1))
    with pytest.raises(ValueError, match="output for 1000 fp16 values is float16"):
        float_to_f16(values, np.zeros(999, dtype=np.float16))


def _made_of(value: float, count: int, before: Callable[[], None] = lambda: None) -> F16Values:
    def make(out):
        before()
        return float_to_f16(torch.full((count,), value), out)

    return F16Values(f"t{value}-{count}", (count,), make)


def test_made_ahead_gives_every_tensor_and_reuses_buffers_once_written():
    """Three tensors of one size and a 2-tensor window: the third is made into the first one's buffer once the
    writer has written the first, and each tensor's values are its own."""
    tensors = [_made_of(v, 1000) for v in (0.5, 1.5, 2.5)] + [_made_of(3.5, 10)]
    ahead = MadeAhead(tensors, F16Rounding("ckpt"), window_bytes=2 * 2000)
    first = ahead.values(tensors[0])
    assert ahead.values(tensors[1]).tolist() == [1.5] * 1000
    assert len(ahead._futures) == 2  # the window: the third is not made before the first is written
    first_list = first.tolist()
    ahead.written(tensors[0])
    third = ahead.values(tensors[2])
    assert first_list == [0.5] * 1000 and third.tolist() == [2.5] * 1000
    assert np.shares_memory(first, third)  # the first one's buffer, reused
    ahead.written(tensors[1])
    ahead.written(tensors[2])
    assert ahead.values(tensors[3]).tolist() == [3.5] * 10


def test_made_ahead_makes_a_tensor_the_writer_asks_for_beyond_the_window():
    tensors = [_made_of(v, 1000) for v in (0.5, 1.5, 2.5)]
    ahead = MadeAhead(tensors, F16Rounding("ckpt"), window_bytes=1)
    assert ahead.values(tensors[2]).tolist() == [2.5] * 1000  # submitted on demand, with those before it
    with pytest.raises(ValueError, match="not one of the tensors"):
        ahead.values(_made_of(9.0, 1))


def test_warning_names_tensors_in_the_order_they_were_asked_for(caplog):
    """The tensors are made on several threads; the first one finishes last here."""
    rounding = F16Rounding("ckpt")
    first_may_finish = threading.Event()
    slow = _made_of(0.1, 4, before=lambda: first_may_finish.wait(timeout=10))
    fast = _made_of(0.3, 2)
    ahead = MadeAhead([slow, fast], rounding)
    assert ahead.values(fast).tolist() == [np.float16(0.3)] * 2
    first_may_finish.set()
    assert ahead.values(slow).tolist() == [np.float16(0.1)] * 4
    with caplog.at_level(logging.WARNING):
        rounding.report()
    assert "6 of 6 values in 2 tensors (t0.1-4, t0.3-2)" in caplog.text


def test_a_forked_process_makes_f16_values_with_threads_of_its_own():
    """The worker threads are per process: a child forked after the parent made F16 values does not hand its work
    to the parent's threads (which it does not have) and wait forever."""
    import multiprocessing

    float_to_f16(torch.ones(4))  # the parent's threads exist now
    blocks = random_blocks(T.Q4_0, rows=64, blocks_per_row=1 << 10, seed=3)  # 2 M values: cut into parts
    expected = blocks_to_f16(blocks, T.Q4_0)[0]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        made = pool.apply_async(blocks_to_f16, (blocks, T.Q4_0)).get(timeout=60)[0]
    assert np.array_equal(made.view(np.uint16), expected.view(np.uint16))
