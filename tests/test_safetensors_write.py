"""The streamed safetensors writer (a tensor, and 64 MB, at a time) writes the library's own file byte for byte, for
any names, dtypes and shapes, torch or numpy, and our zero-copy reader reads back what was written."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file as save_numpy_file
from safetensors.torch import save_file

from tarq_deploy import safetensors_view
from tarq_deploy.safetensors_view import map_private, torch_views, write_safetensors

TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
                torch.int32, torch.int64, torch.bool]
NUMPY_DTYPES = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64]
NAMES = st.text(alphabet="abcxyz._0129", min_size=1, max_size=12)
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3)


def torch_tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    return values > 0 if dtype == torch.bool else values.to(dtype)


@st.composite
def torch_dicts(draw) -> dict[str, torch.Tensor]:
    names = draw(st.lists(NAMES, min_size=0, max_size=6, unique=True))
    return {name: torch_tensor(draw(st.sampled_from(TORCH_DTYPES)), draw(SHAPES), i) for i, name in enumerate(names)}


@st.composite
def numpy_dicts(draw) -> dict[str, np.ndarray]:
    names = draw(st.lists(NAMES, min_size=0, max_size=6, unique=True))
    rng = np.random.default_rng(0)
    return {name: np.asarray(rng.standard_normal(draw(SHAPES)) * 50).astype(draw(st.sampled_from(NUMPY_DTYPES)))
            for name in names}


@given(tensors=torch_dicts(), chunk=st.sampled_from([1, 7, 64 << 20]))
def test_streamed_torch_tensors_are_the_librarys_file(tmp_path_factory, tensors, chunk):
    folder = tmp_path_factory.mktemp("st")
    save_file(tensors, str(folder / "library.safetensors"), metadata={"format": "tarq-lattice"})
    seen = []
    original, safetensors_view._WRITE_CHUNK_BYTES = safetensors_view._WRITE_CHUNK_BYTES, chunk
    try:
        write_safetensors(folder / "ours.safetensors", tensors, {"format": "tarq-lattice"}, written=seen.append)
    finally:
        safetensors_view._WRITE_CHUNK_BYTES = original
    assert (folder / "ours.safetensors").read_bytes() == (folder / "library.safetensors").read_bytes()
    assert len(seen) == len(tensors)  # told once per tensor
    views = torch_views(map_private(folder / "ours.safetensors"))
    assert views.keys() == tensors.keys()
    assert all(torch.equal(views[name], tensor) for name, tensor in tensors.items())


@given(arrays=numpy_dicts())
def test_streamed_numpy_arrays_are_the_librarys_file(tmp_path_factory, arrays):
    folder = tmp_path_factory.mktemp("np")
    save_numpy_file(arrays, str(folder / "library.safetensors"), metadata={"format": "tarq-lattice"})
    write_safetensors(folder / "ours.safetensors", arrays, {"format": "tarq-lattice"})
    assert (folder / "ours.safetensors").read_bytes() == (folder / "library.safetensors").read_bytes()
