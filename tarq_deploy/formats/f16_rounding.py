"""The F16 tensors of an export: each one a recipe (F16Values) made when the file is written, on worker threads a
bounded window ahead of the writer (MadeAhead), and the values fp16 could not hold accounted for (F16Rounding),
shared by the ggml-family exporters.

An F16 export of a lattice stores s * q rounded to fp16, and fp16 cannot hold every such product (nor every fp32
weight), so the file is close to its source rather than identical; ``tarq-deploy verify`` reports the differences.
The lattice types' exports store the lattice exactly and never round.

Why a window and not every tensor made at once: the values of a whole F16 file held in memory before it is written
cost as much memory as the file (3 GB for large-v3), and on a virtual machine the first touch of that much fresh
memory cost a quarter of the export's time (tiny.en: 7 of 40 ms). Made a few tensors ahead into buffers the writer
hands back, the values reuse the same few megabytes, and each tensor is made while the ones before it are written.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .f16_values import threads

__all__ = ["F16Rounding", "F16Values", "MadeAhead"]

log = logging.getLogger(__name__)

WINDOW_BYTES = 16 << 20  # fp16 values made ahead of the writer, at most (one tensor always, however large)


@dataclass(frozen=True, eq=False)
class F16Values:
    """An F16 tensor's values, made when a writer needs them: ``make(out)`` fills ``out`` (fp16, ``shape`` values)
    and returns (the values, how many of them fp16 changed). ``name``: the tensor in the file, for the warning."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[np.ndarray], tuple[np.ndarray, int]]

    @property
    def nbytes(self) -> int:
        return 2 * math.prod(self.shape)


class F16Rounding:
    """Per tensor, the values that changed when stored as fp16; ``report`` warns once for the whole file."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.rounded: dict[str, int] = {}
        self.total = 0
        self._lock = threading.Lock()  # tensors are made on several threads

    def expect(self, name: str) -> None:
        """Tensor ``name`` will be made: its place in the warning's list is the order of asking, not of finishing."""
        self.rounded.setdefault(name, 0)

    def add(self, name: str, changed: int, total: int) -> None:
        """``changed`` of the ``total`` values of tensor ``name`` were rounded when stored as fp16."""
        with self._lock:
            self.rounded[name] = self.rounded.get(name, 0) + changed
            self.total += total

    def made(self, tensor: F16Values, out: np.ndarray | None = None) -> np.ndarray:
        """``tensor``'s values, made now into ``out`` (fp16, as many values) or a new array, and accounted for."""
        self.expect(tensor.name)
        values, changed = tensor.make(np.empty(tensor.shape, np.float16) if out is None else out)
        self.add(tensor.name, changed, values.size)
        return values

    def report(self) -> None:
        """Once every tensor is made: the warning, if any value was rounded."""
        rounded = [name for name, changed in self.rounded.items() if changed]
        if rounded:
            names = ", ".join(rounded[:3]) + (" ..." if len(rounded) > 3 else "")
            log.warning("%s: F16 cannot hold every value exactly: %d of %d values in %d tensors (%s) were rounded "
                        "to the nearest fp16; the file is close to the source, not identical (the lattice types "
                        "store a lattice exactly)", self.origin, sum(self.rounded.values()), self.total,
                        len(rounded), names)


class MadeAhead:
    """Makes ``tensors`` in their order on the F16 threads while a writer writes what comes before them, at most
    ``window_bytes`` ahead of it, into buffers it gives back. The writer asks ``ready`` / ``values`` in that order
    and calls ``written`` once a tensor's bytes are in the file: then its buffer goes to a later tensor of the same
    size (a model's layers repeat their shapes), so the same memory is used again rather than fresh memory touched.

    Only the writer's thread calls these methods; the F16 threads only run ``make`` and the accounting."""

    def __init__(self, tensors: list[F16Values], rounding: F16Rounding, window_bytes: int = WINDOW_BYTES) -> None:
        self.tensors = tensors
        self.rounding = rounding
        self.window_bytes = window_bytes
        self._futures: dict[int, Future] = {}  # by id(): a recipe is not hashable by value
        self._buffers: dict[int, np.ndarray] = {}
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)  # nbytes -> buffers given back
        self._next = 0  # the first tensor not submitted yet
        self._ahead = 0  # bytes submitted and not written yet
        for tensor in tensors:
            rounding.expect(tensor.name)
        self._fill()

    def ready(self, tensor: F16Values) -> bool:
        future = self._futures.get(id(tensor))
        return future is not None and future.done()

    def values(self, tensor: F16Values) -> np.ndarray:
        """``tensor``'s values (waiting for them; submitting it now if the window had not reached it)."""
        while id(tensor) not in self._futures:
            if self._next >= len(self.tensors):
                raise ValueError(f"{tensor.name}: not one of the tensors being made")
            self._submit()
        return self._futures[id(tensor)].result()

    def written(self, tensor: F16Values) -> None:
        """``tensor``'s bytes are in the file: its buffer may be reused, and the window moves on."""
        self._futures.pop(id(tensor)).result()
        buffer = self._buffers.pop(id(tensor))
        self._free[buffer.nbytes].append(buffer)
        self._ahead -= buffer.nbytes
        self._fill()

    def _fill(self) -> None:
        while self._next < len(self.tensors) and (not self._futures or self._ahead < self.window_bytes):
            self._submit()

    def _submit(self) -> None:
        tensor = self.tensors[self._next]
        self._next += 1
        free = self._free[tensor.nbytes]
        buffer = free.pop() if free else np.empty(tensor.nbytes, dtype=np.uint8)
        self._buffers[id(tensor)] = buffer
        self._ahead += buffer.nbytes
        out = buffer.view(np.float16).reshape(tensor.shape)
        self._futures[id(tensor)] = threads("f16-tensors").submit(self.rounding.made, tensor, out)  # kernels release the GIL
