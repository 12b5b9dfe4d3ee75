"""The F16 tensors of an export: made on a thread of their own while the file is being written, and the values
fp16 could not hold accounted for, shared by the ggml-family exporters.

An F16 export of a lattice stores s * q rounded to fp16, and fp16 cannot hold every such product (nor every fp32
weight), so the file is close to its source rather than identical; ``tarq-deploy verify`` reports the differences.
The lattice types' exports store the lattice exactly and never round.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

import numpy as np

from .f16_values import Slabs

log = logging.getLogger(__name__)


@functools.cache
def _f16_threads() -> ThreadPoolExecutor:
    """One thread per core: tensors are made side by side (their kernels release the GIL), taken in the order they
    were asked for, which is the order a writer needs them in."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="f16-tensors")


class F16Rounding:
    """The fp16 tensors of one export, and per tensor the values that changed when stored as fp16; ``report`` warns
    once for the whole file."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.rounded: dict[str, int] = {}
        self.total = 0
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._slabs = Slabs()

    def add(self, name: str, changed: int, total: int) -> None:
        """``changed`` of the ``total`` values of tensor ``name`` were rounded when stored as fp16."""
        with self._lock:
            self.rounded[name] = self.rounded.get(name, 0) + changed
            self.total += total

    def later(self, name: str, shape: tuple[int, ...],
              make: Callable[[np.ndarray], tuple[np.ndarray, int]]) -> Future:
        """Tensor ``name``'s fp16 values, made by ``make(out)`` -> (values, how many changed) into an array ``out``
        of ``shape`` on the F16 threads; the Future gives the values. A writer writes the tensors before it
        meanwhile."""
        self.rounded.setdefault(name, 0)  # its place in the warning's list: the order of asking, not of finishing
        out = self._slabs.take(math.prod(shape), np.float16)  # taken here, in order: the slab is not shared

        def job() -> np.ndarray:
            values, changed = make(out)
            self.add(name, changed, values.size)
            return values

        future = _f16_threads().submit(job)
        self._pending.append(future)
        return future

    def report(self) -> None:
        """Once every tensor is made: the warning, if any value was rounded."""
        wait(self._pending)
        rounded = [name for name, changed in self.rounded.items() if changed]
        if rounded:
            names = ", ".join(rounded[:3]) + (" ..." if len(rounded) > 3 else "")
            log.warning("%s: F16 cannot hold every value exactly: %d of %d values in %d tensors (%s) were rounded "
                        "to the nearest fp16; the file is close to the source, not identical (the lattice types "
                        "store a lattice exactly)", self.origin, sum(self.rounded.values()), self.total,
                        len(rounded), names)
