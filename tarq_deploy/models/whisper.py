"""Whisper backbone adapter: calibration windows with rare tags, the three calibration stages, transcription.

Calibration order: encoder blocks, decoder blocks, then the tied output head (proj_out, whose weight is also the
token embedding). Inside each block, true-sequential groups:
  encoder: [q, k, v] -> [out] -> [fc1] -> [fc2]
  decoder: [self q, k, v] -> [self out] -> [cross q, cross k, cross v] -> [cross out] -> [fc1] -> [fc2]
Cross-attention k/v read the encoder output of their own stream, so their positions are encoder frames.

Windows. Whisper always encodes 30 s (1500 encoder frames). A short utterance padded to 30 s is mostly padding, and
padding frames would dominate the encoder statistics. With ``pack=True`` (default) consecutive utterances are
concatenated into windows of up to 30 s (0.3 s silence between them, transcripts joined), the shape of Whisper's own
training segments: encoder statistics then come from speech, and calibration runs ~6x fewer encoder passes.
``pack=False`` keeps one utterance per window.

Rare tags. Decoder positions: the input position whose *predicted* token belongs to a rare word (data.rarity).
Encoder frames (``encoder_tagging="align"``): the frames of each rare word, found by dynamic time warping over the
cross-attention of the model's alignment heads on the teacher-forced transcript (the word-timestamp recipe);
``"none"`` tags no frame, so encoder Linears fall back to the plain metric.

The tied head: in a whisper.cpp Q4_0 file the token embedding is stored in Q4_0, and the same matrix serves as input
lookup and output projection. It is calibrated last, on the final decoder states, under H + mu * tr(H)/n * I: the
identity term is the lookup role's metric (every row's own error, unweighted by activations), balanced by trace
against the output role as rareBAL balances common and tail mass (mu = ``head_identity_weight``, default 1).
During calibration the decoder input embedding stays full precision in both streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from ..checkpoint import LatticeCheckpoint
from ..data.nonspeech import NONSPEECH_KINDS, NonspeechClip, build_nonspeech_clips
from ..data.rarity import DEFAULT_LANGUAGE, DEFAULT_ZIPF_THRESHOLD, TailRule, decoder_text, rare_token_mask, tail_rule
from ..quant.backbone import STREAM_KIND, Block, Window, input_of, run_capturing_inputs
from ..quant.lattice import LatticeSpec, QuantizedWeight
from ..quant.precision import compute_in, widened
from .common import (GAP_SECONDS, SAMPLE_RATE, WINDOW_SECONDS, HeadStage, TextAudio, checkpoint_from_model, joined,
                     pack_utterances, saved_files)
from .whisper_prompts import ShapedWindow, shape_of_window, stamped_window
from .whisper_rotation import rotate_heads

__all__ = ["ENCODER_FRAMES_PER_SECOND", "WhisperBackbone", "cross_attention_weights", "dtw_path", "dtw_paths",
           "round_conv_kernels_to_f16", "token_start_frames"]

ENCODER_FRAMES_PER_SECOND = 50
# the non-speech calibration windows' seed stream: seed + this, so that they share no samples with the clips of
# `corpus nonspeech --seed` (which draw from the seed itself) -- the held-out non-speech sets are made that way
NONSPEECH_SEED_BASE = 1_000_003
MEDIAN_FILTER_WIDTH = 7
ENCODER_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"], ["fc1"], ["fc2"]]
DECODER_GROUPS = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"],
    ["encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj"], ["encoder_attn.out_proj"],
    ["fc1"], ["fc2"],
]
CROSS_KV = {"encoder_attn.k_proj": "frames", "encoder_attn.v_proj": "frames"}


class WhisperBackbone:
    architecture = "whisper"
    tied_head = "proj_out.weight"  # the output head, which is also the decoder's token embedding

    def __init__(self, model: nn.Module, processor, generation_config, device: str = "cpu",
                 head_identity_weight: float = 1.0) -> None:
        self.model = model.to(device).eval()
        self.processor = processor
        self.generation_config = generation_config
        self.device = torch.device(device)
        self.head_identity_weight = head_identity_weight
        # The lookup pass (quant/pipeline.py): the tied head's dequantized lattice from a first calibration, which the
        # quantized stream's decoder looks its tokens up in; None: the model's own table in every stream
        self.quantized_lookup: torch.Tensor | None = None

    # -- segmenting a long recording ---------------------------------------------------------------------------------
    def timestamped_segments(self, audio) -> list:
        """The full-precision model's own segments of a recording longer than one window (data.segment.TimedText):
        transformers' long-form generation, greedy with timestamps, no fallback and no carried text, so the times
        are the model's and repeat exactly."""
        from ..data.segment import TimedText

        inputs = self.processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                                  truncation=False, padding="longest", return_attention_mask=True)
        language = {"language": self.language, "task": "transcribe"} if getattr(self.generation_config, "is_multilingual",
                                                                        False) else {}
        config = self.generation_config.__class__.from_dict(self.generation_config.to_dict())
        config.num_beams, config.do_sample = 1, False
        with torch.inference_mode():
            out = self.model.generate(inputs.input_features.to(self.device),
                                      attention_mask=inputs.attention_mask.to(self.device), generation_config=config,
                                      return_timestamps=True, return_segments=True, **language)
        tokenizer = self.processor.tokenizer
        return [TimedText(float(seg["start"]), float(seg["end"]),
                          tokenizer.decode(seg["tokens"], skip_special_tokens=True).strip())
                for seg in out["segments"][0]]

    # -- prompt and windows ------------------------------------------------------------------------------------------
    # The calibration transcripts' language (the tail rule's, set by build_windows): a multilingual model's prompt
    # names it, as a decode of that language would.
    language: str = DEFAULT_LANGUAGE

    def prompt_ids(self) -> list[int]:
        """<|startoftranscript|> [<|language|> <|transcribe|>] <|notimestamps|>: transcription in ``language``."""
        gc = self.generation_config
        ids = [gc.decoder_start_token_id]
        if getattr(gc, "is_multilingual", False):
            token = f"<|{self.language}|>"
            if token not in gc.lang_to_id:
                raise ValueError(f"this Whisper model has no language {self.language!r}")
            ids += [gc.lang_to_id[token], gc.task_to_id["transcribe"]]
        return ids + [gc.no_timestamps_token_id]

    def build_windows(self, utterances: list[TextAudio], k: float | TailRule = DEFAULT_ZIPF_THRESHOLD, pack: bool = True,
                      encoder_tagging: str = "align", keep_fp_bytes: int = 0,
                      compute_dtype: str = "float32", decoder_shape: str = "plain", nonspeech_share: float = 0.0,
                      seed: int = 0) -> list[Window]:
        """Calibration windows with their rare tags. ``keep_fp_bytes``: memory the alignment pass may keep. Its
        encoder and decoder are the calibration's full-precision stream through the encoder and decoder blocks, value
        for value (all run in ``compute_dtype``: precision.compute_in, by the stages' own code); when every Linear's
        input for every window fits (``fp_stream_bytes``), the windows keep them (``Window.fp_stream``) and the
        calibration does not run the fp blocks a second time. ``decoder_shape``: the token shape the decoder is
        calibrated on (models/whisper_prompts.py: plain, cli -- timestamps and the previous window's tokens carried,
        as whisper-cli decodes -- or both, alternating by window). ``nonspeech_share``: non-speech windows added, that
        share of the speech windows in number (``_nonspeech_windows``; ``seed`` draws their samples)."""
        if encoder_tagging not in ("align", "none"):
            raise ValueError(f"encoder tagging must be 'align' or 'none', got {encoder_tagging!r}")
        self.language = tail_rule(k).language
        pending: list[_PendingWindow] = []
        carried: list[int] | None = None if decoder_shape == "plain" else []
        for index, group in enumerate(pack_utterances(utterances, pack)):
            window = self._window(group, k, shape_of_window(decoder_shape, index), carried)
            carried = None if carried is None else window.carried
            pending.append(window)
        pending += self._nonspeech_windows(utterances, round(nonspeech_share * len(pending)), seed)
        if encoder_tagging == "align":
            kept = self.fp_stream_bytes(pending)
            # All or nothing, with room for the blocks' working set (about one encoder layer's worth). Keeping some
            # layers would raise the peaks measured for large-v3 and turbo, which keep none.
            keep = self.device.type == "cpu" and kept + kept // self.model.config.encoder_layers <= keep_fp_bytes
            with compute_in(compute_dtype, self.device):  # not the features: their mel product stays float32
                self._tag_rare_frames(pending, keep)
        return [p.window for p in pending]

    def fp_stream_bytes(self, pending: list[_PendingWindow]) -> int:
        """What the fp stream of ``pending`` takes in float32 when the alignment pass keeps it: per encoder frame and
        layer, q/k/v's input, out_proj's, fc1's (d each), fc2's (the MLP width) and the output (d); per decoder
        token and layer, the same with cross-attention's query and output besides (its keys and values read the
        encoder output, held once)."""
        config = self.model.config
        frames = 4 * config.d_model + config.encoder_ffn_dim
        tokens = 6 * config.d_model + config.decoder_ffn_dim
        per_window = frames * config.max_source_positions * config.encoder_layers + config.d_model * \
            config.max_source_positions
        return 4 * sum(per_window + tokens * p.window.info["tokens"] * config.decoder_layers for p in pending)

    def _window(self, group: list[TextAudio], k: float | TailRule, shape: str = "plain",
                carried: list[int] | None = None) -> _PendingWindow:
        """One calibration window of ``group`` in ``shape`` (plain or cli; ``carried``: see build_windows)."""
        audio, text = joined(group)
        features = self.processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        tagged = rare_token_mask(self.processor.tokenizer, self.prompt_ids(), decoder_text(text), k,
                                 eos_token_id=self.generation_config.eos_token_id)
        # ``carried`` is None when no window takes whisper-cli's shape; else every window works out its stamped
        # tokens, which the next window carries whichever shape this one takes
        stamped = None if carried is None else self._shaped(tagged, group, carried)
        plain = ShapedWindow(tagged.input_ids, tagged.mask, tagged.weights,
                             list(range(len(self.prompt_ids()) - 1, len(tagged.input_ids) - 1)),
                             stamped.carried if stamped else [])
        shaped = stamped if shape == "cli" and stamped is not None else plain
        ids = torch.tensor(shaped.ids[:-1])  # teacher forcing: the last token is only a label
        token_mask = _tail_tags(shaped.mask[:-1], shaped.weights[:-1])
        n_frames = self.model.config.max_source_positions
        speech_frames = min(n_frames, int(np.ceil(len(audio) / SAMPLE_RATE * ENCODER_FRAMES_PER_SECOND)))
        info = {"ids": [u.id for u in group], "seconds": len(audio) / SAMPLE_RATE, "speech_frames": speech_frames,
                "tokens": int(ids.numel()), "rare_tokens": int(token_mask.count_nonzero()), "rare_frames": 0,
                "words": len(tagged.words), "rare_words": sum(w.rare for w in tagged.words)}
        window = Window(inputs={"input_features": features, "decoder_input_ids": ids[None]},
                        masks={"tokens": token_mask, "frames": torch.zeros(n_frames, dtype=torch.bool)}, info=info)
        if shaped is stamped:
            info["decoder_shape"] = "cli"
        rare_spans = [(w.token_positions, w.weight) for w in tagged.words if w.rare and w.token_positions]
        return _PendingWindow(window, rare_spans, speech_frames, shaped.text_rows, shaped.carried)

    def _nonspeech_windows(self, utterances: list[TextAudio], count: int, seed: int) -> list[_PendingWindow]:
        """``count`` windows of 30 s without speech (data/nonspeech.py: silence, low noise, white, pink, babble of the
        calibration's own speech reversed, music), kinds in turn. Calibration otherwise shows the encoder only speech
        and the padding's digital silence, and the decoder only text to predict; here the prompt's last position
        predicts the end of text at once, as F16 does on noise, and cross-attention reads the encoder on noise --
        where the calibrated files invent words (results/cliform). Their samples come from a seed stream of their
        own (``NONSPEECH_SEED_BASE``), so they never repeat a `corpus nonspeech` clip of the same seed."""
        if count <= 0:
            return []
        per_kind = -(-count // len(NONSPEECH_KINDS))
        clips = build_nonspeech_clips(WINDOW_SECONDS, NONSPEECH_SEED_BASE + seed, per_kind,
                                      babble_sources=[u.audio for u in utterances])
        # build_nonspeech_clips lists them kind by kind; take clip n of every kind before clip n + 1 of any
        in_turn = [clips[kind * per_kind + number] for number in range(per_kind)
                   for kind in range(len(NONSPEECH_KINDS))]
        return [self._nonspeech_window(clip) for clip in in_turn[:count]]

    def _nonspeech_window(self, clip: NonspeechClip) -> _PendingWindow:
        features = self.processor.feature_extractor(clip.audio, sampling_rate=SAMPLE_RATE,
                                                    return_tensors="pt").input_features
        ids = torch.tensor(self.prompt_ids())  # teacher forcing: the prompt, whose last position predicts the end
        n_frames = self.model.config.max_source_positions
        info = {"ids": [f"nonspeech:{clip.id}"], "seconds": clip.seconds, "speech_frames": 0, "nonspeech": clip.kind,
                "tokens": int(ids.numel()), "rare_tokens": 0, "rare_frames": 0, "words": 0, "rare_words": 0}
        window = Window(inputs={"input_features": features, "decoder_input_ids": ids[None]},
                        masks={"tokens": torch.zeros(ids.numel(), dtype=torch.bool),
                               "frames": torch.zeros(n_frames, dtype=torch.bool)}, info=info)
        return _PendingWindow(window, [], 0, [], [])

    def _shaped(self, tagged, group: list[TextAudio], carried: list[int]) -> ShapedWindow:
        """``tagged`` (the plain shape) in whisper-cli's shape: each utterance a timestamped segment, ``carried``
        (the previous window's tokens) after <|startofprev|>."""
        gc, tokenizer = self.generation_config, self.processor.tokenizer
        counts = [len(tokenizer(decoder_text(u.text), add_special_tokens=False).input_ids) for u in group]
        return stamped_window(tagged.input_ids, tagged.mask, tagged.weights, len(self.prompt_ids()), counts,
                              [len(u.audio) / SAMPLE_RATE for u in group], GAP_SECONDS,
                              gc.no_timestamps_token_id + 1, carried, gc.prev_sot_token_id,
                              self.model.config.max_target_positions)

    # -- encoder frame tags ------------------------------------------------------------------------------------------
    def _tag_rare_frames(self, pending: list[_PendingWindow], keep: bool) -> None:
        """Tag the frames of each window's rare words (the windows without one need no alignment, unless the fp
        stream is kept for the calibration). The windows' DTWs run together (``token_start_frames``)."""
        aligned = pending if keep else [p for p in pending if p.rare_spans]
        encoded = self._encode(aligned, keep)
        tagged = [(p, attention) for p, attention in zip(aligned, self._decode(aligned, encoded, keep))
                  if p.rare_spans]
        matrices = [self._alignment_matrix(attention, p.speech_frames, p.text_rows) for p, attention in tagged]
        for (p, _), starts in zip(tagged, token_start_frames(matrices)):
            mask = self._rare_frames(starts, p)
            p.window.masks["frames"] = mask
            p.window.info["rare_frames"] = int(mask.count_nonzero())

    def _encode(self, pending: list[_PendingWindow], keep: bool) -> list[torch.Tensor]:
        """The full-precision encoder output of each window, by the encoder stage's own code: the values of the
        calibration's fp stream. With ``keep``, each window also keeps every layer's Linear inputs and output."""
        stage = _EncoderStage(self, [])
        streams: list[dict] = [{} for _ in pending]
        with torch.no_grad():
            hidden = [stage.enter(p.window, s) for p, s in zip(pending, streams)]
            layers = self.model.model.encoder.layers
            for _ in _fp_layers(stage, layers, "model.encoder.layers", pending, hidden, streams,
                                ENCODER_GROUPS if keep else [], keep):
                pass
            for h, p, stream in zip(hidden, pending, streams):
                stage.leave(h, p.window, stream)
        return [stream["encoder_out"] for stream in streams]

    def _decode(self, pending: list[_PendingWindow], encoded: list[torch.Tensor],
                keep: bool) -> list[torch.Tensor | None]:
        """The full-precision decoder on each window's teacher-forced tokens over its encoder output, by the decoder
        stage's own code (the calibration's fp stream, value for value). Returns each window's alignment-head
        cross-attention [heads, tokens, frames] (None for a window without rare words). With ``keep``, each window
        also keeps every layer's Linear inputs and output; else the pass stops after the last layer that holds an
        alignment head."""
        heads = [tuple(pair) for pair in self.generation_config.alignment_heads]
        layers = self.model.model.decoder.layers
        depth = len(layers) if keep else 1 + max(layer for layer, _ in heads)
        stage = _DecoderStage(self, [])
        streams = [{"encoder_out": e} for e in encoded]
        found: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in pending]
        with torch.no_grad():
            hidden = [stage.enter(p.window, s) for p, s in zip(pending, streams)]
            passes = _fp_layers(stage, layers[:depth], "model.decoder.layers", pending, hidden, streams,
                                DECODER_GROUPS if keep else [["encoder_attn.q_proj"]], keep)
            for index, layer, j, inputs in passes:
                own = [head for at, head in heads if at == index]
                if own and pending[j].rare_spans:
                    weights = cross_attention_weights(layer.encoder_attn, inputs["encoder_attn.q_proj"], encoded[j],
                                                      own)
                    found[j].update({(index, head): w for head, w in zip(own, weights)})
        return [torch.stack([f[head] for head in heads]) if f else None for f in found]

    def _rare_frames(self, starts: list[int], p: _PendingWindow) -> torch.Tensor:
        """The frames of ``p``'s rare words, from the frame where the alignment reaches each text token."""
        weighted = any(weight != 1.0 for _, weight in p.rare_spans)
        mask = torch.zeros(self.model.config.max_source_positions, dtype=torch.float32 if weighted else torch.bool)
        n_prompt = len(self.prompt_ids())
        for span, weight in p.rare_spans:
            first, last = span[0] - n_prompt, span[-1] - n_prompt  # indices among the text tokens
            begin = starts[first]
            end = starts[last + 1] if last + 1 < len(starts) else p.speech_frames
            frames = slice(begin, max(end, begin + 1))
            mask[frames] = torch.clamp(mask[frames], min=weight) if weighted else True
        return mask

    def _alignment_matrix(self, attention: torch.Tensor, speech_frames: int, text_rows: list[int]) -> np.ndarray:
        """[text tokens + 1, speech frames]: the alignment heads' cross-attention [heads, tokens, frames] over the
        speech frames, standardised and median-filtered, averaged over the heads."""
        weights = attention.float().cpu()[:, :, :speech_frames]
        std, mean = torch.std_mean(weights, dim=-2, keepdim=True)
        weights = _median_filter((weights - mean) / (std + 1e-8), MEDIAN_FILTER_WIDTH)
        return weights.mean(0)[text_rows].numpy()  # rows: positions predicting text tokens and the end token

    # -- calibration stages ------------------------------------------------------------------------------------------
    def stages(self) -> list:
        m = self.model
        encoder = [Block(f"model.encoder.layers.{i}", layer, ENCODER_GROUPS, domain="frames")
                   for i, layer in enumerate(m.model.encoder.layers)]
        decoder = [Block(f"model.decoder.layers.{i}", layer, DECODER_GROUPS, domain_overrides=CROSS_KV)
                   for i, layer in enumerate(m.model.decoder.layers)]
        return [_EncoderStage(self, encoder), _DecoderStage(self, decoder),
                HeadStage("proj_out", m.proj_out, self.head_identity_weight)]

    def quantized_weight_names(self) -> list[str]:
        return [name for stage in self.stages() for b in stage.blocks for name in b.weight_names()]

    # -- exact rotation --------------------------------------------------------------------------------------------
    def rotate(self, kind: str, seed: int) -> dict:
        """Rotate the weights in place by ``kind`` ("heads": whisper_rotation.rotate_heads), before any calibration;
        the model's outputs do not change. Returns the record the checkpoint's manifest keeps."""
        if kind != "heads":
            raise ValueError(f"rotation {kind!r}: Whisper rotates 'heads' (whisper_rotation.py)")
        return rotate_heads(self.model, seed)

    # -- checkpoint ------------------------------------------------------------------------------------------------
    def checkpoint(self, lattice: dict[str, QuantizedWeight], spec: LatticeSpec, metadata: dict) -> LatticeCheckpoint:
        """Lattice weights, every other tensor untouched (float32, as the exporters and PyTorch backends read them,
        whatever precision the model is held in), the tied token embedding as an alias of proj_out."""
        files = saved_files(self.model.config, self.generation_config, self.processor)
        return checkpoint_from_model(self.model, lattice, spec, metadata, files, widen=True)

    # -- transcription -----------------------------------------------------------------------------------------------
    def transcribe(self, audio: np.ndarray, max_new_tokens: int = 200) -> str:
        features = self.processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        prompt = torch.tensor([self.prompt_ids()], device=self.device)
        with torch.no_grad():
            ids = self.model.generate(features.to(self.device), decoder_input_ids=prompt, max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=1, generation_config=self.generation_config)
        return self.processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip()


def _tail_tags(mask: list[bool], weights: list[float]) -> torch.Tensor:
    """The tail tags of a window's positions: booleans, or the tail weights (0: untagged) where a term is weighted
    (quant/stats.py counts a tagged position's products that many times)."""
    if all(w == 1.0 for w, m in zip(weights, mask) if m):
        return torch.tensor(mask, dtype=torch.bool)
    return torch.tensor([w if m else 0.0 for m, w in zip(mask, weights)], dtype=torch.float32)


@dataclass
class _PendingWindow:
    """A window whose encoder frames are still to be tagged: the token positions of each rare word, and how many
    encoder frames hold speech."""

    window: Window
    rare_spans: list[tuple[tuple[int, ...], float]]  # (the word's token positions, its tail weight)
    speech_frames: int
    text_rows: list[int]  # the decoder positions predicting the text tokens and the end token
    carried: list[int]  # the tokens the next window carries in whisper-cli's shape


def _fp_layers(stage, layers: nn.ModuleList, prefix: str, pending: list[_PendingWindow], hidden: list[torch.Tensor],
               streams: list[dict], groups: list[list[str]], keep: bool):
    """Advance every window's hidden states (``hidden``, in place) through ``layers`` by the stage's own code, layer
    by layer over all windows (each layer widened to float32 once), capturing the inputs of the Linears in
    ``groups``. With ``keep``, each window keeps each layer's captured inputs and output (Window.fp_stream, under
    ``prefix.index``). Yields (layer index, layer, window index, captured inputs) after each window's pass, while
    the layer is still widened."""
    for index, layer in enumerate(layers):
        with widened(layer):
            for j, p in enumerate(pending):
                run = partial(stage.call_block, layer, hidden[j], p.window, streams[j])
                inputs, hidden[j] = run_capturing_inputs(layer, groups, run)
                if keep:
                    p.window.fp_stream[f"{prefix}.{index}"] = (inputs, hidden[j])
                yield index, layer, j, inputs


def round_conv_kernels_to_f16(model: nn.Module) -> int:
    """Round the encoder's input convolution kernels to fp16 values, in place (the tensors keep their dtype); returns
    how many values changed. Every runtime file stores these kernels in F16 (ggml's convolutions take F16 kernels),
    so a float32 or bfloat16 source is calibrated, and checkpointed, with the kernels the files will hold: an export
    then copies them exactly and ``verify`` finds no difference. A float16-born source changes nothing."""
    changed = 0
    encoder = model.model.encoder
    with torch.no_grad():
        for conv in (encoder.conv1, encoder.conv2):
            rounded = conv.weight.to(torch.float16).to(conv.weight.dtype)
            changed += int((rounded != conv.weight).sum())
            conv.weight.copy_(rounded)
    return changed


def token_start_frames(matrices: list[np.ndarray]) -> list[list[int]]:
    """For each matrix [tokens, frames]: the frame where the DTW path through -matrix first reaches each token row."""
    found = []
    paths = dtw_paths([-matrix.astype(np.float64) for matrix in matrices])
    for matrix, (text_idx, time_idx) in zip(matrices, paths):
        starts = [0] * matrix.shape[0]
        seen = set()
        for t, f in zip(text_idx, time_idx):
            if t not in seen:
                seen.add(t)
                starts[t] = int(f)
        found.append(starts)
    return found


DTW_BATCH = 16  # cost matrices whose recurrences run together: ~50 MB of float64 sums for 30 s windows


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotonic alignment of one cost matrix [n, m] minimising the summed cost (see ``dtw_paths``)."""
    return dtw_paths([cost])[0]


def dtw_paths(costs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each cost matrix [n, m]: the monotonic alignment minimising the summed cost (steps: diagonal, down, right;
    ties in that order), as (row indices, column indices).

    The accumulated cost of a cell needs only cells of the two anti-diagonals before it, so each anti-diagonal is
    computed at once, and for up to DTW_BATCH matrices at once, padded to the largest (n + m vector steps per batch
    instead of n * m Python steps per matrix: a window of 100 tokens x 1500 frames took a second). A cell inside a
    matrix reads only cells inside it, so the padding never reaches a path; the sums and the tie-breaking are those
    of the cell-by-cell recurrence, so each path is the same."""
    paths = []
    for start in range(0, len(costs), DTW_BATCH):
        batch = costs[start : start + DTW_BATCH]
        step = _dtw_steps(batch)
        paths += [_backtrack(step[b], *cost.shape) for b, cost in enumerate(batch)]
    return paths


def _dtw_steps(costs: list[np.ndarray]) -> np.ndarray:
    """The recurrence's chosen step per cell, [matrices, n + 1, m + 1] (0 diagonal, 1 down, 2 right)."""
    n, m = (max(cost.shape[axis] for cost in costs) for axis in (0, 1))
    padded = np.zeros((len(costs), n, m))
    for b, cost in enumerate(costs):
        padded[b, : cost.shape[0], : cost.shape[1]] = cost
    acc = np.full((len(costs), n + 1, m + 1), np.inf)
    acc[:, 0, 0] = 0.0
    step = np.zeros((len(costs), n + 1, m + 1), dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        choices = np.stack([acc[:, i - 1, j - 1], acc[:, i - 1, j], acc[:, i, j - 1]])
        k = np.argmin(choices, axis=0)
        acc[:, i, j] = padded[:, i - 1, j - 1] + np.take_along_axis(choices, k[None], axis=0)[0]
        step[:, i, j] = k
    return step


def _backtrack(step: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    i, j = n, m
    path = []
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        k = step[i, j]
        i, j = (i - 1, j - 1) if k == 0 else (i - 1, j) if k == 1 else (i, j - 1)
    path.reverse()
    return np.array([p[0] for p in path]), np.array([p[1] for p in path])


# A selection network for the median of 7 (Whisper's filter width): 13 compare-exchanges after which position 3
# holds the median, where sorting all seven by odd-even transposition takes 21 (twice as fast on base's alignment).
MEDIAN_OF_7 = ((0, 5), (0, 3), (1, 6), (2, 4), (0, 1), (3, 5), (2, 6), (2, 3), (3, 6), (4, 5), (1, 4), (1, 3), (3, 4))


def _median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """The running median over the last dimension (odd ``width``, reflected edges). Found by compare-exchanges of
    the ``width`` shifted views elementwise (min/max: the median network for 7, else odd-even transposition, whose
    ``width`` rounds sort any ``width`` values) and taking the middle one: the same values as a median of the
    unfolded windows, several times faster here."""
    if width % 2 == 0:
        raise ValueError(f"median filter width must be odd, got {width}")
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = nn.functional.pad(x, (pad, pad), mode="reflect")
    views = [padded[..., k : k + x.shape[-1]] for k in range(width)]
    pairs = MEDIAN_OF_7 if width == 7 else \
        [(k, k + 1) for round_ in range(width) for k in range(round_ % 2, width - 1, 2)]
    for low, high in pairs:
        views[low], views[high] = torch.minimum(views[low], views[high]), torch.maximum(views[low], views[high])
    return views[pad]


def cross_attention_weights(attention: nn.Module, x: torch.Tensor, encoded: torch.Tensor,
                            heads: list[int]) -> list[torch.Tensor]:
    """The softmax weights [tokens, frames] of ``heads`` of a Whisper cross-attention whose query projection reads
    ``x`` [tokens, d] and whose keys are projected from ``encoded`` [1, frames, d]: the module's own arithmetic
    (query scaled after its projection, then q k^T), for these heads only. The stream's forward passes use fused
    attention, which returns no weights."""
    size = attention.head_dim
    queries = (attention.q_proj(x) * attention.scaling).view(x.shape[0], -1, size).transpose(0, 1)
    keys = attention.k_proj(encoded[0]).view(encoded.shape[1], -1, size).transpose(0, 1)
    index = torch.tensor(heads)
    scores = torch.matmul(queries[index], keys[index].transpose(1, 2))
    return list(nn.functional.softmax(scores, dim=-1))


# --------------------------------------------------------------------------------------------------------- stages
class _EncoderStage:
    name = "encoder"

    def __init__(self, backbone: WhisperBackbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        enc = self.backbone.model.model.encoder
        with torch.no_grad():
            x = window.inputs["input_features"].to(self.backbone.device)
            x = nn.functional.gelu(enc.conv2(nn.functional.gelu(enc.conv1(x)))).permute(0, 2, 1)
            return x + enc.embed_positions.weight[: x.shape[1]]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return module(h, None)

    def steps(self, layer: nn.Module, h: torch.Tensor, window: Window, stream: dict):
        """``call_block`` group by group (WhisperEncoderLayer.forward's operations in its order; the attention by
        the module's own forward, up to out_proj), so a window runs through the block once."""
        # Every window's program is suspended at once between the steps, holding its locals: each tensor is let go
        # as soon as it is used (x, context); the block's input is held by the caller anyway.
        x = layer.self_attn_layer_norm(h)
        yield {"self_attn.q_proj": x, "self_attn.k_proj": x, "self_attn.v_proj": x}
        context = input_of(layer.self_attn.out_proj, lambda: layer.self_attn(hidden_states=x, attention_mask=None))
        del x
        yield {"self_attn.out_proj": context}
        h = h + layer.self_attn.out_proj(context)
        del context
        return (yield from _mlp_steps(layer, h, clamp_float16=True))

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        with torch.no_grad():
            stream["encoder_out"] = self.backbone.model.model.encoder.layer_norm(h)


class _DecoderStage:
    name = "decoder"

    def __init__(self, backbone: WhisperBackbone, blocks: list[Block]) -> None:
        self.backbone, self.blocks = backbone, blocks

    def enter(self, window: Window, stream: dict) -> torch.Tensor:
        """Token lookup plus positions. The quantized stream looks its tokens up in ``quantized_lookup`` where the
        backbone has one (the lookup pass: what the runtime's tied matrix will return); every other stream in the
        model's own table."""
        dec = self.backbone.model.model.decoder
        ids = window.inputs["decoder_input_ids"].to(self.backbone.device)
        lookup = self.backbone.quantized_lookup if stream.get(STREAM_KIND) == "q" else None
        with torch.no_grad():
            # the rows are taken where the table lives and only they move (not the table, once per window)
            tokens = dec.embed_tokens(ids) if lookup is None else lookup[ids.to(lookup.device)].to(self.backbone.device)
            return tokens + dec.embed_positions.weight[: ids.shape[1]]

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        return module(h, attention_mask=_causal_mask(h), encoder_hidden_states=stream["encoder_out"], use_cache=False)

    def steps(self, layer: nn.Module, h: torch.Tensor, window: Window, stream: dict):
        """``call_block`` group by group (WhisperDecoderLayer.forward's operations in its order)."""
        encoder_out = stream["encoder_out"]
        x = layer.self_attn_layer_norm(h)
        yield {"self_attn.q_proj": x, "self_attn.k_proj": x, "self_attn.v_proj": x}
        mask = _causal_mask(h)
        context = input_of(layer.self_attn.out_proj, lambda: layer.self_attn(x, cache=None, attention_mask=mask))
        del x, mask
        yield {"self_attn.out_proj": context}
        h = h + layer.self_attn.out_proj(context)
        x = layer.encoder_attn_layer_norm(h)
        yield {"encoder_attn.q_proj": x, "encoder_attn.k_proj": encoder_out, "encoder_attn.v_proj": encoder_out}
        context = input_of(layer.encoder_attn.out_proj, lambda: layer.encoder_attn(
            x, key_value_states=encoder_out, attention_mask=None, cache=None))
        del x
        yield {"encoder_attn.out_proj": context}
        h = h + layer.encoder_attn.out_proj(context)
        del context
        return (yield from _mlp_steps(layer, h))

    def leave(self, h: torch.Tensor, window: Window, stream: dict) -> None:
        with torch.no_grad():
            stream["decoder_out"] = self.backbone.model.model.decoder.layer_norm(h)


def _mlp_steps(layer: nn.Module, h: torch.Tensor, clamp_float16: bool = False):
    """The feed-forward half of a Whisper layer (its final_layer_norm, fc1, activation, fc2 and residual), yielding
    before fc1 and before fc2; returns the layer's output (an encoder layer clamps it in float16)."""
    x = layer.final_layer_norm(h)
    yield {"fc1": x}
    hidden = layer.activation_fn(layer.fc1(x))
    del x
    yield {"fc2": hidden}
    h = h + layer.fc2(hidden)
    if clamp_float16 and h.dtype == torch.float16:
        clamp = torch.finfo(h.dtype).max - 1000
        h = torch.clamp(h, min=-clamp, max=clamp)
    return h


def _causal_mask(h: torch.Tensor) -> torch.Tensor:
    t = h.shape[1]
    blocked = torch.triu(torch.ones(t, t, dtype=torch.bool, device=h.device), diagonal=1)
    return torch.zeros(1, 1, t, t, dtype=h.dtype, device=h.device).masked_fill(blocked, torch.finfo(h.dtype).min)
