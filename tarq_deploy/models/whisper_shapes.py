"""Real Whisper shapes with random weights: every size's widths, mel bins and vocabulary, for the runs that need a
model of the real dimensions where no checkpoint is at hand (offline only tiny.en and base ship real weights).

large-v3 and large-v3-turbo differ from base in two ways a random model must keep to exercise the real paths: 128
mel bins, and a 51,866-token vocabulary (one more language, <|yue|>, at 50358, which moves every special token after
it up by one). ``v3_vocabulary`` makes that tokenizer and generation config from base's multilingual ones.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["V3_VOCAB_SIZE", "WHISPER_DIMS", "YUE_ID", "random_whisper", "v3_vocabulary"]

WHISPER_DIMS: dict[str, dict[str, int]] = {  # smallest first (parameters)
    "tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                 decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80),
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                 decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, num_mel_bins=80),
    "small": dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, num_mel_bins=80),
    "medium": dict(d_model=1024, encoder_layers=24, decoder_layers=24, encoder_attention_heads=16,
                   decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, num_mel_bins=80),
    "large-v3-turbo": dict(d_model=1280, encoder_layers=32, decoder_layers=4, encoder_attention_heads=20,
                           decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128),
    "large-v3": dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                     decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128),
}
V3_VOCAB_SIZE = 51866
YUE_ID = 50358  # <|yue|>: large-v3's hundredth language, inserted before <|translate|>


def v3_vocabulary(processor, generation_config):
    """(processor, generation config) of large-v3's vocabulary, made from base's multilingual ones: <|yue|> inserted
    at 50358 and every special token from there on moved up by one, as in large-v3's own tokenizer."""
    from transformers import WhisperTokenizerFast

    spec = json.loads(processor.tokenizer.backend_tokenizer.to_str())
    for token in spec["added_tokens"]:
        token["id"] += token["id"] >= YUE_ID
    spec["added_tokens"].append({"id": YUE_ID, "content": "<|yue|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    spec["added_tokens"].sort(key=lambda t: t["id"])
    spec["post_processor"] = _shifted(spec.get("post_processor"))
    tokenizer = WhisperTokenizerFast(tokenizer_object=_tokenizer_from_json(spec))
    if len(tokenizer) != V3_VOCAB_SIZE or tokenizer.convert_ids_to_tokens(YUE_ID) != "<|yue|>":
        raise AssertionError(f"the v3 tokenizer came out with {len(tokenizer)} tokens")
    processor = type(processor)(feature_extractor=processor.feature_extractor, tokenizer=tokenizer)
    config = _shifted_generation_config(generation_config)
    return processor, config


def _tokenizer_from_json(spec: dict):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(spec))


def _shift(token_id: int) -> int:
    return token_id + 1 if token_id >= YUE_ID else token_id


def _shifted(node: Any) -> Any:
    """A post-processor's special-token ids moved past <|yue|> (the template's own ids)."""
    if isinstance(node, dict):
        return {k: ([_shift(i) for i in v] if k == "ids" and isinstance(v, list) else _shifted(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_shifted(v) for v in node]
    return node


def _shifted_generation_config(generation_config):
    config = type(generation_config).from_dict(generation_config.to_dict())
    for key in ("no_timestamps_token_id", "prev_sot_token_id"):
        if getattr(config, key, None) is not None:
            setattr(config, key, _shift(getattr(config, key)))
    for key in ("suppress_tokens", "begin_suppress_tokens"):
        if getattr(config, key, None) is not None:
            setattr(config, key, [_shift(i) for i in getattr(config, key)])
    config.task_to_id = {task: _shift(i) for task, i in config.task_to_id.items()}
    config.lang_to_id = {**config.lang_to_id, "<|yue|>": YUE_ID}
    return config


def random_whisper(dims: str | dict[str, int], processor, generation_config, *, seed: int = 0,
                   dtype: "torch.dtype | None" = None, **overrides: int):
    """(model, processor, generation config): a Whisper of ``dims`` (a name of WHISPER_DIMS or the dimensions) with
    random weights in ``dtype`` (float32 by default); 128 mel bins get large-v3's vocabulary and a 128-bin feature extractor, the others
    the vocabulary of ``processor``. ``overrides`` replace dimensions (e.g. encoder_layers=1 for a short test)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    shape = {**(WHISPER_DIMS[dims] if isinstance(dims, str) else dims), **overrides}
    if shape["num_mel_bins"] == 128:
        processor, generation_config = v3_vocabulary(processor, generation_config)
    else:
        generation_config = copy.deepcopy(generation_config)
    vocab_size = len(processor.tokenizer)
    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=vocab_size, max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=generation_config.decoder_start_token_id,
                           eos_token_id=generation_config.eos_token_id, pad_token_id=generation_config.eos_token_id,
                           **shape)
    # Built in its dtype from the start: a float32 model cast afterwards would hold both copies for a moment
    # (large-v3: 6.2 + 3.1 GB), a peak no user loading a float16 checkpoint has.
    model = WhisperForConditionalGeneration._from_config(config, dtype=dtype or torch.float32).eval()
    features = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    processor = type(processor)(feature_extractor=features, tokenizer=processor.tokenizer)
    generation_config.alignment_heads = [[config.decoder_layers - 1, 0]]
    return model, processor, generation_config
