"""transformers Whisper in PyTorch, on CPU (or CUDA): a plain model (``packaged:NAME``, a transformers or CTranslate2
directory, a hub id), a lattice checkpoint directory (every lattice weight dequantized to s * q, the tied token
embedding / output projection honoured), or a whisper.cpp model file dequantized tensor by tensor (so ggml's own Q4_0
rounding can be run in PyTorch too; its tokenizer and configs come from a companion model, ``--tokenizer``).

Decode profiles (runtimes/decoding.py). ``greedy``: ``<|startoftranscript|> [<|en|> <|transcribe|>]
<|notimestamps|>`` as the decoder prompt (the multilingual models need the language and task tokens or they loop), no
sampling, one beam, no temperature fallback. ``cli``: transformers' own Whisper generation with whisper-cli's settings
(5 beams, temperature fallback, thresholds, timestamps, the previous window's text as context); a sampled fallback is
seeded per utterance, so the same audio gives the same text. A recording longer than 30 s is decoded whole by
transformers' sequential long-form generation (under ``greedy`` too, with timestamps, which long-form needs, and no
fallback). It claims every source no other runtime claims.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UserError
from ..model_source import ModelSource, SourceKind, resolve_source
from .base import SAMPLE_RATE, DecodeOptions, ModelSpec, RuntimeAdapter, torch_stack_info
from .decoding import GREEDY, profile_named

if TYPE_CHECKING:
    import numpy as np
    import torch
    from transformers.cache_utils import Cache, DynamicCache

__all__ = ["NAME", "load_torch_bundle"]

NAME = "torch"
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's window; longer input is long-form generation
FALLBACK_SEED = 0  # torch's generator before each utterance: sampled fallbacks repeat exactly


class TorchTranscriber:
    """Transcription with a transformers Whisper model under a decode profile, one utterance at a time (batching
    did not pay off on CPU: the 30 s encoder pass dominates, and single items keep results independent of batch
    composition)."""

    def __init__(self, bundle, options: DecodeOptions, origin: dict) -> None:
        import torch

        from ..models.whisper import WhisperBackbone

        model, processor, generation_config = bundle
        torch.set_num_threads(options.threads)
        model._reorder_cache = reorder_beams  # generate's beam-search hook: see reorder_beams
        self.backbone = WhisperBackbone(model, processor, generation_config, options.device)
        self.backbone.language = options.language  # a multilingual model's prompt names it
        self.generation_config = _greedy_config(generation_config, options.max_new_tokens)
        self.profile = profile_named(options.profile)
        self.prompt = torch.tensor([self.backbone.prompt_ids()], device=self.backbone.device)
        self.origin = {**origin, "threads": options.threads, "device": options.device,
                       "max_new_tokens": options.max_new_tokens, "decode": self.profile.name,
                       **({"language": options.language} if options.language != "en" else {}),
                       "generate": {k: list(v) if isinstance(v, tuple) else v for k, v in self.profile.torch.items()}}

    def transcribe(self, audio: "np.ndarray", utterance_id: str) -> str:
        import torch

        long_form = len(audio) > WINDOW_SAMPLES
        with torch.inference_mode():
            if self.profile.name == GREEDY and not long_form:  # the research path, byte for byte as before
                ids = self.backbone.model.generate(self._features(audio), decoder_input_ids=self.prompt,
                                                   generation_config=self.generation_config)
            else:
                torch.manual_seed(FALLBACK_SEED)
                ids = self._generate_profile(audio, long_form)
        return self.backbone.processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip()

    def _generate_profile(self, audio: "np.ndarray", long_form: bool):
        """transformers' Whisper generation with the profile's options; long audio as one long-form input (its
        attention mask tells generate where the audio ends)."""
        options = dict(self.profile.torch)
        if long_form:
            options["return_timestamps"] = True  # long-form generation seeks by the predicted timestamps
        extra = {}
        if long_form:
            processor = self.backbone.processor
            inputs = processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                                 truncation=False, padding="longest", return_attention_mask=True)
            features = inputs.input_features.to(self.backbone.device)
            extra["attention_mask"] = inputs.attention_mask.to(self.backbone.device)
        else:
            features = self._features(audio)
        gc = self.backbone.generation_config
        if getattr(gc, "is_multilingual", False):
            extra.update(language=self.backbone.language, task="transcribe")
        config = self.generation_config.__class__.from_dict(self.generation_config.to_dict())
        config.num_beams = options.pop("num_beams")
        config.do_sample = options.pop("do_sample")
        if options.get("condition_on_prev_tokens"):
            # transformers keeps up to half the text context (224) of previous text plus the start token: one less
            # new token keeps prompt + output within the decoder's 448 positions
            config.max_new_tokens = min(config.max_new_tokens,
                                        self.backbone.model.config.max_target_positions // 2 - 1)
        return self.backbone.model.generate(features, generation_config=config, **options, **extra)

    def continuation_margin(self, audio: "np.ndarray", other_text: str) -> float | None:
        """How close a disagreement is to a tie for this model: at the first token where its own greedy transcript
        and ``other_text`` part, log p(own token) - log p(other's token) given the shared prefix (teacher forcing,
        raw log-probabilities). A margin near zero is a near-tie that tiny numerical differences between runtimes can
        flip; None when the token sequences do not differ."""
        import torch

        features = self._features(audio)
        with torch.inference_mode():
            generated = self.backbone.model.generate(features, decoder_input_ids=self.prompt,
                                                     generation_config=self.generation_config)[0].tolist()
            prompt, eos = self.prompt[0].tolist(), self.backbone.generation_config.eos_token_id
            if generated[: len(prompt)] == prompt:  # transformers returns the new tokens only, older versions all
                generated = generated[len(prompt):]
            own = [t for t in generated if t != eos]
            other = self.backbone.processor.tokenizer.encode(" " + other_text.strip(), add_special_tokens=False)
            split = next((i for i, (x, y) in enumerate(zip(own, other)) if x != y), min(len(own), len(other)))
            if split == len(own) == len(other):
                return None
            prefix = torch.cat([self.prompt, torch.tensor([own[:split]], dtype=self.prompt.dtype,
                                                          device=self.prompt.device)], dim=1)
            logits = self.backbone.model(input_features=features, decoder_input_ids=prefix).logits[0, -1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        own_next = own[split] if split < len(own) else eos
        other_next = other[split] if split < len(other) else eos
        return float(log_probs[own_next] - log_probs[other_next])

    def _features(self, audio: "np.ndarray"):
        processor = self.backbone.processor
        features = processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        return features.to(self.backbone.device)

    def describe(self) -> dict:
        return self.origin

    def close(self) -> None:
        self.backbone = None  # type: ignore[assignment]


def reorder_beams(cache: "Cache", beam_idx: "torch.Tensor") -> "Cache":
    """Beam search's cache reorder (transformers calls a model's ``_reorder_cache`` instead of the cache's own):
    the self-attention cache follows the beams; the cross-attention cache is left as it is when every row of it is
    the same bits, which makes picking rows among them a no-op. It is so for one utterance at a time (our only
    batch): every beam's keys and values are the projections of one encoder output, copied to the beams before the
    first step and never written again. Copying them anyway cost 17 % of a whisper-cli-profile decode (5 beams x
    1500 frames x every layer, at every step; tiny.en, CPU). The rows are compared once per cache; any difference
    (a batch of several utterances) reorders the whole cache as transformers does."""
    from transformers.cache_utils import EncoderDecoderCache

    if not isinstance(cache, EncoderDecoderCache):
        cache.reorder_cache(beam_idx)
        return cache
    shared = getattr(cache, "_tarq_cross_rows_shared", None)
    if shared is None:
        shared = cache._tarq_cross_rows_shared = _rows_are_one(cache.cross_attention_cache)
    if shared:
        cache.self_attention_cache.reorder_cache(beam_idx)
    else:
        cache.reorder_cache(beam_idx)
    return cache


def _rows_are_one(cross_cache: "DynamicCache") -> bool:
    """Whether every layer's cross-attention keys and values hold the same bits in every batch row."""
    import torch

    layers = getattr(cross_cache, "layers", None)
    if not layers:
        return False
    for layer in layers:
        if not getattr(layer, "is_initialized", False):
            return False
        for t in (layer.keys, layer.values):
            if t is None or t.dim() == 0 or t.shape[0] == 0:
                return False
            bits = t.contiguous().view(-1).view(torch.uint8)
            rows = bits.view(t.shape[0], -1)
            if not bool((rows == rows[:1]).all()):
                return False
    return True


def _greedy_config(generation_config, max_new_tokens: int):
    config = generation_config.__class__.from_dict(generation_config.to_dict())
    config.do_sample, config.num_beams, config.max_new_tokens, config.max_length = False, 1, max_new_tokens, None
    config.temperature = None
    return config


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def open_torch(spec: ModelSpec, options: DecodeOptions) -> TorchTranscriber:
    found = resolve_source(spec.source)
    bundle, loaded_as = load_torch_bundle(spec, found)
    whisper_cpp = found.kind is SourceKind.WHISPER_CPP or _is_transcribe_whisper(found)
    origin = {"loaded_as": loaded_as, **({"tokenizer": spec.tokenizer} if whisper_cpp else {})}
    return TorchTranscriber(bundle, options, origin)


def load_torch_bundle(spec: ModelSpec, found: ModelSource | None = None) -> tuple[tuple, str]:
    """(model, processor, generation_config) of any source this runtime takes, and how it was loaded: a lattice
    checkpoint (s * q exactly), a whisper.cpp file (dequantized by gguf-py) or a float model. ``found``: the spec's
    source, when the caller has resolved it already."""
    _quiet_transformers()
    source = spec.source
    found = resolve_source(source if found is None else found)
    try:
        if found.kind is SourceKind.CHECKPOINT:
            from ..models.from_checkpoint import load_dequantized_whisper

            return load_dequantized_whisper(source), "lattice checkpoint, dequantized (s * q)"
        if found.kind is SourceKind.WHISPER_CPP:
            return load_whisper_cpp_in_torch(source, spec.tokenizer), "whisper.cpp file, dequantized"
        if _is_transcribe_whisper(found):
            return load_transcribe_whisper_in_torch(source, spec.tokenizer), "transcribe.cpp file, dequantized"
        from ..formats.model_loader import load_whisper

        return load_whisper(found), "float model"
    except (ValueError, OSError) as error:
        raise UserError(f"model {spec.label!r} ({source}): cannot load it for the torch backend: {error}") from None


def load_whisper_cpp_in_torch(path: str, companion: str | None):
    """A transformers Whisper whose every tensor is the whisper.cpp file's value (dequantized by gguf-py);
    config, generation config and tokenizer come from ``companion`` (any source load_whisper takes, or a lattice
    checkpoint), which must have the file's dimensions and vocabulary size."""
    import torch

    from tarq_deploy.formats.ggml_file import read_whisper_cpp, tensor_slots

    if companion is None:
        raise UserError(f"{path}: the torch backend needs a tokenizer and config for a whisper.cpp file; give "
                        f"--tokenizer SOURCE (e.g. packaged:tiny.en)")
    model, processor, generation_config = _load_companion(companion)
    ggml = read_whisper_cpp(path)
    expected = _hparams_of(model.config, ggml.hparams.weight_type)
    if not ggml.hparams.same_model(expected):
        raise UserError(f"{path}: its dimensions {ggml.hparams.ints()[:-1]} differ from --tokenizer {companion}'s "
                        f"{expected.ints()[:-1]}")
    state = {}
    for slot in tensor_slots(ggml.hparams):
        values = torch.from_numpy(ggml.dequantize(slot.name).copy())
        state[slot.hf_name] = values.reshape(model.state_dict()[slot.hf_name].shape)
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]  # tied, as whisper.cpp computes logits
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{path}: tensors do not fit the Whisper model (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]})")
    return model.float().eval(), processor, generation_config


def _is_transcribe_whisper(found: ModelSource) -> bool:
    from tarq_deploy.formats.transcribe_whisper import ARCH

    return found.kind is SourceKind.GGUF and found.architecture == ARCH


def load_transcribe_whisper_in_torch(path: str, companion: str | None):
    """A transformers Whisper whose every tensor is the transcribe.cpp GGUF's value (dequantized by gguf-py), so the
    teacher-forced figures of a sweep's score step measure the file a user runs; config and tokenizer from
    ``companion`` as for a whisper.cpp file."""
    import torch

    from tarq_deploy.formats.gguf_file import read_gguf
    from tarq_deploy.formats.transcribe_whisper import tensor_slots

    if companion is None:
        raise UserError(f"{path}: the torch backend needs a tokenizer and config for a transcribe.cpp file; give "
                        f"--tokenizer SOURCE (e.g. packaged:base)")
    model, processor, generation_config = _load_companion(companion)
    gguf = read_gguf(path)
    wanted = model.state_dict()
    state = {}
    for slot in tensor_slots(model.config.to_dict()):
        record = gguf.tensors.get(slot.name)
        if record is None or record.shape != tuple(slot.shape) or slot.hf_name not in wanted:
            raise UserError(f"{path}: tensor {slot.name} is missing or not of --tokenizer {companion}'s shape "
                            f"{tuple(slot.shape)}")
        state[slot.hf_name] = torch.from_numpy(gguf.dequantize(slot.name).copy()).reshape(wanted[slot.hf_name].shape)
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]  # tied: the runtime's logits use it
    model.load_state_dict(state, strict=False)
    return model.float().eval(), processor, generation_config


def _load_companion(source: str):
    found = resolve_source(source)
    if found.kind is SourceKind.CHECKPOINT:
        from ..models.from_checkpoint import load_dequantized_whisper

        return load_dequantized_whisper(source)
    from ..formats.model_loader import load_whisper

    return load_whisper(found)


def _hparams_of(config, weight_type: int):
    from tarq_deploy.formats.ggml_file import WhisperHParams

    return WhisperHParams.from_config(config.to_dict(), weight_type)


def _claims_everything(source: str | ModelSource) -> bool:
    return True  # the fallback: inference asks the other runtimes first


ADAPTER = RuntimeAdapter(NAME, "transformers Whisper (float model, lattice checkpoint or whisper.cpp file dequantized)",
                         _claims_everything, open_torch, torch_stack_info)
