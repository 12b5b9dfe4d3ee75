"""Per-tensor lattice recipes: which ggml type each weight matrix is quantized to.

A recipe is a default lattice and an ordered list of (pattern, lattice) overrides, the first pattern found in a
weight's name (``re.search``, as llama.cpp's and CrispASR's ``--tensor-type regex=type`` match) deciding it; e.g.
``audio_tower=q8_0`` keeps a Qwen3-ASR audio tower at 8 bits while the decoder takes the default. whisper.cpp's .bin
holds one type for all matrices; the GGUF targets hold a mix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .choices import GGML_TYPES
from .lattice import LatticeSpec


def spec_of_type(type_name: str) -> LatticeSpec:
    """The lattice a ggml type stores ("q5_1" -> 5-bit affine, groups of 32)."""
    scheme, bits, group = GGML_TYPES[type_name]
    return LatticeSpec(bits, group, scheme)


def parse_tensor_type(text: str) -> tuple[str, str]:
    """'PATTERN=TYPE' -> (pattern, type); ValueError naming the problem (bad pattern, unknown type)."""
    pattern, sep, type_name = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"{text!r}: expected PATTERN=TYPE, e.g. 'audio_tower=q8_0'")
    if type_name not in GGML_TYPES:
        raise ValueError(f"{text!r}: unknown type {type_name!r}; known: {', '.join(GGML_TYPES)}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{text!r}: not a regular expression ({e})") from None
    return pattern, type_name


@dataclass(frozen=True)
class TypeRecipe:
    """A default lattice and (pattern, lattice) overrides, first match wins."""

    default: LatticeSpec
    overrides: tuple[tuple[str, LatticeSpec], ...] = ()

    @classmethod
    def from_types(cls, default: LatticeSpec, tensor_types: tuple[tuple[str, str], ...]) -> "TypeRecipe":
        return cls(default, tuple((pattern, spec_of_type(name)) for pattern, name in tensor_types))

    def spec_for(self, name: str) -> LatticeSpec:
        for pattern, spec in self.overrides:
            if re.search(pattern, name):
                return spec
        return self.default
