"""Tiny and real-dimension Qwen3-ASR models with the real architecture and the real Qwen tokenizer, built offline
(the tests' models, and the calibration bench's full-size random-weight ones).

Tokenizer. Qwen3-ASR uses the Qwen2 byte-level BPE (151643 regular tokens, 151387 merges) plus added control tokens.
No model hub is reachable here, but llama.cpp ships that vocabulary as a test fixture --
``vendor/llama.cpp/models/ggml-vocab-qwen2.gguf`` inside the llama-cpp-python 0.3.36 sdist -- with its tokenizer test
inputs and expected ids (``.inp`` / ``.out``). ``qwen_tokenizer_dir()`` fetches that sdist once through pip's configured
indexes (tarq_deploy.data.real_clips.download_distribution), keeps the three members in the cache
(``$TARQ_DEPLOY_CACHE/qwen2-vocab``, default ``~/.cache/tarq-deploy/qwen2-vocab``) and builds a transformers fast
tokenizer from them: the Qwen2 pre-tokenizer (NFC, the Qwen2 split pattern, byte-level), the BPE ranks, and the added
tokens at their real ids -- <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645 (in the vocabulary file) and
the three audio tokens Qwen3-ASR adds, <|audio_start|> 151669, <|audio_end|> 151670, <|audio_pad|> 151676. Ids the
file leaves unnamed keep its placeholder names ("[PAD151646]", ...), so every id sits where the real tokenizer has it.
The built files are cached too (written to a temporary directory, renamed when complete).

Models. ``tiny_config()``: audio encoder 2 layers, d_model 64, 2 heads, ffn 128, conv channels 32, 128 mel bins;
text decoder (Qwen3) 2 layers, hidden 64, 2 query heads / 1 kv head of dim 32, intermediate 128, the real 151936-token
vocabulary, tied embeddings. Every matrix dimension is a multiple of 32 (ggml blocks). ``real_dimension_config("0.6B"
| "1.7B", layers=2)``: the published shapes with only ``layers`` encoder and decoder layers;
``write_random_qwen3_asr(directory, "1.7B")``: the whole published model (every layer), random weights stored in
bfloat16 as the hub's checkpoints are, for measuring calibration at real size. Weights are seeded and
rounded to fp16-representable values (as a real bf16 checkpoint is), so F16 runtime files hold them exactly.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (AutoTokenizer, GenerationConfig, Qwen3ASRConfig, Qwen3ASRFeatureExtractor,
                          Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor)

from ..data.real_clips import cache_root, download_distribution, extract_member
from ..hashing import file_sha256

__all__ = ["write_random_qwen3_asr"]

SEED = 0
VOCAB_SIZE = 151936
LLAMA_CPP_PYTHON_SDIST = "llama_cpp_python-0.3.36.tar.gz"
LLAMA_CPP_PYTHON_PROJECT = "llama-cpp-python"
VOCAB_MEMBER_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models"
VOCAB_FILE = "ggml-vocab-qwen2.gguf"
VOCAB_TEST_SUFFIXES = (".inp", ".out")
VOCAB_SHA256 = "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"
VOCAB_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"
TOKENIZER_CACHE_VERSION = "1"
# The Qwen2 pre-tokenizer split pattern (Qwen2's tokenizer.json, llama.cpp's "qwen2" pre-tokenizer).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                 r"\s+(?!\S)|\s+")
AUDIO_TOKENS = {151669: "<|audio_start|>", 151670: "<|audio_end|>", 151676: "<|audio_pad|>"}
LAST_ADDED_ID = max(AUDIO_TOKENS)
GGUF_TOKEN_NORMAL, GGUF_TOKEN_CONTROL = 1, 3
EXTRA_SPECIAL_TOKENS = {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                        "audio_eos_token": "<|audio_end|>"}
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
# ChatML as Qwen3-ASR formats a transcription request (the audio part is expanded by the processor).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if not (loop.last and message['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

REAL_DIMENSIONS = {
    # audio: d_model, heads, ffn, conv channels; text: hidden, heads, kv heads, head_dim, intermediate
    "0.6B": {"audio": (896, 14, 3584, 480), "text": (1024, 16, 8, 128, 3072)},
    "1.7B": {"audio": (1024, 16, 4096, 480), "text": (2048, 16, 8, 128, 6144)},
}
# (encoder layers, decoder layers) of the published models (formats/qwen3_asr_targets.QWEN3_ASR_SIZES)
FULL_LAYERS = {"0.6B": (18, 28), "1.7B": (24, 28)}
TINY_DIMENSIONS = {"audio": (64, 2, 128, 32), "text": (64, 2, 1, 32, 128)}
# the smallest widths every quantized Linear of which the K-quants' 256-value rows fit (conv_out: 32 channels x 16)
K_QUANT_DIMENSIONS = {"audio": (256, 2, 512, 32), "text": (256, 2, 1, 128, 512)}
# Weights ~N(0, 0.5^2): with transformers' default 0.02 a 64-wide random model repeats one token forever; at 0.5 its
# greedy output varies from step to step, so comparing runtimes token by token means something.
TINY_INIT_RANGE = 0.5


# ------------------------------------------------------------------------------------------------------ tokenizer
def vocab_cache_dir() -> Path:
    return cache_root() / "qwen2-vocab"


def qwen_vocab_files() -> Path:
    """Directory holding ggml-vocab-qwen2.gguf and its .inp/.out test files (fetched once, sha256-checked)."""
    directory = vocab_cache_dir()
    wanted = [VOCAB_FILE, *(VOCAB_FILE + s for s in VOCAB_TEST_SUFFIXES)]
    if not all((directory / name).is_file() for name in wanted):
        sdist = download_distribution(LLAMA_CPP_PYTHON_PROJECT, LLAMA_CPP_PYTHON_SDIST, directory)
        for name in wanted:
            extract_member(sdist, f"{VOCAB_MEMBER_DIR}/{name}", directory / name)
        sdist.unlink()  # 77 MB archive; only the 6 MB vocabulary and its tests are kept
    _check_sha256(directory / VOCAB_FILE)
    return directory


def _check_sha256(path: Path) -> None:
    digest = file_sha256(path)
    if digest != VOCAB_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest} is not the llama-cpp-python 0.3.36 file ({VOCAB_SHA256}); "
                           f"delete it to fetch it again")


def qwen_tokenizer_dir() -> Path:
    """A cached directory with the fast tokenizer files (tokenizer.json, tokenizer_config.json, ...)."""
    target = vocab_cache_dir() / f"hf-tokenizer-v{TOKENIZER_CACHE_VERSION}"
    if (target / "tokenizer.json").is_file():
        return target
    tokenizer = build_qwen_tokenizer(qwen_vocab_files() / VOCAB_FILE)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "tokenizer.json").is_file():  # not a concurrent builder that won the rename
            raise
    return target


def build_qwen_tokenizer(vocab_gguf: Path):
    """A transformers fast tokenizer from the vocabulary, merges and token types of ggml-vocab-qwen2.gguf."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(vocab_gguf).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    regular = {t: i for i, t in enumerate(tokens) if types[i] == GGUF_TOKEN_NORMAL}
    backend = Tokenizer(models.BPE(vocab=regular, merges=merges))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    added = [AUDIO_TOKENS.get(i, tokens[i]) for i in range(len(regular), LAST_ADDED_ID + 1)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                        extra_special_tokens=EXTRA_SPECIAL_TOKENS, model_max_length=131072)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def vocab_test_cases() -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test for this vocabulary: (text, expected ids)."""
    directory = qwen_vocab_files()
    inputs = (directory / (VOCAB_FILE + ".inp")).read_text(encoding="utf-8").split(VOCAB_TEST_SEPARATOR)
    outputs = (directory / (VOCAB_FILE + ".out")).read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in ids.split()]) for text, ids in zip(inputs, outputs) if text]


# ---------------------------------------------------------------------------------------------------------- model
def _config(audio: tuple[int, ...], text: tuple[int, ...], layers: int, init_range: float = 0.02,
            text_layers: int | None = None) -> Qwen3ASRConfig:
    d_model, heads, ffn, conv = audio
    hidden, q_heads, kv_heads, head_dim, intermediate = text
    audio_config = {"num_mel_bins": 128, "encoder_layers": layers, "encoder_attention_heads": heads,
                    "encoder_ffn_dim": ffn, "d_model": d_model, "output_dim": hidden,
                    "downsample_hidden_size": conv, "max_position_embeddings": 13, "initializer_range": init_range}
    text_config = {"model_type": "qwen3", "vocab_size": VOCAB_SIZE, "hidden_size": hidden,
                   "intermediate_size": intermediate, "num_hidden_layers": text_layers or layers,
                   "num_attention_heads": q_heads,
                   "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 65536,
                   "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "initializer_range": init_range}
    return Qwen3ASRConfig(audio_config=audio_config, text_config=text_config, tie_word_embeddings=True,
                          initializer_range=init_range)


def tiny_config() -> Qwen3ASRConfig:
    return _config(TINY_DIMENSIONS["audio"], TINY_DIMENSIONS["text"], layers=2, init_range=TINY_INIT_RANGE)


def k_quant_config() -> Qwen3ASRConfig:
    """One layer each, 256 wide: a model the K-quants can hold."""
    return _config(K_QUANT_DIMENSIONS["audio"], K_QUANT_DIMENSIONS["text"], layers=1, init_range=TINY_INIT_RANGE)


def real_dimension_config(size: str, layers: int = 2) -> Qwen3ASRConfig:
    dims = REAL_DIMENSIONS[size]
    return _config(dims["audio"], dims["text"], layers)


def full_size_config(size: str) -> Qwen3ASRConfig:
    """The published model: every encoder and decoder layer (FULL_LAYERS)."""
    dims = REAL_DIMENSIONS[size]
    encoder_layers, decoder_layers = FULL_LAYERS[size]
    return _config(dims["audio"], dims["text"], encoder_layers, text_layers=decoder_layers)


def write_random_qwen3_asr(directory: str | Path, size: str, dtype: torch.dtype = torch.bfloat16,
                           seed: int = SEED) -> Path:
    """The whole published ``size`` with seeded random weights built and saved in ``dtype`` (never a float32 copy:
    1.7B in float32 is 8 GB), with the real tokenizer: what a user's hub download looks like to the calibration."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration._from_config(full_size_config(size), dtype=dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=[151643, 151645], pad_token_id=151643)
    model.save_pretrained(out)
    processor_for(AutoTokenizer.from_pretrained(qwen_tokenizer_dir())).save_pretrained(out)
    return out


def processor_for(tokenizer) -> Qwen3ASRProcessor:
    return Qwen3ASRProcessor(Qwen3ASRFeatureExtractor(), tokenizer, chat_template=CHAT_TEMPLATE)


def random_model(config: Qwen3ASRConfig, seed: int = SEED) -> Qwen3ASRForConditionalGeneration:
    """Seeded random weights, rounded to fp16-representable float32 values."""
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    model.generation_config = GenerationConfig(eos_token_id=[151643, 151645], pad_token_id=151643)
    return model


def write_tiny_qwen3_asr(directory: str | Path, config: Qwen3ASRConfig | None = None) -> Path:
    """A complete transformers directory: weights, config, generation config, tokenizer and processor files."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    random_model(config or tiny_config()).save_pretrained(out)
    processor_for(tokenizer).save_pretrained(out)
    return out


def load_tiny_qwen3_asr(directory: str | Path) -> tuple[Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor]:
    model = Qwen3ASRForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    return model, Qwen3ASRProcessor.from_pretrained(directory)


def synthetic_checkpoint(config: Qwen3ASRConfig, bits: int = 4, group_size: int = 32, seed: int = SEED):
    """A lattice checkpoint with the model's exact tensor names and shapes, built without the float model: random
    codes and fp16 scales for every Linear of the default Qwen3-ASR calibration (audio tower, decoder, tied lm_head;
    the projector stays 16-bit), random fp16-representable floats for everything else (LayerNorm / RMSNorm weights
    near 1). Real-dimension configurations (151936 x 2048 head) are exported and verified in seconds this way."""
    from ..checkpoint import LatticeCheckpoint
    from ..quant.lattice import LatticeSpec, QuantizedWeight

    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in Qwen3ASRForConditionalGeneration(config).state_dict().items()}
    spec = LatticeSpec(bits, group_size)
    generator = torch.Generator().manual_seed(seed)
    lattice, tensors = {}, {}
    for name, shape in shapes.items():
        if name == TIED_EMBEDDING:
            continue
        if _on_lattice(name, shape):
            codes = torch.randint(spec.qmin, spec.qmax + 1, shape, generator=generator, dtype=torch.int8)
            scales = (torch.rand(shape[0], spec.n_groups(shape[1]), generator=generator) * 4e-3 + 1e-3).half()
            lattice[name] = QuantizedWeight(codes, scales, spec)
        else:
            noise = torch.randn(shape, generator=generator) * 0.02
            tensors[name] = (noise + (1.0 if _is_norm_weight(name) else 0.0)).half().float()
    processor = processor_for(AutoTokenizer.from_pretrained(qwen_tokenizer_dir()))
    metadata = {"method": {"name": "synthetic"}, "source_model": {"id": "synthetic", "architecture": "qwen3_asr"}}
    return LatticeCheckpoint(spec, lattice, tensors, {TIED_EMBEDDING: TIED_HEAD}, metadata,
                             _model_files(config, processor))


TIED_EMBEDDING, TIED_HEAD = "model.language_model.embed_tokens.weight", "lm_head.weight"


def _on_lattice(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and "multi_modal_projector" not in name


def _is_norm_weight(name: str) -> bool:
    return name.endswith(".weight") and ("norm" in name or "ln_post" in name)


def _model_files(config: Qwen3ASRConfig, processor: Qwen3ASRProcessor) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
