"""Offline import of CTranslate2 (faster-whisper) Whisper checkpoints into transformers.

A CTranslate2 model directory holds ``model.bin`` (all weights, little-endian binary), ``config.json``
(suppressed token ids, language ids, alignment heads) and ``tokenizer.json``. This module parses
``model.bin`` with numpy only, rebuilds the matching :class:`transformers.WhisperConfig` from the tensor
shapes, maps every tensor to its ``WhisperForConditionalGeneration`` name and checks that nothing is
missing or left over, so an imported model computes exactly what CTranslate2 computes.

Binary layout of ``model.bin`` (version 6)::

    uint32 version | string spec_name | uint32 revision | uint32 n_variables
    n_variables x (string name | uint8 rank | uint32 dims[rank] | uint8 dtype | uint32 nbytes | bytes data)
    uint32 n_aliases | n_aliases x (string alias | string target)

where ``string`` is a uint16 length (including a trailing NUL) followed by the UTF-8 bytes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)

from tarq_deploy.fileio import atomic_directory
from tarq_deploy.model_source import CONFIG_JSON, CT2_BINARY_VERSION, CT2_MODEL_BIN

__all__ = ["CT2_NUMPY_DTYPES", "Ct2Checkpoint", "END_OF_TEXT", "MULTILINGUAL_MIN_VOCAB", "NO_TIMESTAMPS",
           "START_OF_TRANSCRIPT", "TIMESTAMP_TOKEN_COUNT", "build_generation_config", "build_processor",
           "instantiate_model", "load_ct2_whisper", "plan_tensor_routes", "read_ct2_model_bin", "save_as_transformers",
           "whisper_tokenizer"]

# ---------------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------------

MODEL_BIN_NAME = CT2_MODEL_BIN
CONFIG_JSON_NAME = CONFIG_JSON
TOKENIZER_JSON_NAME = "tokenizer.json"

SUPPORTED_BINARY_VERSION = CT2_BINARY_VERSION  # what tarq_deploy.model_source recognises, this reads
WHISPER_SPEC_NAME = "WhisperSpec"
SUPPORTED_WHISPER_REVISION = 3

BFLOAT16_TYPE_ID = 5
# CTranslate2 DataType ids (include/ctranslate2/types.h) -> little-endian numpy dtypes. bfloat16 has no numpy
# dtype; it is read as uint16 and widened to float32, which is exact.
CT2_NUMPY_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    BFLOAT16_TYPE_ID: np.dtype("<u2"),
}

# Rank-0 switches CTranslate2 stores per model part; transformers' Whisper implements exactly these values
# (GELU = 3 in CTranslate2's Activation enum; pre-LayerNorm blocks; unscaled, learned position embeddings).
REQUIRED_SWITCH_VALUES: dict[str, int] = {
    "activation": 3,
    "pre_norm": 1,
    "scale_embeddings": 0,
    "alibi": 0,
    "start_from_zero_embedding": 0,
}
# Guided-alignment settings of CTranslate2's generic decoder; Whisper's alignment heads come from config.json.
IGNORED_SWITCHES = frozenset({"alignment_heads", "alignment_layer"})
NUM_HEADS_LEAF = "num_heads"

TIED_PROJECTION_NAME = "decoder/projection/weight"
EMBEDDINGS_NAME = "decoder/embeddings/weight"
HF_TIED_OUTPUT_NAME = "proj_out.weight"

# Whisper predicts timestamps in 20 ms steps over a 30 s window: <|0.00|> ... <|30.00|>.
TIMESTAMP_TOKEN_COUNT = 1501
TIMESTAMP_STEP_SECONDS = 0.02
# Smallest multilingual Whisper vocabulary; English-only models have 51864 tokens (as in openai-whisper).
MULTILINGUAL_MIN_VOCAB = 51865
# CTranslate2's default for generate(); openai-whisper's 1.0 s initial-timestamp limit in 20 ms steps.
MAX_INITIAL_TIMESTAMP_INDEX = 50

END_OF_TEXT = "<|endoftext|>"
START_OF_TRANSCRIPT = "<|startoftranscript|>"
NO_TIMESTAMPS = "<|notimestamps|>"
START_OF_PREVIOUS = "<|startofprev|>"
TASK_TOKENS = {"transcribe": "<|transcribe|>", "translate": "<|translate|>"}
REQUIRED_CONTROL_TOKENS = (END_OF_TEXT, START_OF_TRANSCRIPT, NO_TIMESTAMPS, START_OF_PREVIOUS, *TASK_TOKENS.values())

# CTranslate2 module path (without layer prefix) -> transformers module path.
GLOBAL_MODULES: dict[str, str] = {
    "encoder/conv1": "model.encoder.conv1",
    "encoder/conv2": "model.encoder.conv2",
    "encoder/position_encodings": "model.encoder.embed_positions",
    "encoder/layer_norm": "model.encoder.layer_norm",
    "decoder/embeddings": "model.decoder.embed_tokens",
    "decoder/position_encodings": "model.decoder.embed_positions",
    "decoder/layer_norm": "model.decoder.layer_norm",
}
LAYER_MODULES: dict[str, str] = {
    "self_attention/layer_norm": "self_attn_layer_norm",
    "self_attention/linear_1": "self_attn.out_proj",
    "ffn/layer_norm": "final_layer_norm",
    "ffn/linear_0": "fc1",
    "ffn/linear_1": "fc2",
    "attention/layer_norm": "encoder_attn_layer_norm",
    "attention/linear_0": "encoder_attn.q_proj",
    "attention/linear_2": "encoder_attn.out_proj",
}
# Fused projections, split into equal row blocks along axis 0. ``None`` marks the key bias: transformers'
# Whisper has none, and a per-key constant adds the same q·b to every score of a query, which softmax ignores.
FUSED_LAYER_MODULES: dict[str, tuple[str, ...]] = {
    "self_attention/linear_0": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention/linear_1": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
}
KEY_PROJECTION_SUFFIX = ".k_proj"
# CTranslate2 leaf name -> transformers leaf name (LayerNorm gamma/beta, position-encoding table).
LEAF_NAMES: dict[str, str] = {
    "weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias", "encodings": "weight",
}

LAYER_NAME_PATTERN = re.compile(r"^(encoder|decoder)/layer_(\d+)/(.+)$")


# ---------------------------------------------------------------------------------------------------------------
# model.bin reader
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Ct2Checkpoint:
    """Contents of a CTranslate2 ``model.bin``.

    ``variables`` maps each stored name to a read-only array (rank-0 switches are 0-d arrays); bfloat16
    tensors are widened to float32. ``aliases`` maps an alias name to the variable it shares storage with.
    """

    path: Path
    binary_version: int
    spec_name: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)

    def scalar(self, name: str) -> int:
        """Integer value of the rank-0 variable ``name``."""
        return int(self.variables[name].item())


class _ByteCursor:
    """Sequential little-endian reader that reports truncation with the file path and offset."""

    def __init__(self, data: bytes, path: Path) -> None:
        self.data = data
        self.path = path
        self.offset = 0

    def take(self, size: int, what: str) -> memoryview:
        end = self.offset + size
        if end > len(self.data):
            raise ValueError(
                f"{self.path}: truncated CTranslate2 model file: {what} needs {size} bytes at offset "
                f"{self.offset}, but the file has only {len(self.data)} bytes"
            )
        chunk = memoryview(self.data)[self.offset : end]
        self.offset = end
        return chunk

    def uint(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.uint("H", f"length of {what}")
        raw = bytes(self.take(length, what))
        if length == 0 or raw[-1] != 0:
            raise ValueError(f"{self.path}: corrupted CTranslate2 model file: {what} at offset "
                             f"{self.offset - length} is not NUL-terminated")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.path}: corrupted CTranslate2 model file: {what} is not UTF-8 ({error})") from None


def read_ct2_model_bin(path: str | os.PathLike[str]) -> Ct2Checkpoint:
    """Parse a CTranslate2 ``model.bin`` (binary version 6) into numpy arrays.

    Raises ``ValueError`` naming the file for an unsupported version, a truncated or corrupted file, an
    unknown data type or a size that disagrees with the tensor shape.
    """
    path = Path(path)
    cursor = _ByteCursor(path.read_bytes(), path)
    version = cursor.uint("I", "binary version")
    if version != SUPPORTED_BINARY_VERSION:
        raise ValueError(f"{path}: unsupported CTranslate2 binary version {version} "
                         f"(this reader handles version {SUPPORTED_BINARY_VERSION})")
    spec_name = cursor.string("spec name")
    revision = cursor.uint("I", "spec revision")
    variable_count = cursor.uint("I", "variable count")
    variables = dict(_read_variable(cursor) for _ in range(variable_count))
    aliases = _read_aliases(cursor)
    if cursor.offset != len(cursor.data):
        raise ValueError(f"{path}: corrupted CTranslate2 model file: {len(cursor.data) - cursor.offset} "
                         f"unexpected bytes after the alias section")
    return Ct2Checkpoint(path, version, spec_name, revision, variables, aliases)


def _read_variable(cursor: _ByteCursor) -> tuple[str, np.ndarray]:
    name = cursor.string("variable name")
    rank = cursor.uint("B", f"rank of {name}")
    shape = tuple(cursor.uint("I", f"shape of {name}") for _ in range(rank))
    type_id = cursor.uint("B", f"dtype of {name}")
    if type_id not in CT2_NUMPY_DTYPES:
        raise ValueError(f"{cursor.path}: variable {name!r} has unknown CTranslate2 dtype id {type_id} "
                         f"(known: {sorted(CT2_NUMPY_DTYPES)})")
    dtype = CT2_NUMPY_DTYPES[type_id]
    byte_count = cursor.uint("I", f"byte count of {name}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if byte_count != expected:
        raise ValueError(f"{cursor.path}: variable {name!r} declares {byte_count} bytes but shape {shape} "
                         f"of {dtype} needs {expected}")
    array = np.frombuffer(cursor.take(byte_count, f"data of {name}"), dtype=dtype).reshape(shape)
    if type_id == BFLOAT16_TYPE_ID:
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return name, array


def _read_aliases(cursor: _ByteCursor) -> dict[str, str]:
    alias_count = cursor.uint("I", "alias count")
    aliases = {}
    for _ in range(alias_count):
        alias = cursor.string("alias name")
        aliases[alias] = cursor.string(f"target of alias {alias}")
    return aliases


# ---------------------------------------------------------------------------------------------------------------
# Tensor routes: CTranslate2 variable -> transformers parameters
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRoute:
    """One CTranslate2 variable and the transformers parameters it holds, as equal row blocks (axis 0).

    A ``None`` entry is a block transformers does not store (the zero key bias of a fused projection).
    """

    ct2_name: str
    hf_names: tuple[str | None, ...]

    def split(self, array: np.ndarray) -> dict[str, np.ndarray]:
        """Cut ``array`` into the parameters this route feeds."""
        blocks = np.split(array, len(self.hf_names), axis=0)
        return {name: block for name, block in zip(self.hf_names, blocks) if name is not None}

    def join(self, parameters: dict[str, np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`split`: rebuild the CTranslate2 variable (dropped blocks become zeros)."""
        present = next(parameters[name] for name in self.hf_names if name is not None)
        blocks = [parameters[name] if name is not None else np.zeros_like(present) for name in self.hf_names]
        return np.concatenate(blocks, axis=0)


def plan_tensor_routes(variable_names: list[str]) -> tuple[list[TensorRoute], list[str]]:
    """Route every tensor variable to transformers names; return (routes, names that have no route)."""
    routes, unrouted = [], []
    for name in variable_names:
        route = _route_for(name)
        if route is None:
            unrouted.append(name)
        else:
            routes.append(route)
    return routes, unrouted


def _route_for(name: str) -> TensorRoute | None:
    module, _, leaf = name.rpartition("/")
    if leaf not in LEAF_NAMES:
        return None
    hf_leaf = LEAF_NAMES[leaf]
    if module in GLOBAL_MODULES:
        return TensorRoute(name, (f"{GLOBAL_MODULES[module]}.{hf_leaf}",))
    match = LAYER_NAME_PATTERN.match(module)
    if match is None:
        return None
    side, index, sub_module = match.groups()
    prefix = f"model.{side}.layers.{index}."
    if sub_module in LAYER_MODULES:
        return TensorRoute(name, (f"{prefix}{LAYER_MODULES[sub_module]}.{hf_leaf}",))
    if sub_module in FUSED_LAYER_MODULES:
        parts = FUSED_LAYER_MODULES[sub_module]
        return TensorRoute(name, tuple(_fused_target(prefix, part, hf_leaf) for part in parts))
    return None


def _fused_target(prefix: str, part: str, hf_leaf: str) -> str | None:
    if hf_leaf == "bias" and part.endswith(KEY_PROJECTION_SUFFIX):
        return None
    return f"{prefix}{part}.{hf_leaf}"


def _is_switch(array: np.ndarray) -> bool:
    return array.ndim == 0


# ---------------------------------------------------------------------------------------------------------------
# Config and generation config
# ---------------------------------------------------------------------------------------------------------------


def _count_layers(checkpoint: Ct2Checkpoint, side: str) -> int:
    indices = {int(match.group(2)) for name in checkpoint.variables
               if (match := LAYER_NAME_PATTERN.match(name)) and match.group(1) == side}
    if not indices or indices != set(range(len(indices))):
        raise ValueError(f"{checkpoint.path}: {side} layer indices must be 0..n-1, found {sorted(indices)}")
    return len(indices)


def _shape(checkpoint: Ct2Checkpoint, name: str) -> tuple[int, ...]:
    if name not in checkpoint.variables:
        raise ValueError(f"{checkpoint.path}: required Whisper variable {name!r} is missing")
    return tuple(int(dim) for dim in checkpoint.variables[name].shape)


def _required_scalar(checkpoint: Ct2Checkpoint, name: str) -> int:
    if name not in checkpoint.variables or checkpoint.variables[name].ndim != 0:
        raise ValueError(f"{checkpoint.path}: required scalar {name!r} is missing")
    return checkpoint.scalar(name)


def _check_switches(checkpoint: Ct2Checkpoint) -> None:
    """Reject checkpoints whose switches describe a network transformers' Whisper does not implement."""
    for name, array in checkpoint.variables.items():
        leaf = name.rpartition("/")[2]
        if not _is_switch(array) or leaf == NUM_HEADS_LEAF or leaf in IGNORED_SWITCHES:
            continue
        if leaf not in REQUIRED_SWITCH_VALUES:
            raise ValueError(f"{checkpoint.path}: unknown CTranslate2 setting {name!r} = {array.item()}")
        if int(array.item()) != REQUIRED_SWITCH_VALUES[leaf]:
            raise ValueError(f"{checkpoint.path}: {name} = {array.item()}, but Whisper needs "
                             f"{REQUIRED_SWITCH_VALUES[leaf]}")


def build_whisper_config(checkpoint: Ct2Checkpoint, token_ids: dict[str, int], ct2_config: dict) -> WhisperConfig:
    """Derive the transformers config from tensor shapes, head-count switches and special-token ids."""
    vocab_size, d_model = _shape(checkpoint, EMBEDDINGS_NAME)
    end_of_text = token_ids[END_OF_TEXT]
    return WhisperConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        num_mel_bins=_shape(checkpoint, "encoder/conv1/weight")[1],
        encoder_layers=_count_layers(checkpoint, "encoder"),
        decoder_layers=_count_layers(checkpoint, "decoder"),
        encoder_attention_heads=_required_scalar(checkpoint, f"encoder/{NUM_HEADS_LEAF}"),
        decoder_attention_heads=_required_scalar(checkpoint, f"decoder/{NUM_HEADS_LEAF}"),
        encoder_ffn_dim=_shape(checkpoint, "encoder/layer_0/ffn/linear_0/weight")[0],
        decoder_ffn_dim=_shape(checkpoint, "decoder/layer_0/ffn/linear_0/weight")[0],
        max_source_positions=_shape(checkpoint, "encoder/position_encodings/encodings")[0],
        max_target_positions=_shape(checkpoint, "decoder/position_encodings/encodings")[0],
        pad_token_id=end_of_text,
        bos_token_id=end_of_text,
        eos_token_id=end_of_text,
        decoder_start_token_id=token_ids[START_OF_TRANSCRIPT],
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [])),
        tie_word_embeddings=True,
    )


def build_generation_config(config: WhisperConfig, token_ids: dict[str, int], id_to_token: dict[int, str],
                            ct2_config: dict) -> GenerationConfig:
    """Whisper generation settings: CTranslate2's config.json pieces plus the tokenizer's control tokens."""
    end_of_text = token_ids[END_OF_TEXT]
    generation = GenerationConfig(
        decoder_start_token_id=token_ids[START_OF_TRANSCRIPT],
        bos_token_id=end_of_text,
        eos_token_id=end_of_text,
        pad_token_id=end_of_text,
        max_length=config.max_target_positions,
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [])),
        alignment_heads=[list(pair) for pair in ct2_config.get("alignment_heads", [])],
        no_timestamps_token_id=token_ids[NO_TIMESTAMPS],
        prev_sot_token_id=token_ids[START_OF_PREVIOUS],
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX,
        return_timestamps=False,
        is_multilingual=config.vocab_size >= MULTILINGUAL_MIN_VOCAB,
    )
    if generation.is_multilingual:
        # Only multilingual models get language ids: tiny.en's config.json lists 50259..50356, one past its real
        # language tokens, and transformers refuses a language argument for English-only models anyway.
        generation.lang_to_id = _language_tokens(ct2_config.get("lang_ids", []), id_to_token)
        generation.task_to_id = {task: token_ids[token] for task, token in TASK_TOKENS.items()}
    return generation


def _language_tokens(lang_ids: list[int], id_to_token: dict[int, str]) -> dict[str, int]:
    unknown = [index for index in lang_ids if index not in id_to_token]
    if unknown:
        raise ValueError(f"config.json lang_ids {unknown} are not tokens of tokenizer.json")
    return {id_to_token[index]: index for index in lang_ids}


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and processor
# ---------------------------------------------------------------------------------------------------------------


def timestamp_tokens() -> list[str]:
    """Whisper's timestamp tokens ``<|0.00|>`` ... ``<|30.00|>`` in id order."""
    return [f"<|{index * TIMESTAMP_STEP_SECONDS:.2f}|>" for index in range(TIMESTAMP_TOKEN_COUNT)]


def _special_tokens_in_id_order(tokenizer_json: dict) -> list[str]:
    added = sorted(tokenizer_json.get("added_tokens", []), key=lambda token: token["id"])
    return [token["content"] for token in added if token.get("special")]


def build_tokenizer(directory: Path, vocab_size: int) -> WhisperTokenizer:
    """WhisperTokenizer from CTranslate2's tokenizer.json, completed with the 1501 timestamp tokens.

    The control tokens become the tokenizer's extra special tokens in id order, so ``all_special_ids[-1]`` is
    ``<|notimestamps|>``, which is where transformers' Whisper decoding expects timestamps to begin.
    """
    tokenizer_path = directory / TOKENIZER_JSON_NAME
    tokenizer_json = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    backend = Tokenizer.from_file(str(tokenizer_path))
    return whisper_tokenizer(backend, _special_tokens_in_id_order(tokenizer_json), vocab_size, tokenizer_path)


def whisper_tokenizer(backend: Tokenizer, special_tokens: list[str], vocab_size: int,
                      origin: str | os.PathLike[str]) -> WhisperTokenizer:
    """WhisperTokenizer of a byte-level BPE ``backend`` whose control tokens are ``special_tokens`` (in id order),
    completed with the 1501 timestamp tokens; every Whisper source builds its tokenizer here, so they all agree."""
    missing = [token for token in timestamp_tokens() if backend.token_to_id(token) is None]
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in missing])
    _check_timestamp_ids(backend, origin, vocab_size)
    return WhisperTokenizer(
        tokenizer_object=backend,
        extra_special_tokens=special_tokens,
        unk_token=END_OF_TEXT,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
    )


def _check_timestamp_ids(backend: Tokenizer, tokenizer_path: str | os.PathLike[str], vocab_size: int) -> None:
    first_timestamp = backend.token_to_id(timestamp_tokens()[0])
    if first_timestamp != backend.token_to_id(NO_TIMESTAMPS) + 1:
        raise ValueError(f"{tokenizer_path}: <|0.00|> got id {first_timestamp}, expected right after "
                         f"{NO_TIMESTAMPS} ({backend.token_to_id(NO_TIMESTAMPS)})")
    if backend.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"{tokenizer_path}: tokenizer has {backend.get_vocab_size(with_added_tokens=True)} "
                         f"tokens with timestamps, the model has {vocab_size}")


def build_processor(tokenizer: WhisperTokenizer, num_mel_bins: int) -> WhisperProcessor:
    """Feature extractor (16 kHz, 30 s windows, ``num_mel_bins`` Slaney mel bands) paired with the tokenizer."""
    feature_extractor = WhisperFeatureExtractor(feature_size=num_mel_bins)
    return WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------------


def _check_tied_projection(checkpoint: Ct2Checkpoint) -> set[str]:
    """Accept the output projection only as the embedding matrix itself; return the names it accounts for."""
    target = checkpoint.aliases.get(TIED_PROJECTION_NAME)
    if target is not None:
        if target != EMBEDDINGS_NAME:
            raise ValueError(f"{checkpoint.path}: {TIED_PROJECTION_NAME} aliases {target!r}, "
                             f"expected the tied {EMBEDDINGS_NAME}")
        return {TIED_PROJECTION_NAME}
    projection = checkpoint.variables.get(TIED_PROJECTION_NAME)
    if projection is None:
        raise ValueError(f"{checkpoint.path}: no output projection ({TIED_PROJECTION_NAME}) found")
    if not np.array_equal(projection, checkpoint.variables[EMBEDDINGS_NAME]):
        raise ValueError(f"{checkpoint.path}: output projection differs from the token embedding; "
                         "transformers' Whisper ties them")
    return {TIED_PROJECTION_NAME}


def ct2_to_hf_arrays(checkpoint: Ct2Checkpoint) -> dict[str, np.ndarray]:
    """All transformers parameters as numpy arrays (CTranslate2 precision), checking no variable is unused."""
    accounted = _check_tied_projection(checkpoint)
    tensor_names = [name for name, array in checkpoint.variables.items()
                    if not _is_switch(array) and name not in accounted]
    routes, unrouted = plan_tensor_routes(tensor_names)
    if unrouted:
        raise ValueError(f"{checkpoint.path}: CTranslate2 variables with no transformers counterpart: "
                         f"{sorted(unrouted)}")
    arrays: dict[str, np.ndarray] = {}
    for route in routes:
        array = checkpoint.variables[route.ct2_name]
        if array.shape[0] % len(route.hf_names):
            raise ValueError(f"{checkpoint.path}: fused variable {route.ct2_name!r} of shape {array.shape} does "
                             f"not split into {len(route.hf_names)} equal blocks")
        arrays.update(route.split(array))
    return arrays


def _check_parameters_match(model: torch.nn.Module, arrays: dict[str, np.ndarray], path: Path) -> None:
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    expected.pop(HF_TIED_OUTPUT_NAME)
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: checkpoint does not fill the Whisper model exactly; "
                         f"missing parameters: {missing or 'none'}; unexpected: {extra or 'none'}")
    wrong_shapes = [f"{name}: file {arrays[name].shape} vs model {shape}"
                    for name, shape in expected.items() if tuple(arrays[name].shape) != shape]
    if wrong_shapes:
        raise ValueError(f"{path}: parameter shapes disagree with the derived config: {wrong_shapes}")


def instantiate_model(config: WhisperConfig, arrays: dict[str, np.ndarray], dtype: torch.dtype,
                      path: Path) -> WhisperForConditionalGeneration:
    # Build on the meta device so no random initialisation runs; every parameter is then assigned from the file.
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    _check_parameters_match(model, arrays, path)
    state = {name: torch.tensor(array, dtype=dtype) for name, array in arrays.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _check_no_meta_tensors(model, path)
    return model.eval()


def _check_no_meta_tensors(model: torch.nn.Module, path: Path) -> None:
    unfilled = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if unfilled:
        raise ValueError(f"{path}: parameters left unfilled after loading: {unfilled}")


# ---------------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a CTranslate2 Whisper directory needs model.bin, "
                                f"{CONFIG_JSON_NAME} and {TOKENIZER_JSON_NAME})")
    return json.loads(path.read_text(encoding="utf-8"))


def _added_token_ids(tokenizer_json: dict, tokenizer_path: Path) -> dict[str, int]:
    token_ids = {token["content"]: token["id"] for token in tokenizer_json.get("added_tokens", [])}
    missing = [token for token in REQUIRED_CONTROL_TOKENS if token not in token_ids]
    if missing:
        raise ValueError(f"{tokenizer_path}: Whisper control tokens missing from added_tokens: {missing}")
    return token_ids


def _check_whisper_spec(checkpoint: Ct2Checkpoint) -> None:
    if checkpoint.spec_name != WHISPER_SPEC_NAME:
        raise ValueError(f"{checkpoint.path}: spec {checkpoint.spec_name!r} is not {WHISPER_SPEC_NAME}")
    if checkpoint.revision != SUPPORTED_WHISPER_REVISION:
        raise ValueError(f"{checkpoint.path}: {WHISPER_SPEC_NAME} revision {checkpoint.revision} is not "
                         f"supported (expected {SUPPORTED_WHISPER_REVISION})")
    _check_switches(checkpoint)


def load_ct2_whisper(directory: str | os.PathLike[str], dtype: torch.dtype | str = torch.float32
                     ) -> tuple[WhisperForConditionalGeneration, WhisperProcessor, GenerationConfig]:
    """Import a CTranslate2 / faster-whisper Whisper directory as (model, processor, generation config).

    Every transformers parameter is filled from ``model.bin`` and every stored variable is used, otherwise a
    ``ValueError`` names the file and the offending names. fp16 weights widen to float32 exactly; ``dtype``
    "stored" keeps them in float16 when every stored tensor is float16 (else float32).
    """
    directory = Path(directory)
    checkpoint = read_ct2_model_bin(directory / MODEL_BIN_NAME)
    _check_whisper_spec(checkpoint)
    ct2_config = _read_json(directory / CONFIG_JSON_NAME)
    tokenizer_json = _read_json(directory / TOKENIZER_JSON_NAME)
    token_ids = _added_token_ids(tokenizer_json, directory / TOKENIZER_JSON_NAME)
    config = build_whisper_config(checkpoint, token_ids, ct2_config)
    if dtype == "stored":
        dtype = torch.float16 if all(a.dtype == np.float16 for a in checkpoint.variables.values() if a.ndim) \
            else torch.float32
    model = instantiate_model(config, ct2_to_hf_arrays(checkpoint), dtype, checkpoint.path)
    generation_config = build_generation_config(config, token_ids, {v: k for k, v in token_ids.items()}, ct2_config)
    model.generation_config = generation_config
    processor = build_processor(build_tokenizer(directory, config.vocab_size), config.num_mel_bins)
    return model, processor, generation_config


def save_as_transformers(directory: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a CTranslate2 Whisper directory into a transformers directory (written whole, then renamed)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists; choose a new output directory")
    model, processor, generation_config = load_ct2_whisper(directory)
    with atomic_directory(out_dir) as staging:  # renamed with the usual modes (mkdtemp, safetensors: private)
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        generation_config.save_pretrained(staging)
    return out_dir
