"""The calibration's resumable work directory (OUT.partial): one safetensors file per finished block, the per-layer
records so far and each block file's sha256, keyed by a fingerprint of everything that decides the result. A run
with another fingerprint starts afresh; a block file that does not read back as saved is named and recomputed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from safetensors import SafetensorError
from safetensors.torch import load, save

from ..fileio import write_bytes_atomic, write_json_atomic
from ..hashing import json_fingerprint, sha256_hex
from ..quant.backbone import Block
from ..quant.lattice import PARAM_FIELDS, LatticeSpec, QuantizedWeight, check_on_lattice

__all__ = ["WorkDirError", "WorkDir", "fingerprint"]


class WorkDirError(ValueError):
    """A file of the work directory does not read back as what was saved; the message names it."""


class WorkDir:
    """Resumable state: one safetensors file per finished block, plus the records so far and each file's sha256."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.progress_file = path / "progress.json"
        self.block_sha256: list[str] = []

    def block_file(self, index: int) -> Path:
        return self.path / f"block-{index:04d}.safetensors"

    def load(self) -> tuple[int, list[dict]]:
        """Number of finished blocks and their records; (0, []) for a fresh run or a different configuration.
        WorkDirError when progress.json is unreadable."""
        self.block_sha256 = []
        if not self.progress_file.is_file():
            return 0, []
        try:
            progress = json.loads(self.progress_file.read_text())
            if progress.get("fingerprint") != self.fingerprint:
                return 0, []
            finished, records = int(progress["finished_blocks"]), list(progress["records"])
            hashes = [str(h) for h in progress.get("block_sha256", [])]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WorkDirError(f"{self.progress_file}: unreadable ({e})") from None
        self.block_sha256 = hashes
        return finished, records

    def save_block(self, index: int, lattice: dict[str, QuantizedWeight], records: list[dict]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, q in lattice.items():
            tensors[f"{name}.codes"] = q.codes.cpu().contiguous()
            for part, tensor in q.params().items():
                tensors[f"{name}.{part}"] = tensor.cpu().contiguous()
        data = save(tensors)
        write_bytes_atomic(self.block_file(index), data)
        earlier = self.block_sha256[:index]
        self.block_sha256 = [*earlier, *[""] * (index - len(earlier)), sha256_hex(data)]
        progress = {"fingerprint": self.fingerprint, "finished_blocks": index + 1, "records": records,
                    "block_sha256": self.block_sha256}
        write_json_atomic(self.progress_file, progress, indent=1)

    def load_block(self, index: int, spec_for: Callable[[str], LatticeSpec],
                   block: Block | None = None) -> dict[str, QuantizedWeight]:
        """The lattice saved for block ``index``; WorkDirError naming the file when it is missing, does not match
        its recorded sha256, or does not hold the block's Linears on the lattice."""
        path = self.block_file(index)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise WorkDirError(f"{path}: unreadable ({e.strerror or e})") from None
        recorded = self.block_sha256[index] if index < len(self.block_sha256) else ""  # "": saved without one
        if recorded and sha256_hex(data) != recorded:
            raise WorkDirError(f"{path}: content does not match its sha256 in {self.progress_file.name} (corrupted)")
        try:
            raw = load(data)
        except (SafetensorError, ValueError) as e:
            raise WorkDirError(f"{path}: not a readable safetensors file ({e})") from None
        names = sorted({k.rsplit(".", 1)[0] for k in raw})
        if block is not None:
            expected = sorted(block.weight_names())
            if names != expected:
                raise WorkDirError(f"{path}: holds {len(names)} matrices, not the {len(expected)} Linears of "
                                   f"{block.name}")
        lattice = {}
        for name in names:
            if f"{name}.codes" not in raw or f"{name}.scales" not in raw:
                raise WorkDirError(f"{path}: codes or scales of {name} missing")
            params = {part: raw[f"{name}.{part}"] for part in PARAM_FIELDS if f"{name}.{part}" in raw}
            q = QuantizedWeight(raw[f"{name}.codes"], spec=spec_for(name), **params)
            try:
                check_on_lattice(q)
            except ValueError as e:
                raise WorkDirError(f"{path}: {name}: {e}") from None
            if block is not None:
                rel = name.removeprefix(f"{block.name}.").removesuffix(".weight") if block.name else \
                    name.removesuffix(".weight")
                expected_shape = tuple(block.linear(rel).weight.shape)
                if tuple(q.codes.shape) != expected_shape:
                    raise WorkDirError(f"{path}: {name} has shape {tuple(q.codes.shape)}, the model's is "
                                       f"{expected_shape}")
            lattice[name] = q
        return lattice


def fingerprint(*parts: Any) -> str:
    """A stable hash of everything that determines the result (model, corpus, method, lattice, seed)."""
    return json_fingerprint(parts, ensure_ascii=True, default=str)  # the options work folders were keyed with


