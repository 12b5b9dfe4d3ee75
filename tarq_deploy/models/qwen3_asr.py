"""Qwen3-ASR backbone adapter (transformers' native ``qwen3_asr``): transcription windows with rare tags, calibration
stages, transcription and the lattice checkpoint (tarq_deploy.calibration.pipeline.quantize_backbone runs the pipeline on it;
``load_qwen3_asr_backbone`` builds one from a transformers directory).

Model. ``Qwen3ASRForConditionalGeneration`` = audio tower (three stride-2 Conv2d, the ``conv_out`` Linear over
conv-channels x frequency, sinusoidal positions restarting in every 100-mel-frame chunk, Whisper-style pre-LN encoder
layers with attention inside windows of 8 chunks, ``ln_post``), multi-modal projector (``linear_1`` -> GELU ->
``linear_2``: audio width -> text width) and a Qwen3 decoder whose ``lm_head`` is tied to ``embed_tokens``.
One audio token per encoder frame: 13 per full chunk (1 s), fewer for the last partial chunk.

Prompt (ChatML, as Qwen3-ASR's own inference code and both ggml runtimes build it)::

    <|im_start|>system\\n<|im_end|>\\n<|im_start|>user\\n<|audio_start|> <|audio_pad|> x n <|audio_end|><|im_end|>\\n
    <|im_start|>assistant\\n language English<asr_text>   transcript <|im_end|>

With ``language`` set the assistant turn is prefilled with ``language <Name><asr_text>`` (transformers'
``apply_transcription_request``; CrispASR does the same), so the decoder produces only the transcript; with
``language=None`` the prefill is left out and the model names the language itself. The transcript follows the
prefill without a leading space. Everything is tokenized by the model's own tokenizer, so ``<asr_text>`` is one token
where the tokenizer has it as an added token and plain BPE pieces where it has not.

What is calibrated, in order (stages):
  1. frontend: ``conv_out`` ([["conv_out"]]) on the valid post-CNN frames (padding frames of the last chunk are
     dropped before it, which the per-position Linear allows);
  2. encoder layers: [q, k, v] -> [out] -> [fc1] -> [fc2];
  3. projector (``quantize_projector=True`` only): [linear_1] -> [linear_2];
  4. decoder layers: [q, k, v] -> [o] -> [gate, up] -> [down];
  5. head: ``lm_head`` on the final decoder states, under H + mu * tr(H)/n * I (mu = ``head_identity_weight``).
Deliberate choices:
* The tied embedding. The ggml runtimes look ``token_embd`` rows up as input embeddings *and* use the same matrix
  (written again as ``output.weight``) as the output projection, so the one lattice must serve both roles. As for
  Whisper, it is calibrated last as ``lm_head`` with an identity term for the lookup role (every row's own error,
  unweighted), balanced against the output role by trace. During calibration the input embedding stays full
  precision in both streams; the checkpoint stores ``embed_tokens`` as an alias of the ``lm_head`` lattice.
* The projector stays in 16 bits by default: it is 0.3 % of the weights (0.6B: 896x896 + 896x1024) and every audio
  token crosses it, so 4 bits would save ~2.6 MB for error on all audio positions. ``quantize_projector=True``
  calibrates it (frame domain, inputs = ``ln_post`` output).
* ``conv_out`` is quantized (6.9 M weights in 0.6B, 1.1 %): a plain Linear over frames, stored as Q4_0 by both
  runtimes; the Conv2d kernels stay F16 as ggml convolutions want them.
* ``quantize_audio_tower=False`` keeps stages 1-3 in 16 bits (the decoder then reads one fixed audio encoding).

Rare tags. Decoder input positions whose *predicted* token belongs to a rare transcript word (data.rarity on the
Qwen byte-level BPE offsets); prompt and audio positions are never tagged. Encoder frames: Qwen3-ASR has no
cross-attention and no alignment heads (its timestamps come from a separate forced-aligner model), so frames are
tagged ``none``: audio-path Linears get the plain metric (TARQ falls back to GPTQ + residual there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from transformers import Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor

from ..checkpoint import LatticeCheckpoint, load_checkpoint
from ..data.rarity import DEFAULT_ZIPF_THRESHOLD, rare_token_mask
from ..quant.backbone import Block, Window
from ..quant.lattice import LatticeSpec, QuantizedWeight
from .common import (CALIBRATION_DTYPE, HeadStage, SplicedDecoderStage, TextAudio, checkpoint_from_model, joined,
                     load_lattice_weights, model_files_dir, pack_utterances, saved_files)

__all__ = ["Qwen3ASRBackbone", "audio_token_count", "load_dequantized_qwen3_asr", "load_qwen3_asr",
           "load_qwen3_asr_backbone", "transcript_of"]

SAMPLE_RATE = 16000
CHUNK_MEL_FRAMES = 100  # 2 * n_window: the conv stack runs on 1 s chunks
FRAMES_PER_FULL_CHUNK = 13  # post-CNN frames of a full chunk (three k=3, s=2, p=1 convolutions)
CONV_STRIDES = 3
FRONTEND_GROUPS = [["conv_out"]]
ENCODER_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"], ["fc1"],
                  ["fc2"]]
PROJECTOR_GROUPS = [["linear_1"], ["linear_2"]]
DECODER_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                  ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
HEAD = "lm_head"
# ChatML pieces of the transcription prompt (token strings of the Qwen tokenizer)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
AUDIO_START, AUDIO_END, AUDIO_PAD = "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"
ASR_TEXT = "<asr_text>"
PROMPT_HEAD = f"{IM_START}system\n{IM_END}\n{IM_START}user\n{AUDIO_START}"
PROMPT_TAIL = f"{AUDIO_END}{IM_END}\n{IM_START}assistant\n"
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian",
                  "pt": "Portuguese", "ru": "Russian", "zh": "Chinese", "ja": "Japanese", "ko": "Korean"}
ARCHITECTURE = "qwen3_asr"


def decoder_transcript(transcript: str) -> str:
    """A transcript as the decoder produces it after the prefill: no leading space, no outer whitespace."""
    return transcript.strip()


def audio_token_count(valid_mel_frames: int) -> int:
    """Audio tokens (= encoder frames) for ``valid_mel_frames`` mel frames: 13 per full 100-frame chunk, and for the
    last partial chunk its length after three k=3, s=2, p=1 convolutions."""
    full, rest = divmod(valid_mel_frames, CHUNK_MEL_FRAMES)
    return full * FRAMES_PER_FULL_CHUNK + _post_cnn_length(rest)


def _post_cnn_length(length: int) -> int:
    for _ in range(CONV_STRIDES):
        length = (length - 1) // 2 + 1 if length > 0 else 0
    return length


class Qwen3ASRBackbone:
    architecture = ARCHITECTURE

    def __init__(self, model: Qwen3ASRForConditionalGeneration, processor: Qwen3ASRProcessor, device: str = "cpu",
                 language: str | None = "en", head_identity_weight: float = 1.0, quantize_audio_tower: bool = True,
                 quantize_projector: bool = False, quantize_head: bool = True) -> None:
        self.model = model.to(device).eval()
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = torch.device(device)
        self.language = language
        self.head_identity_weight = head_identity_weight
        self.quantize_audio_tower = quantize_audio_tower
        self.quantize_projector = quantize_projector
        self.quantize_head = quantize_head

    # -- prompt ----------------------------------------------------------------------------------------------------
    def special_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {token!r}: not a Qwen3-ASR tokenizer")
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prefill(self) -> str:
        if self.language is None:
            return ""
        name = LANGUAGE_NAMES.get(self.language, self.language)
        return f"language {name}{ASR_TEXT}"

    def prompt_ids(self, n_audio_tokens: int) -> list[int]:
        """The ChatML prompt with ``n_audio_tokens`` <|audio_pad|> placeholders and the language prefill."""
        pads = [self.special_id(AUDIO_PAD)] * n_audio_tokens
        return self.encode(PROMPT_HEAD) + pads + self.encode(PROMPT_TAIL + self.prefill())

    def audio_features(self, audio: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_features [1, 128, T], input_features_mask [1, T]) as Qwen3ASRProcessor makes them (T padded to whole
        100-frame chunks; clips under 0.5 s are zero-padded to 0.5 s)."""
        features = self.processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, padding=True,
                                                    return_attention_mask=True, return_tensors="pt")
        return features.input_features, features.attention_mask

    # -- windows ---------------------------------------------------------------------------------------------------
    def build_windows(self, utterances: list[TextAudio], k: float = DEFAULT_ZIPF_THRESHOLD, pack: bool = True,
                      encoder_tagging: str = "none", keep_fp_bytes: int = 0,
                      compute_dtype: str = "float32") -> list[Window]:
        """Windows of at most 30 s (``pack``). Encoder frames are never tagged (no alignment heads; see the module
        doc): ``encoder_tagging`` is accepted for the common interface and has no effect, and no pass is kept for
        reuse (``keep_fp_bytes``); no model runs here, so ``compute_dtype`` changes nothing."""
        return [self._window(group, k) for group in pack_utterances(utterances, pack)]

    def _window(self, group: list[TextAudio], k: float) -> Window:
        audio, text = joined(group)
        features, mask = self.audio_features(audio)
        n_audio = audio_token_count(int(mask.sum()))
        tagged = rare_token_mask(self.tokenizer, self.prompt_ids(n_audio), decoder_transcript(text), k,
                                 eos_token_id=self.special_id(IM_END))
        ids = torch.tensor(tagged.input_ids[:-1])  # teacher forcing: the last token is only a label
        token_mask = torch.tensor(tagged.mask[:-1])
        frame_mask = torch.zeros(n_audio, dtype=torch.bool)  # no alignment: audio Linears get the plain metric
        info = {"ids": [u.id for u in group], "seconds": len(audio) / SAMPLE_RATE, "audio_tokens": n_audio,
                "speech_frames": n_audio, "rare_frames": 0, "tokens": int(ids.numel()),
                "rare_tokens": int(token_mask.sum()), "words": len(tagged.words),
                "rare_words": sum(w.rare for w in tagged.words)}
        return Window(inputs={"input_features": features, "input_features_mask": mask, "input_ids": ids[None]},
                      masks={"tokens": token_mask, "frames": frame_mask}, info=info)

    # -- calibration stages ----------------------------------------------------------------------------------------
    def stages(self) -> list:
        inner = self.model.model
        stages: list = []
        if self.quantize_audio_tower:
            tower = inner.audio_tower
            stages.append(_FrontendStage(self, [Block("model.audio_tower", _Frontend(tower), FRONTEND_GROUPS,
                                                      domain="frames")]))
            stages.append(_EncoderStage(self, [Block(f"model.audio_tower.layers.{i}", layer, ENCODER_GROUPS,
                                                     domain="frames") for i, layer in enumerate(tower.layers)]))
            if self.quantize_projector:
                stages.append(_ProjectorStage(self, [Block("model.multi_modal_projector", inner.multi_modal_projector,
                                                           PROJECTOR_GROUPS, domain="frames")]))
        decoder = [Block(f"model.language_model.layers.{i}", layer, DECODER_GROUPS)
                   for i, layer in enumerate(inner.language_model.layers)]
        stages.append(_DecoderStage(self, decoder))
        if self.quantize_head:
            stages.append(HeadStage(HEAD, self.model.lm_head, self.head_identity_weight))
        return stages

    def quantized_weight_names(self) -> list[str]:
        return [name for stage in self.stages() for b in stage.blocks for name in b.weight_names()]

    def checkpoint(self, lattice: dict[str, QuantizedWeight], spec: LatticeSpec, metadata: dict) -> LatticeCheckpoint:
        return qwen3_asr_checkpoint(self, lattice, spec, metadata)

    def audio_embeddings(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Projected audio embeddings [audio tokens, hidden] through the model's own ``get_audio_features``."""
        with torch.no_grad():
            out = self.model.model.get_audio_features(features.to(self.device, CALIBRATION_DTYPE),
                                                      mask.to(self.device), return_dict=True)
        return out.pooler_output

    # -- transcription ---------------------------------------------------------------------------------------------
    def generate_ids(self, audio: np.ndarray, max_new_tokens: int = 200) -> list[int]:
        """Greedy decoding; the new token ids (the end token included when reached)."""
        features, mask = self.audio_features(audio)
        prompt = torch.tensor([self.prompt_ids(audio_token_count(int(mask.sum())))], device=self.device)
        with torch.no_grad():
            ids = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                      input_features=features.to(self.device, self.model.dtype),
                                      input_features_mask=mask.to(self.device), max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=1, eos_token_id=self.special_id(IM_END),
                                      pad_token_id=self.special_id(IM_END))
        return ids[0, prompt.shape[1]:].tolist()

    def transcribe(self, audio: np.ndarray, max_new_tokens: int = 200) -> str:
        text = self.tokenizer.decode(self.generate_ids(audio, max_new_tokens), skip_special_tokens=False)
        return transcript_of(text)


def transcript_of(output: str) -> str:
    """The transcript in a decoded Qwen3-ASR output: up to <|im_end|>, after "language <Name><asr_text>" if the
    model wrote that prefix itself (runtimes that do not prefill the language, such as qwen3-asr.cpp)."""
    text = output.split(IM_END)[0]
    return (text.split(ASR_TEXT, 1)[1] if ASR_TEXT in text else text).strip()


# --------------------------------------------------------------------------------------------------------- stages
class _Captured(Exception):
    """Raised from a pre-hook once the wanted input is captured: the rest of the forward is not needed."""


def _capture_inputs(module: nn.Module, run: Callable[[], object]) -> tuple[tuple, dict]:
    """(args, kwargs) of ``module``'s first call while ``run()`` executes (the forward stops there)."""
    captured: list = []

    def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args, kwargs))
        raise _Captured

    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(module).__name__} was not called")
    return captured[0]


class _Frontend(nn.Module):
    """conv_out over the valid post-CNN frames plus the per-chunk sinusoidal positions (Qwen3ASREncoder.forward)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.conv_out = tower.conv_out
        self.positions = tower.positional_embedding

    def forward(self, features: torch.Tensor, chunk_positions: torch.Tensor) -> torch.Tensor:
        h = self.conv_out(features)
        return h + self.positions.positional_embedding[chunk_positions].to(h.dtype)


class _FrontendStage:
    name = "audio_frontend"

    def __init__(self, backbone: Qwen3ASRBackbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        """conv_out's input restricted to valid frames; the encoder layers' cu_seqlens / max_seqlen go to ``stream``
        (taken from the tower's own forward, so the attention windows are the model's)."""
        tower = self.backbone.model.model.audio_tower
        features = window.inputs["input_features"].to(self.backbone.device, CALIBRATION_DTYPE)
        mask = window.inputs["input_features_mask"].to(self.backbone.device)
        (conv_features,), _ = _capture_inputs(tower.conv_out, lambda: tower(features, mask))
        (_, cu_seqlens), layer_kwargs = _capture_inputs(tower.layers[0], lambda: tower(features, mask))
        stream["encoder_kwargs"] = {"cu_seqlens": cu_seqlens, **layer_kwargs}
        valid = _valid_frames(mask[0], conv_features.shape[1])
        stream["chunk_positions"] = valid.nonzero()[:, 1]
        return conv_features[valid]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return module(h, stream["chunk_positions"])

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        stream["audio_frames"] = h


def _valid_frames(mel_mask: torch.Tensor, frames_per_chunk: int) -> torch.Tensor:
    """bool [chunks, frames_per_chunk]: post-CNN frames that carry audio (the model keeps only these)."""
    chunk_lengths = mel_mask.reshape(-1, CHUNK_MEL_FRAMES).sum(-1).tolist()
    lengths = torch.tensor([_post_cnn_length(int(n)) for n in chunk_lengths], device=mel_mask.device)
    return torch.arange(frames_per_chunk, device=mel_mask.device)[None] < lengths[:, None]


class _EncoderStage:
    name = "audio_encoder"

    def __init__(self, backbone: Qwen3ASRBackbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        return stream["audio_frames"]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        kwargs = dict(stream["encoder_kwargs"])
        return module(h, kwargs.pop("cu_seqlens"), **kwargs)[0]

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        with torch.no_grad():
            stream["audio_states"] = self.backbone.model.model.audio_tower.ln_post(h)


class _ProjectorStage:
    name = "projector"

    def __init__(self, backbone: Qwen3ASRBackbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        return stream["audio_states"]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return module(h)

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        stream["audio_embeds"] = h


class _DecoderStage(SplicedDecoderStage):
    def __init__(self, backbone: Qwen3ASRBackbone, blocks: list[Block]) -> None:
        super().__init__(backbone, blocks)
        # Audio embeddings of windows whose audio path this run does not quantize (one encoding per window).
        self._fixed_audio: dict[int, torch.Tensor] = {}

    def _audio(self, window: Window, stream: dict) -> torch.Tensor:
        if "audio_embeds" in stream:  # left by the projector stage of this stream
            return stream["audio_embeds"]
        if "audio_states" in stream:  # the audio tower was quantized, the projector was not
            with torch.no_grad():
                return self.backbone.model.model.multi_modal_projector(stream["audio_states"])
        key = id(window)
        if key not in self._fixed_audio:
            self._fixed_audio[key] = self.backbone.audio_embeddings(window.inputs["input_features"],
                                                                    window.inputs["input_features_mask"])
        return self._fixed_audio[key]

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        with torch.no_grad():
            stream["decoder_out"] = self.backbone.model.model.language_model.norm(h)


# ----------------------------------------------------------------------------------------------------- checkpoint
def qwen3_asr_checkpoint(backbone: Qwen3ASRBackbone, lattice: dict[str, QuantizedWeight], spec: LatticeSpec,
                         metadata: dict) -> LatticeCheckpoint:
    """Lattice weights, every other tensor untouched (in its own dtype), the tied embedding as an alias of the
    lm_head lattice (or, with an untouched head, lm_head as an alias of the embedding), and the model files."""
    files = saved_files(backbone.model.config, backbone.model.generation_config, backbone.processor)
    return checkpoint_from_model(backbone.model, lattice, spec, metadata, files)


def load_qwen3_asr(directory: str | Path, dtype: torch.dtype | str = torch.float32
                   ) -> tuple[Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor]:
    """(model, processor) from a transformers Qwen3-ASR directory (config.json with model_type "qwen3_asr");
    ``dtype="auto"``: as the directory stores its weights."""
    model = Qwen3ASRForConditionalGeneration.from_pretrained(directory, dtype=dtype).eval()
    return model, Qwen3ASRProcessor.from_pretrained(directory)


def load_qwen3_asr_backbone(source: str | Path, device: str = "cpu", head_identity_weight: float = 1.0,
                            quantize_audio_tower: bool = True, dtype: torch.dtype | str = torch.float32
                            ) -> Qwen3ASRBackbone:
    """The backbone for a transformers Qwen3-ASR directory, as tarq_deploy.calibration.pipeline.quantize_backbone takes it."""
    return Qwen3ASRBackbone(*load_qwen3_asr(source, dtype), device, head_identity_weight=head_identity_weight,
                            quantize_audio_tower=quantize_audio_tower)


def load_dequantized_qwen3_asr(checkpoint: str | Path | LatticeCheckpoint, dtype: torch.dtype = torch.float32
                               ) -> tuple[Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor]:
    """(model, processor) with every lattice weight replaced by its exact value s * q (cast to ``dtype``); the tied
    embedding and lm_head are the same lattice matrix, as in the exported runtime files."""
    ckpt = checkpoint if isinstance(checkpoint, LatticeCheckpoint) else load_checkpoint(checkpoint)
    from transformers import GenerationConfig, Qwen3ASRConfig

    with model_files_dir(ckpt) as tmp:
        config = Qwen3ASRConfig.from_pretrained(tmp)
        processor = Qwen3ASRProcessor.from_pretrained(tmp)
        generation_config = GenerationConfig.from_pretrained(tmp)
    model = Qwen3ASRForConditionalGeneration(config)
    load_lattice_weights(model, ckpt, "Qwen3-ASR")
    model.generation_config = generation_config
    return model.to(dtype).eval(), processor
