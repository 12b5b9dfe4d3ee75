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

__all__ = ["TypeRecipe", "auto_recipe", "bits_per_weight", "layer_score", "parse_tensor_type", "promotion_patterns"]


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


# ------------------------------------------------------------------------------------------------- auto recipe
@dataclass(frozen=True)
class Promotion:
    """One tensor the auto recipe moves to the richer type, and why."""

    name: str  # the weight's name ("...fc1.weight")
    score: float  # its measured rareBAL-weighted loss at the base type
    extra_bytes: int  # what the richer type costs on top of the base type


def bits_per_weight(type_name: str) -> float:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    return 8 * size / block


def layer_score(record: dict) -> float | None:
    """A layer's measured loss with its tail positions weighted as rareBAL weighs them: L_common N_common + lam
    L_tail N_tail (lam = 1 where the plain metric was used); None when the record carries no losses (rtn)."""
    if "common_loss_final" not in record or "tail_loss_final" not in record:
        return None
    lam = record.get("lam") or 1.0
    return (record["common_loss_final"] * record.get("n_common", 0)
            + lam * record["tail_loss_final"] * record.get("n_tail", 0))


def auto_recipe(records: list[dict], shapes: dict[str, list[int]], base: str, promote: str,
                budget_bytes: float) -> list[Promotion]:
    """The tensors to move from ``base`` to ``promote`` within ``budget_bytes`` extra: greedily by measured loss
    per extra byte (a richer type removes most of a tensor's rounding loss, so the loss is the gain), largest first;
    a tensor that does not fit the remaining budget is skipped for smaller ones."""
    extra_per_weight = (bits_per_weight(promote) - bits_per_weight(base)) / 8
    if extra_per_weight <= 0:
        raise ValueError(f"promoting {base} to {promote} saves nothing: {promote} must hold more bits per weight")
    candidates = []
    for record in records:
        name, score = f"{record['name']}.weight", layer_score(record)
        if score is None or name not in shapes:
            continue
        rows, cols = shapes[name]
        candidates.append(Promotion(name, score, round(rows * cols * extra_per_weight)))
    if not candidates:
        raise ValueError("the checkpoint's per-layer records carry no losses (calibrate it with gptq, rarebal, "
                         "residual or tarq, not rtn)")
    chosen, left = [], budget_bytes
    for c in sorted(candidates, key=lambda c: (-c.score / max(c.extra_bytes, 1), c.name)):
        if c.extra_bytes <= left:
            chosen.append(c)
            left -= c.extra_bytes
    return chosen


def promotion_patterns(chosen: list[Promotion], promote: str) -> tuple[tuple[str, str], ...]:
    """--tensor-type overrides naming each promoted weight exactly."""
    return tuple((f"^{re.escape(c.name)}$", promote) for c in sorted(chosen, key=lambda c: c.name))
