"""Where a backbone keeps the full-precision stream it computed ahead of the driver: in memory, or spilled to disk.

Whisper's alignment pass runs the whole fp encoder and decoder once per window; those are the values the driver's
fp stream would compute block by block. Kept (``Window.fp_stream``), they save the driver a second fp pass: about
a third of TARQ's time where it is recomputed (bench/results/scale). In memory they cost per window what
``fp_stream_bytes`` says (small at 128 utterances: 11.5 GB, past the 8 GB budget). Past the budget they go to
disk instead: one safetensors file per (block, window), read back when the driver reaches the block, so the
process holds one block's stream at a time, as it does when it recomputes. The values are the same float32
tensors either way: kept, spilled or recomputed, a calibration writes the same bytes.

The disk is kept off the critical path. Measured on this project's 2-core machine (small, 128 utterances, 12 GB
spilled; its disk writes 366 MB/s and keeps no page cache), writing and reading in the calibrating thread saved only
13 of 275 s: the writes held the alignment pass back to the disk's pace. So a file is serialised in the calling thread
and written by one background thread (a few files in flight at most), and the driver asks for the next block's
files while it calibrates the current one (``prefetch``, where the budget holds two blocks' streams): file I/O
releases the GIL, the arithmetic goes on.

The spill lives in the calibration's work directory (``OUT.partial/fp-stream``); it is cleared before a pass
writes it (an interrupted run's files are not read) and removed when the calibration ends, whatever ends it.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from ..errors import UserError

OUTPUT_KEY = "<block output>"  # no Linear is named so
DISK_RESERVE_BYTES = 1 << 30  # left free on the spill's file system beyond what the spill takes
WRITES_IN_FLIGHT = 4  # serialised files waiting for the writer thread (each one block on one window: 10-100 MB)


class FpSpillError(UserError):
    """A spilled file does not read back as what was written (its disk, or someone, changed it during the run); the
    message names it."""


class KeptLayer(Protocol):
    """One block's fp stream on one window, kept for the driver."""

    def take(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the block's Linear inputs x_fp by relative name, the block's output); called once."""
        ...

    def prefetch(self) -> None:
        """Start getting it ready for ``take`` (the driver calls it a block ahead)."""
        ...


class InMemory:
    """A KeptLayer held as the tensors themselves."""

    def __init__(self, inputs: dict[str, torch.Tensor], output: torch.Tensor) -> None:
        self._entry = inputs, output

    def take(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self._entry

    def prefetch(self) -> None:
        pass


class OnDisk:
    """A KeptLayer written to one safetensors file: the distinct input tensors under their first Linear's name, the
    block output under OUTPUT_KEY, and in the metadata each Linear that read the same tensor as an earlier one (q, k
    and v read one tensor; so do cross-attention's k and v). Read back once (``prefetch`` starts the read in the
    background), then deleted."""

    def __init__(self, path: Path, written: Future | None = None, reader: ThreadPoolExecutor | None = None) -> None:
        self.path = path
        self._written = written  # the background write, None once done (or for a file written by someone else)
        self._reader = reader  # where ``prefetch`` reads; None: it does nothing
        self._read: Future | None = None

    @staticmethod
    def serialise(inputs: dict[str, torch.Tensor], output: torch.Tensor) -> bytes:
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        for rel, x in inputs.items():
            owner = next((r for r, seen in tensors.items() if same_tensor(seen, x)), None)
            if owner is None:
                tensors[rel] = x.detach().contiguous()
            else:
                aliases[rel] = owner
        tensors[OUTPUT_KEY] = output.detach().contiguous()
        return save(tensors, metadata=aliases)

    @classmethod
    def write(cls, path: Path, inputs: dict[str, torch.Tensor], output: torch.Tensor) -> "OnDisk":
        """Written now, in this thread."""
        path.write_bytes(cls.serialise(inputs, output))
        return cls(path)

    def prefetch(self) -> None:
        """Read the file's bytes on the reader thread (once its write is done), for ``take``."""
        if self._read is None and self._reader is not None:
            self._read = self._reader.submit(self._bytes)

    def take(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        data = self._read.result() if self._read is not None else self._bytes()
        self._read = None
        try:
            tensors = load(data)
            aliases = _metadata(data)
        except (SafetensorError, ValueError, UnicodeDecodeError) as e:
            raise FpSpillError(f"{self.path}: the spilled fp stream does not read back ({e})") from None
        if OUTPUT_KEY not in tensors or any(not isinstance(owner, str) or owner not in tensors
                                            for owner in aliases.values()):
            raise FpSpillError(f"{self.path}: the spilled fp stream lacks {OUTPUT_KEY!r} or an aliased input")
        self.path.unlink(missing_ok=True)
        output = tensors.pop(OUTPUT_KEY)
        inputs = {**tensors, **{rel: tensors[owner] for rel, owner in aliases.items()}}
        return inputs, output

    def _bytes(self) -> bytes:
        if self._written is not None:
            self._written.result()  # a write that failed (a full disk) raises its OSError here
            self._written = None
        try:
            return self.path.read_bytes()
        except OSError as e:
            raise FpSpillError(f"{self.path}: the spilled fp stream does not read back ({e.strerror or e})") from None


def _metadata(data: bytes) -> dict:
    """The metadata of a safetensors file's bytes (its JSON header's "__metadata__")."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise ValueError("its metadata is no mapping")
    return metadata


class FpSpill:
    """The folder a pass spills its fp stream into, with the threads that write and read it (see the module doc).
    ``prefetch``: whether the driver may read the next block's files while it calibrates the current one (the
    backbone sets it where the budget holds two blocks' streams)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.prefetch = False
        self._writer: ThreadPoolExecutor | None = None
        self.reader: ThreadPoolExecutor | None = None
        self._in_flight: deque[Future] = deque()

    def has_room(self, nbytes: int) -> bool:
        """Whether the file system under the folder has ``nbytes`` free beyond DISK_RESERVE_BYTES."""
        existing = next((p for p in (self.directory, *self.directory.parents) if p.exists()), None)
        return existing is not None and shutil.disk_usage(existing).free >= nbytes + DISK_RESERVE_BYTES

    def clear(self) -> None:
        """An empty folder: whatever an interrupted run left is removed first."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)

    def write(self, block: str, window: int, inputs: dict[str, torch.Tensor], output: torch.Tensor) -> OnDisk:
        """Serialised now, written by the writer thread; waits while WRITES_IN_FLIGHT files are pending."""
        path = self.directory / f"{block}.w{window:05d}.safetensors"
        data = OnDisk.serialise(inputs, output)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp-spill-writer")
            self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp-spill-reader")
        while len(self._in_flight) >= WRITES_IN_FLIGHT:
            self._in_flight.popleft().result()
        written = self._writer.submit(path.write_bytes, data)
        self._in_flight.append(written)
        return OnDisk(path, written, self.reader if self.prefetch else None)

    def flush(self) -> None:
        """Wait for every pending write (its error, such as a full disk, is raised here)."""
        while self._in_flight:
            self._in_flight.popleft().result()

    def remove(self) -> None:
        """Stop the threads (pending work abandoned) and remove the folder."""
        for pool in (self._writer, self.reader):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._writer = self.reader = None
        self._in_flight.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The very same view of the same memory (not merely equal values)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
