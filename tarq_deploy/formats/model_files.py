"""What every converter reads from a model: its files (config, tokenizer, feature extractor; one place for the
JSON parsing and the transformers-version differences, with errors that name the file) and its tensors
(``ModelTensors``)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, TypeVar

from tarq_deploy.checkpoint import LatticeCheckpoint, LatticeWeights, load_checkpoint
from tarq_deploy.errors import JSON_ERRORS

__all__ = ["ModelFilesError", "ModelTensors", "as_model_source", "feature_extractor_config", "json_file"]

Source = TypeVar("Source")


class ModelFilesError(ValueError):
    """A model file is missing or unreadable; the message names it and the checkpoint."""


class ModelTensors:
    """The tensor lookups of an exporter's source (a dataclass that holds the attributes annotated here; this class
    is not a dataclass, so they add no fields). A missing tensor raises the source's ``error`` class."""

    floats: dict[str, Any]  # name -> torch.Tensor
    lattice: LatticeWeights  # name -> QuantizedWeight, a checkpoint's blocks undecoded
    aliases: dict[str, str]  # name -> the name whose tensor it shares
    origin: str
    error: type[ModelFilesError] = ModelFilesError
    runtime: str = "the runtime"  # who expects a tensor's shape, in the error that says it differs
    reshape_unit_axes: bool = False  # a float tensor may gain or lose length-1 axes to fit its slot

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def has(self, name: str) -> bool:
        key = self.resolve(name)
        return key in self.lattice or key in self.floats

    def check_lattice_shape(self, slot: Any) -> None:
        """The lattice weight behind a runtime file's ``slot`` (a TensorSlot) has the shape the runtime expects."""
        shape = self.lattice.shape_of(self.resolve(slot.hf_name))
        if shape != slot.shape:
            raise self.error(f"{self.origin}: {slot.hf_name} has shape {list(shape)}, {self.runtime} expects "
                             f"{list(slot.shape)} for {slot.name}")

    def float_in_slot(self, slot: Any) -> Any:
        """The float tensor behind ``slot`` (a TensorSlot) as float32 on the CPU, in the slot's shape; the error
        names the runtime that expects that shape. Only a length-1 axis may be added or dropped, and only where the
        source says so (Whisper's conv biases: [d] in transformers, [d, 1] in whisper.cpp)."""
        t = self.float_value(slot.hf_name)
        if tuple(t.shape) != slot.shape:
            squeezed = [s for s in t.shape if s != 1] == [s for s in slot.shape if s != 1]
            if not (self.reshape_unit_axes and squeezed):
                raise self.error(f"{self.origin}: {slot.hf_name} has shape {list(t.shape)}, {self.runtime} expects "
                                 f"{list(slot.shape)} for {slot.name}")
            t = t.reshape(slot.shape)
        return t.detach().cpu().float()  # no copy for a float32 CPU tensor

    def float_value(self, name: str) -> Any:
        """The float tensor behind ``name``: stored as is, or s * q of a lattice weight (exact in float32)."""
        key = self.resolve(name)
        if key in self.lattice:
            return self.lattice[key].dequantize()
        if key in self.floats:
            return self.floats[key]
        raise self.error(f"{self.origin}: tensor {name} missing")


def as_model_source(source: Any, source_type: type[Source], checkpoint_source: Callable[..., Source],
                    model_source: Callable[[Any, Any], Source], model_items: tuple[int, ...],
                    background_digests: bool = False) -> Source:
    """An exporter's source from one already made, a LatticeCheckpoint, a checkpoint directory, or a (model,
    processor, ...) tuple whose length is in ``model_items`` (items after the processor are not needed).
    ``checkpoint_source(ckpt, origin=...)`` and ``model_source(model, processor)`` make the exporter's own.
    ``background_digests``: a directory's digests are checked while the exporter works, for one that waits on the
    checkpoint (``LatticeCheckpoint.wait_verified``) before its output is renamed into place."""
    if isinstance(source, source_type):
        return source
    if isinstance(source, LatticeCheckpoint):
        return checkpoint_source(source)
    if isinstance(source, (str, os.PathLike)):
        return checkpoint_source(load_checkpoint(source, background=background_digests), origin=str(source))
    if isinstance(source, (tuple, list)) and len(source) in model_items:
        return model_source(source[0], source[1])
    raise TypeError(f"cannot export {type(source).__name__}: pass a LatticeCheckpoint, a checkpoint directory or "
                    f"(model, processor)")


def json_file(files: dict[str, bytes], name: str, origin: str) -> dict:
    if name not in files:
        raise ModelFilesError(f"{origin}: model file {name} missing")
    try:
        return json.loads(files[name])
    except JSON_ERRORS as e:
        raise ModelFilesError(f"{origin}: model file {name} is not valid JSON ({e})") from None


def feature_extractor_config(files: dict[str, bytes], origin: str) -> dict:
    """preprocessor_config.json, or the 'feature_extractor' entry transformers 5 nests in processor_config.json."""
    if "preprocessor_config.json" in files:
        return json_file(files, "preprocessor_config.json", origin)
    if "processor_config.json" in files:
        nested = json_file(files, "processor_config.json", origin).get("feature_extractor")
        if isinstance(nested, dict):
            return nested
    raise ModelFilesError(f"{origin}: no feature extractor config (preprocessor_config.json, or "
                          f"processor_config.json with a 'feature_extractor' entry) among the model files")
