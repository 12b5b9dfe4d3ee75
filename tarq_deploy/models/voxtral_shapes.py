"""A tiny, randomly initialised Voxtral with the real architecture and the real tokenizer *format*, built offline.

Model: ``VoxtralForConditionalGeneration`` from a ``VoxtralConfig`` whose shapes are small but keep every rule of
the real Voxtral-Mini-3B that the code depends on:
- audio encoder (Whisper-like): 128 mel bins, 1500 positions per 30 s chunk (so 3000 mel frames per chunk, as the
  feature extractor pads to 30 s), d_model 128, 2 layers, 4 heads; its ``intermediate_size`` is 4 x d_model because
  ``get_audio_features`` stacks 4 consecutive encoder frames into one projector input (375 audio tokens per chunk);
- language model (Llama): hidden 256, 2 layers, 8 query heads / 2 kv heads (the real 32 / 8 ratio), head_dim 32,
  intermediate 512, untied lm_head, rope theta 1e8. Every decoder Linear has K % 128 == 0 and N % 64 == 0, the shape
  rules of the GPTQ / Marlin writers (k_proj / v_proj: 256 -> 64).

Tokenizer: Voxtral ships a Mistral *tekken* file (``tekken.json``); without ``mistral-common`` installed, transformers
5.x converts it into a fast ``tokenizers`` BPE (``TokenizersBackend``), which is what gives character offsets for the
rare-word tags. The real file cannot be had offline, so we write a small one in the same format: 1000 special-token
slots with the Tekken names at their real ranks (<unk> 0, <s> 1, </s> 2, [INST] 3, [/INST] 4, <pad> 11, [AUDIO] 24,
[BEGIN_AUDIO] 25, [TRANSCRIBE] 34), the real Tekken pre-tokenizer pattern, and a byte-level BPE vocabulary (the 256
bytes, then merges learnt here, deterministically, from a built-in English text). Text token ids are therefore
1000 + rank, as in the real tokenizer, and the same transformers code path loads it.

``write_random_voxtral``: the published Voxtral-Mini-3B shapes (transformers' VoxtralConfig defaults: 32-layer
1280-wide audio encoder, 30-layer 3072-wide Llama with a 131,072-token untied head), random weights stored in
bfloat16 as the hub's are, with the same small tokenizer (its ids are a subset of the real vocabulary's): what the
calibration bench measures at real size.

Everything is seeded: the same call gives the same weights and files.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import regex
import torch
from transformers import (AutoTokenizer, GenerationConfig, VoxtralConfig, VoxtralForConditionalGeneration,
                          VoxtralProcessor, WhisperFeatureExtractor)

__all__ = ["AUDIO_TOKEN_ID", "load_tiny_voxtral", "write_random_voxtral", "write_tiny_voxtral"]

SEED = 0
NUM_SPECIAL_TOKENS = 1000  # Tekken reserves the first 1000 ids for control tokens
BPE_MERGES = 256
# The pre-tokenizer regex of Mistral's Tekken tokenizers (config.pattern of every tekken.json).
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Ranks of Tekken control tokens (mistral-common SpecialTokens; audio ranks as in Voxtral's tekken.json, where
# transformers' VoxtralProcessor also hard-codes [AUDIO] = 24). Unnamed ranks are filler "<SPECIAL_i>".
TEKKEN_SPECIALS = {
    0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]", 6: "[/AVAILABLE_TOOLS]",
    7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]", 10: "[IMG]", 11: "<pad>", 12: "[IMG_BREAK]",
    13: "[IMG_END]", 14: "[PREFIX]", 15: "[MIDDLE]", 16: "[SUFFIX]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]",
    19: "[TOOL_CONTENT]", 24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 34: "[TRANSCRIBE]",
}
AUDIO_TOKEN_ID = 24
BOS_ID, EOS_ID, PAD_ID = 1, 2, 11
# Training text for the BPE merges (written for this file): plain English prose, so that common words become one or
# two tokens while rare words stay split into several, as with a real tokenizer.
BPE_TEXT = """
The morning was cold and the river ran high under the old stone bridge. People walked to the market with their
baskets, and the children played in the street until their mothers called them home. In the evening the family sat
together at the table, talked about the work of the day and about the letters that had come from the city. There
was a good deal of news: the house on the hill had been sold, the school would open again in the spring, and the
doctor had married a young woman from the north. Nobody could say what the new owner of the house would do with it,
but everyone had an opinion. They were not rich, but they had what they needed, and they were happy to have it.
He said that he would consider the matter, and that he might be able to help them more than he had done before.
She thought it was a kind thing to say, though she did not believe he would do much for them in the end.
"""


# ------------------------------------------------------------------------------------------------------ tokenizer
def train_byte_bpe(text: str, n_merges: int) -> list[bytes]:
    """Byte-level BPE ranks: the 256 single bytes, then ``n_merges`` merged tokens in the order they were learnt.

    Pairs are counted inside Tekken pre-tokens; the most frequent pair wins, ties broken by the pair's bytes, so the
    result does not depend on hash order."""
    words = Counter(piece.encode() for piece in regex.findall(TEKKEN_PATTERN, text))
    split = {word: [bytes([b]) for b in word] for word in words}
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    while len(ranks) < 256 + n_merges:
        pairs: Counter = Counter()
        for word, count in words.items():
            pieces = split[word]
            for pair in zip(pieces, pieces[1:]):
                pairs[pair] += count
        candidates = [(count, pair) for pair, count in pairs.items() if pair[0] + pair[1] not in known]
        if not candidates:
            break
        best = min(candidates, key=lambda c: (-c[0], c[1]))[1]
        ranks.append(best[0] + best[1])
        known.add(ranks[-1])
        for word in split:
            split[word] = _merge(split[word], best)
    return ranks


def _merge(pieces: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    out, i = [], 0
    while i < len(pieces):
        if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == pair:
            out.append(pieces[i] + pieces[i + 1])
            i += 2
        else:
            out.append(pieces[i])
            i += 1
    return out


def tekken_json(ranks: list[bytes]) -> dict:
    """A tekken.json (the format mistral-common and transformers read) for the given BPE ranks."""
    specials = [{"rank": i, "token_str": TEKKEN_SPECIALS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
                for i in range(NUM_SPECIAL_TOKENS)]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(token).decode(), "token_str": None}
             for i, token in enumerate(ranks)]
    config = {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(ranks),
              "default_vocab_size": NUM_SPECIAL_TOKENS + len(ranks),
              "default_num_special_tokens": NUM_SPECIAL_TOKENS, "version": "v7"}
    return {"config": config, "vocab": vocab, "special_tokens": specials}


# ---------------------------------------------------------------------------------------------------------- model
def tiny_voxtral_config(vocab_size: int) -> VoxtralConfig:
    audio = {"model_type": "voxtral_encoder", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_mel_bins": 128, "max_source_positions": 1500}
    text = {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "max_position_embeddings": 4096, "rope_theta": 1e8, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    return VoxtralConfig(audio_config=audio, text_config=text, audio_token_id=AUDIO_TOKEN_ID)


def write_tiny_voxtral(directory: str | Path) -> Path:
    """Write a complete tiny Voxtral directory (weights, config, generation config, tekken.json, processor files)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ranks = train_byte_bpe(BPE_TEXT, BPE_MERGES)
    (out / "tekken.json").write_text(json.dumps(tekken_json(ranks)))
    config = tiny_voxtral_config(NUM_SPECIAL_TOKENS + len(ranks))
    torch.manual_seed(SEED)
    model = VoxtralForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # converts tekken.json, as for a real Voxtral directory
    VoxtralProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer).save_pretrained(out)
    return out


def write_random_voxtral(directory: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = SEED) -> Path:
    """Voxtral-Mini-3B's architecture with seeded random weights built and saved in ``dtype`` (float32 would be
    19 GB), the tokenizer and processor files of ``write_tiny_voxtral``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ranks = train_byte_bpe(BPE_TEXT, BPE_MERGES)
    (out / "tekken.json").write_text(json.dumps(tekken_json(ranks)))
    config = VoxtralConfig(audio_token_id=AUDIO_TOKEN_ID)
    config.text_config.pad_token_id = PAD_ID
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration._from_config(config, dtype=dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    VoxtralProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer).save_pretrained(out)
    return out


def load_tiny_voxtral(directory: str | Path) -> tuple[VoxtralForConditionalGeneration, VoxtralProcessor]:
    """(model in float32, processor) from a directory written by ``write_tiny_voxtral``."""
    model = VoxtralForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    return model, VoxtralProcessor.from_pretrained(directory)
