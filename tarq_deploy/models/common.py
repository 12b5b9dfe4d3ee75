"""Pieces every backbone adapter shares: calibration utterances and windows, the tied output head as a block,
checkpoint assembly from a model's state, and the model files that travel with a checkpoint."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checkpoint import LatticeCheckpoint
from ..quant.backbone import Block, Window
from ..quant.lattice import LatticeSpec, QuantizedWeight
from ..quant.precision import is_memory_mapped

__all__ = ["CALIBRATION_DTYPE", "GAP_SECONDS", "HeadStage", "SAMPLE_RATE", "SplicedDecoderStage", "TextAudio",
           "WINDOW_SECONDS", "checkpoint_from_model", "joined", "load_lattice_weights", "model_files_dir", "pack_utterances",
           "saved_files"]

SAMPLE_RATE = 16000
# What a calibration stage hands the model: float32, whatever dtype the weights are stored in (float32_compute widens
# each module as it runs), so a bfloat16 source is calibrated with a float32 copy's arithmetic.
CALIBRATION_DTYPE = torch.float32
WINDOW_SECONDS = 30.0
GAP_SECONDS = 0.3


@dataclass
class TextAudio:
    """An utterance ready for calibration: 16 kHz mono audio and its reference transcript."""

    id: str
    audio: np.ndarray
    text: str


def pack_utterances(utterances: list[TextAudio], pack: bool) -> list[list[TextAudio]]:
    """Greedy packing, in the given order, into windows of at most 30 s (one utterance per window without packing).
    A longer utterance never gets here: quant/pipeline.py refuses it by name (the feature extractor would cut it to
    30 s and keep its whole transcript)."""
    if not pack:
        return [[u] for u in utterances]
    windows: list[list[TextAudio]] = []
    length = 0.0
    for u in utterances:
        seconds = len(u.audio) / SAMPLE_RATE
        if windows and length + GAP_SECONDS + seconds <= WINDOW_SECONDS:
            windows[-1].append(u)
            length += GAP_SECONDS + seconds
        else:
            windows.append([u])
            length = seconds
    return windows


def joined(group: list[TextAudio]) -> tuple[np.ndarray, str]:
    """A window's audio (utterances separated by 0.3 s of silence) and its transcript (joined by spaces)."""
    gap = np.zeros(int(GAP_SECONDS * SAMPLE_RATE), dtype=np.float32)
    audio = np.concatenate([piece for u in group for piece in (u.audio, gap)][:-1])
    return audio, " ".join(u.text.strip() for u in group)


class LinearHead(nn.Module):
    """Holds the output projection under its own attribute name, so the head is a block like any other."""

    def __init__(self, name: str, linear: nn.Linear) -> None:
        super().__init__()
        self.name = name
        setattr(self, name, linear)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name)(h)


class HeadStage:
    """The output head's stage: its input is the final normed decoder state the decoder stage left in the stream."""

    name = "head"

    def __init__(self, head_name: str, linear: nn.Linear, identity_weight: float) -> None:
        self.blocks = [Block("", LinearHead(head_name, linear), [[head_name]], identity_weight=identity_weight)]

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        return stream["decoder_out"]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return h  # the logits are not needed downstream; the head's input is fed by ``steps``

    def steps(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict):
        """The head's one group is fed its input, and no logits are computed (Whisper's: 51,865 x 512 per token, in
        each stream)."""
        yield {module.name: h}
        return h

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        pass


class SplicedDecoderStage:
    """The text decoder of an audio LLM (Qwen3-ASR, Voxtral): token embeddings with the window's audio embeddings
    scattered into the audio placeholder positions (the models' own forward), then decoder layers that all read the
    rotary tables and causal mask kept in the stream. Subclasses say where the audio embeddings come from
    (``_audio``) and what the stage leaves behind (``leave``)."""

    name = "language_model"

    def __init__(self, backbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def _audio(self, window: Window, stream: dict) -> torch.Tensor:
        raise NotImplementedError

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        inner = self.backbone.model.model
        lm = inner.language_model
        ids = window.inputs["input_ids"].to(self.backbone.device)
        with torch.no_grad():
            embeds = inner.get_input_embeddings()(ids)
            audio = self._audio(window, stream)
            placeholders = inner.get_placeholder_mask(ids, inputs_embeds=embeds, audio_features=audio)
            h = embeds.masked_scatter(placeholders, audio.to(embeds.dtype))
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
            stream["position_ids"] = positions
            stream["position_embeddings"] = lm.rotary_emb(h, position_ids=positions)
            stream["causal_mask"] = create_causal_mask(config=lm.config, inputs_embeds=h, attention_mask=None,
                                                       past_key_values=None, position_ids=positions)
        return h

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return module(h, attention_mask=stream["causal_mask"], position_ids=stream["position_ids"],
                      position_embeddings=stream["position_embeddings"], use_cache=False)

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        pass


def checkpoint_from_model(model: nn.Module, lattice: dict[str, QuantizedWeight], spec: LatticeSpec, metadata: dict,
                          model_files: dict[str, bytes], widen: bool = False) -> LatticeCheckpoint:
    """Lattice weights, every other tensor untouched (in its own dtype, or float32 with ``widen``: exact for float16
    and bfloat16), and tensors that share storage (tied embeddings) stored once: as an alias of the lattice when one
    of them is quantized, else of the first name."""
    state = model.state_dict()
    aliases = shared_storage_aliases(state, lattice)
    tensors = {n: _untouched(t, widen) for n, t in state.items() if n not in lattice and n not in aliases}
    return LatticeCheckpoint(spec, {k: q.to("cpu") for k, q in lattice.items()}, tensors, aliases, metadata,
                             model_files)


def _untouched(tensor: torch.Tensor, widen: bool) -> torch.Tensor:
    t = tensor.detach().cpu()
    if widen and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    # A source's memory-mapped weights are never written: shared, not copied (Voxtral-Mini-3B's audio tower, token
    # table and head are 2.9 GB, and a copy would read every page of them into memory)
    return t if is_memory_mapped(t) else t.clone()


def shared_storage_aliases(state: dict[str, torch.Tensor], lattice: dict[str, QuantizedWeight]) -> dict[str, str]:
    """name -> the name it shares storage with: the lattice name when one of them is quantized, else the first."""
    key = lambda t: (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())  # noqa: E731
    owner: dict[tuple, str] = {}
    for name in sorted(state, key=lambda n: (n not in lattice, n)):  # lattice names claim their storage first
        owner.setdefault(key(state[name]), name)
    return {name: owner[key(t)] for name, t in state.items() if owner[key(t)] != name}


def saved_files(*savables) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for each object (config, generation config, processor, tokenizer)."""
    with tempfile.TemporaryDirectory() as tmp:
        for obj in savables:
            obj.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


@contextmanager
def model_files_dir(ckpt: LatticeCheckpoint) -> Iterator[Path]:
    """A temporary directory holding a checkpoint's model files, for ``from_pretrained`` of configs/processors."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in ckpt.model_files.items():
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / name).write_bytes(data)
        yield Path(tmp)


def load_lattice_weights(model: nn.Module, ckpt: LatticeCheckpoint, architecture: str) -> None:
    """Fill ``model`` with the checkpoint's exact weights (s * q for the lattice); refuse a checkpoint that does
    not fit the architecture."""
    state = ckpt.dequantized_state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in state]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the {architecture} architecture: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
