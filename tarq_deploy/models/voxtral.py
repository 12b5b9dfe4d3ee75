"""Voxtral backbone adapter (transformers ``VoxtralForConditionalGeneration``): transcription windows with rare
tags, calibration stages, transcription, and the lattice checkpoint.

What is quantized. By default only the language model's decoder Linears: q/k/v/o and gate/up/down of every layer,
in true-sequential groups [q, k, v] -> [o] -> [gate, up] -> [down] (GPTQModel's Voxtral definition and the vLLM
convention). The audio tower, the multi-modal projector, the token embeddings and lm_head stay in 16 bits.
``quantize_audio_tower=True`` adds the Whisper-like audio encoder's Linears ([q, k, v] -> [out] -> [fc1] -> [fc2]),
calibrated first. What each choice costs (Voxtral-Mini-3B): the audio tower is ~0.64 B of the ~4.7 B parameters
(~1.3 GB in 16 bits, ~0.35 GB in int4 g128), so quantizing it saves ~0.9 GB of weights; it buys little speed, since
the encoder runs once per 30 s chunk over 1500 frames, a compute-bound shape where weight-only int4 kernels gain
nothing; every audio token the language model reads carries the encoder's error; no rare tags exist for encoder
frames here (no alignment is computed), so its Linears get the plain metric (TARQ falls back to GPTQ + residual);
and runtimes that follow GPTQModel's layout (vLLM's Voxtral) may expect 16-bit audio weights. Keeping it (default)
costs nothing in accuracy and ~0.9 GB of memory.

Transcription prompt (mistral-common ``InstructTokenizerV7._encode_instruct_transcription``, which transformers'
``VoxtralProcessor.apply_transcription_request`` calls; it needs mistral-common and a real tekken.json, so the ids are
built here from the tokenizer's own special tokens and text encoding)::

    <s> [INST] [BEGIN_AUDIO] [AUDIO] x n [/INST] lang:en [TRANSCRIBE]   transcript </s>

Audio is padded to a multiple of 30 s; each 30 s chunk is 3000 mel frames -> 1500 encoder frames -> 375 audio
tokens (``get_audio_features`` stacks 4 consecutive encoder frames per projector input). The transcript follows
[TRANSCRIBE] without a leading space, as assistant text follows [/INST] in Mistral prompts (an assumption the real
tokenizer cannot confirm offline: see ``decoder_transcript``).

Windows. Utterances are packed into windows of at most 30 s (``pack=True``, one 375-token audio chunk each), so
audio positions carry speech rather than padding. Rare tags (``data.rarity.rare_token_mask``): the decoder input
position whose *predicted* token belongs to a rare transcript word; prompt and audio positions are never tagged.

Stages. Decoder: ``enter`` builds the language model's input embeddings through the model's own code
(``get_input_embeddings``, ``get_audio_features``, ``get_placeholder_mask``, ``masked_scatter``, as in
``VoxtralModel.forward``), the rotary (cos, sin) through the language model's ``rotary_emb`` and the causal mask
through ``masking_utils.create_causal_mask``; ``call_block`` runs one Llama decoder layer with them. Audio (optional):
``enter`` captures the input of the first encoder layer by running the audio tower's own forward up to it; ``leave``
applies the encoder's final LayerNorm and the projector as ``get_audio_features`` does.

Tokenizer. Rare tags need character offsets, i.e. a fast ``tokenizers`` tokenizer. Without mistral-common installed,
transformers 5.x loads Voxtral's tekken.json as one (``TokenizersBackend``); with mistral-common it picks
``MistralCommonBackend``, which has no offsets: load the processor with ``mistral_format=False`` then.

Names. Checkpoint tensor names are the model's state-dict names under this transformers (5.x: ``model.language_model
.layers.N...``, ``lm_head.weight``); transformers 5.x loads exports with these names. ``save_pretrained`` writes
the hub layout (``language_model.model.layers.N...``), which transformers 4.x loaders expect instead.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import VoxtralConfig, VoxtralForConditionalGeneration, VoxtralProcessor

from ..checkpoint import LatticeCheckpoint, load_checkpoint
from ..data.rarity import DEFAULT_ZIPF_THRESHOLD, rare_token_mask
from ..quant.backbone import Block, Window
from ..quant.lattice import LatticeSpec, QuantizedWeight
from ..quant.precision import widened
from .common import (CALIBRATION_DTYPE, SplicedDecoderStage, TextAudio, checkpoint_from_model, joined,
                     load_lattice_weights, model_files_dir, pack_utterances, saved_files)
from .whisper import ENCODER_FRAMES_PER_SECOND

__all__ = ["VoxtralBackbone", "load_dequantized_voxtral", "voxtral_checkpoint"]

SAMPLE_RATE = 16000
CHUNK_SECONDS = 30  # Voxtral's processor pads audio to a multiple of 30 s (480000 samples)
CHUNK_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS
DECODER_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                  ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
AUDIO_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"], ["fc1"], ["fc2"]]
# Tekken control tokens of the transcription prompt (mistral-common SpecialTokens names).
BOS, EOS = "<s>", "</s>"
BEGIN_INST, END_INST = "[INST]", "[/INST]"
BEGIN_AUDIO, AUDIO = "[BEGIN_AUDIO]", "[AUDIO]"
TRANSCRIBE = "[TRANSCRIBE]"


def decoder_transcript(transcript: str) -> str:
    """A transcript as the decoder produces it after [TRANSCRIBE]: no leading space, no outer whitespace."""
    return transcript.strip()


class VoxtralBackbone:
    architecture = "voxtral"

    def __init__(self, model: VoxtralForConditionalGeneration, processor: VoxtralProcessor, device: str = "cpu",
                 language: str | None = "en", quantize_audio_tower: bool = False) -> None:
        self.model = model.to(device).eval()
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = torch.device(device)
        self.language = language
        self.quantize_audio_tower = quantize_audio_tower

    # -- prompt ----------------------------------------------------------------------------------------------------
    def special_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == self.tokenizer.unk_token_id and token != "<unk>"):
            raise ValueError(f"tokenizer has no {token!r}: not a Voxtral (tekken) tokenizer")
        return int(token_id)

    def audio_features(self, audio: np.ndarray) -> torch.Tensor:
        """Log-mel features [chunks, mel bins, 3000] as VoxtralProcessor makes them (padded to whole 30 s chunks)."""
        extractor = self.processor.feature_extractor
        features = extractor(audio, sampling_rate=SAMPLE_RATE, padding=True, truncation=False,
                             pad_to_multiple_of=CHUNK_SAMPLES, return_tensors="pt").input_features
        frames = 2 * self.model.config.audio_config.max_source_positions  # the encoder's conv2 has stride 2
        return features.reshape(extractor.feature_size, -1, frames).transpose(0, 1).contiguous()

    def audio_token_count(self, n_chunks: int) -> int:
        """Audio placeholders for ``n_chunks`` chunks: encoder frames / (projector input width / encoder width)."""
        audio = self.model.config.audio_config
        return n_chunks * audio.max_source_positions * audio.hidden_size // audio.intermediate_size

    def prompt_ids(self, n_audio_tokens: int) -> list[int]:
        """<s> [INST] [BEGIN_AUDIO] [AUDIO]*n [/INST] (lang:xx) [TRANSCRIBE]."""
        ids = [self.special_id(BOS), self.special_id(BEGIN_INST), self.special_id(BEGIN_AUDIO)]
        ids += [self.special_id(AUDIO)] * n_audio_tokens + [self.special_id(END_INST)]
        if self.language is not None:
            ids += self.tokenizer.encode(f"lang:{self.language}", add_special_tokens=False)  # no space, as upstream
        return ids + [self.special_id(TRANSCRIBE)]

    # -- windows -----------------------------------------------------------------------------------------------------
    def build_windows(self, utterances: list[TextAudio], k: float = DEFAULT_ZIPF_THRESHOLD,
                      pack: bool = True, encoder_tagging: str = "none", keep_fp_bytes: int = 0,
                      compute_dtype: str = "float32") -> list[Window]:
        """Encoder frames are never tagged (no alignment heads): with the default 16-bit audio tower that costs
        nothing; a quantized audio tower gets the plain metric. ``encoder_tagging`` is accepted for a common
        interface and recorded as 'none'; no pass is kept for reuse (``keep_fp_bytes``); no model runs here, so
        ``compute_dtype`` changes nothing."""
        return [self._window(group, k) for group in pack_utterances(utterances, pack)]

    def _window(self, group: list[TextAudio], k: float) -> Window:
        audio, text = joined(group)
        features = self.audio_features(audio)
        n_audio = self.audio_token_count(features.shape[0])
        tagged = rare_token_mask(self.tokenizer, self.prompt_ids(n_audio), decoder_transcript(text), k,
                                 eos_token_id=self.special_id(EOS))
        ids = torch.tensor(tagged.input_ids[:-1])  # teacher forcing: the last token is only a label
        token_mask = torch.tensor(tagged.mask[:-1])
        n_frames = features.shape[0] * self.model.config.audio_config.max_source_positions
        frame_mask = torch.zeros(n_frames, dtype=torch.bool)  # no frame alignment: encoder Linears get the plain metric
        speech_frames = min(n_frames, int(np.ceil(len(audio) / SAMPLE_RATE * ENCODER_FRAMES_PER_SECOND)))
        info = {"ids": [u.id for u in group], "seconds": len(audio) / SAMPLE_RATE, "chunks": int(features.shape[0]),
                "audio_tokens": n_audio, "speech_frames": speech_frames, "rare_frames": 0,
                "tokens": int(ids.numel()), "rare_tokens": int(token_mask.sum()),
                "words": len(tagged.words), "rare_words": sum(w.rare for w in tagged.words)}
        return Window(inputs={"input_features": features, "input_ids": ids[None]},
                      masks={"tokens": token_mask, "frames": frame_mask}, info=info)

    # -- calibration stages ------------------------------------------------------------------------------------------
    def stages(self) -> list:
        inner = self.model.model
        decoder = [Block(f"model.language_model.layers.{i}", layer, DECODER_GROUPS)
                   for i, layer in enumerate(inner.language_model.layers)]
        stages: list = [_DecoderStage(self, decoder)]
        if self.quantize_audio_tower:
            audio = [Block(f"model.audio_tower.layers.{i}", layer, AUDIO_GROUPS, domain="frames")
                     for i, layer in enumerate(inner.audio_tower.layers)]
            stages.insert(0, _AudioStage(self, audio))
        return stages

    def quantized_weight_names(self) -> list[str]:
        return [name for stage in self.stages() for b in stage.blocks for name in b.weight_names()]

    def checkpoint(self, lattice: dict[str, QuantizedWeight], spec: LatticeSpec, metadata: dict) -> LatticeCheckpoint:
        return voxtral_checkpoint(self, lattice, spec, metadata)

    def audio_embeddings(self, features: torch.Tensor) -> torch.Tensor:
        """Projected audio embeddings [audio tokens, hidden] through the model's own ``get_audio_features``."""
        with torch.no_grad(), _float32_input(self.model.model.audio_tower):
            features = features.to(self.device, CALIBRATION_DTYPE)
            return self.model.model.get_audio_features(features, return_dict=True).pooler_output

    # -- transcription -----------------------------------------------------------------------------------------------
    def transcribe(self, audio: np.ndarray, max_new_tokens: int = 200) -> str:
        features = self.audio_features(audio)
        prompt = torch.tensor([self.prompt_ids(self.audio_token_count(features.shape[0]))], device=self.device)
        with torch.no_grad():
            ids = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                      input_features=features.to(self.device, self.model.dtype),
                                      max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                      eos_token_id=self.special_id(EOS), pad_token_id=self.special_id(EOS))
        return self.tokenizer.decode(ids[0, prompt.shape[1]:], skip_special_tokens=True).strip()


# --------------------------------------------------------------------------------------------------------- stages
class _Captured(Exception):
    """Raised from a pre-hook once the wanted input is captured: the rest of the forward is not needed."""


def _float32_input(tower: nn.Module) -> contextlib.AbstractContextManager:
    """The audio tower casts its input to conv1's dtype before anything runs: with conv1 widened first, float32
    features stay float32 and a bfloat16 source is encoded as its float32 copy would be (not from bfloat16 mels)."""
    return widened(tower.conv1)


class _AudioStage:
    name = "audio_tower"

    def __init__(self, backbone: VoxtralBackbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        """Input of the first encoder layer (convolutions + positions), from the audio tower's own forward."""
        tower = self.backbone.model.model.audio_tower
        captured: list[torch.Tensor] = []

        def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured.append(args[0] if args else kwargs["hidden_states"])
            raise _Captured

        handle = tower.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad(), _float32_input(tower):
                tower(window.inputs["input_features"].to(self.backbone.device, CALIBRATION_DTYPE))
        except _Captured:
            pass
        finally:
            handle.remove()
        return captured[0]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return module(h, attention_mask=None)

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        """The tail of ``get_audio_features``: final LayerNorm, 4 frames per projector input, projector."""
        inner = self.backbone.model.model
        with torch.no_grad():
            h = inner.audio_tower.layer_norm(h).reshape(-1, inner.config.audio_config.intermediate_size)
            stream["audio_embeds"] = inner.multi_modal_projector(h)


class _DecoderStage(SplicedDecoderStage):
    def __init__(self, backbone: VoxtralBackbone, blocks: list[Block]) -> None:
        super().__init__(backbone, blocks)
        # Without an audio stage both streams read the same untouched audio tower: encode each window once
        # (kept for the stage's life: 375 x hidden values per 30 s chunk).
        self._audio_embeds: dict[int, torch.Tensor] = {}

    def _audio(self, window: Window, stream: dict) -> torch.Tensor:
        if "audio_embeds" in stream:  # left by the audio stage of this stream
            return stream["audio_embeds"]
        key = id(window)
        if key not in self._audio_embeds:
            self._audio_embeds[key] = self.backbone.audio_embeddings(window.inputs["input_features"])
        return self._audio_embeds[key]

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        pass  # the final norm and lm_head stay in 16 bits: nothing downstream needs the decoder output


# ----------------------------------------------------------------------------------------------------- checkpoint
def voxtral_checkpoint(backbone: VoxtralBackbone, lattice: dict[str, QuantizedWeight], spec: LatticeSpec,
                       metadata: dict) -> LatticeCheckpoint:
    """Lattice weights, every other tensor untouched (in its own dtype), shared storage stored once, model files."""
    files = saved_files(backbone.model.config, backbone.model.generation_config, backbone.processor)
    return checkpoint_from_model(backbone.model, lattice, spec, metadata, files)


def load_dequantized_voxtral(checkpoint: str | Path | LatticeCheckpoint, dtype: torch.dtype = torch.float32,
                             mistral_format: bool | None = False) -> tuple[VoxtralForConditionalGeneration,
                                                                            VoxtralProcessor]:
    """(model, processor) with every lattice weight replaced by its exact value s * q (cast to ``dtype``).
    ``mistral_format=False`` keeps a fast tokenizer even when mistral-common is installed (rare tags need it)."""
    ckpt = checkpoint if isinstance(checkpoint, LatticeCheckpoint) else load_checkpoint(checkpoint)
    with model_files_dir(ckpt) as tmp:
        config = VoxtralConfig.from_pretrained(tmp)
        processor = VoxtralProcessor.from_pretrained(tmp, mistral_format=mistral_format)
        model = VoxtralForConditionalGeneration(config)
        model.generation_config = model.generation_config.from_pretrained(tmp)
    load_lattice_weights(model, ckpt, "Voxtral")
    return model.to(dtype).eval(), processor
