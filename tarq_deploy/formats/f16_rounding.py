"""Accounting of the values an F16 runtime tensor cannot hold exactly, shared by the ggml-family exporters.

An F16 export of a lattice stores s * q rounded to fp16, and fp16 cannot hold every such product (nor every fp32
weight), so the file is close to its source rather than identical; ``tarq-deploy verify`` reports the differences.
Q4_0 and Q8_0 exports store the lattice exactly and never round.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


class F16Rounding:
    """Counts, per tensor, the values that changed when stored as fp16; ``report`` warns once for the whole file."""

    def __init__(self) -> None:
        self.rounded: dict[str, int] = {}
        self.total = 0

    def count(self, name: str, exact: torch.Tensor, stored: torch.Tensor) -> None:
        # counted by numpy: torch's sum over a bool tensor took ~0.5 ms per conv kernel on two busy cores
        changed = int(np.count_nonzero((stored.float() != exact).numpy()))
        if changed:
            self.rounded[name] = changed
        self.total += stored.numel()

    def report(self, origin: str) -> None:
        if self.rounded:
            names = ", ".join(list(self.rounded)[:3]) + (" ..." if len(self.rounded) > 3 else "")
            log.warning("%s: F16 cannot hold every value exactly: %d of %d values in %d tensors (%s) were rounded "
                        "to the nearest fp16; the file is close to the source, not identical (q4_0 / q8_0 store a "
                        "lattice exactly)", origin, sum(self.rounded.values()), self.total, len(self.rounded), names)
