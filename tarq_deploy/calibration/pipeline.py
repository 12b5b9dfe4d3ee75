"""From a float model and a calibration corpus to a lattice checkpoint (the pipeline behind `tarq-deploy quantize`).

Everything that decides the result is in ``QuantizeOptions`` (options.py); the same options, model, corpus and seed give the same
checkpoint bytes (timings go to a separate log, never into the checkpoint).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
from tqdm.auto import tqdm

from .. import __version__
from ..checkpoint import LatticeCheckpoint
from ..data.corpus import TARGET_SAMPLE_RATE as SAMPLE_RATE
from ..data.rarity import DEFAULT_LANGUAGE
from ..data.corpus import Utterance, corpus_statistics, load_audio, refuse_longer_than
from ..errors import require_finite
from ..hashing import chunks_sha256
from ..machine import machine_record, peak_rss_mb, physical_memory_bytes, resident_bytes
from ..models.common import WINDOW_SECONDS, TextAudio
from ..quant.choices import DATA_FREE_METHODS
from ..quant.ggml_quants import ggml_quantize
from ..quant.lattice import LatticeSpec, QuantizedWeight
from ..quant.lattice_fit import quantize_rtn
from ..quant.precision import NARROW_DTYPES, float32_compute, freed_memory_returned, release_mapped_pages
from ..quant.recipe import TypeRecipe
from .driver import CalibrationConfig, CalibrationResult, SequentialCalibrator
from .options import Importance, QuantizeOptions
from .workdir import WorkDir, fingerprint

__all__ = ["Backbone", "quantize_backbone", "quantize_with_lookup_pass", "state_sha256", "select_calibration",
           "decode_utterances", "max_memory_bytes", "reusable_bytes", "full_float32", "DEFAULT_MAX_MEMORY"]


class Backbone(Protocol):
    """What the pipeline needs from a model adapter (models/whisper.py, models/voxtral.py)."""

    architecture: str
    model: torch.nn.Module

    def build_windows(self, utterances: list[TextAudio], k: float, pack: bool, encoder_tagging: str,
                      keep_fp_bytes: int = 0, compute_dtype: str = "float32") -> list: ...
    def stages(self) -> list: ...
    def checkpoint(self, lattice: dict[str, QuantizedWeight], spec: LatticeSpec, metadata: dict) -> LatticeCheckpoint: ...
    # Optional (Whisper): rotate the weights in place without changing the model's outputs; returns a record.
    # def rotate(self, kind: str, seed: int) -> dict: ...


def state_sha256(model: torch.nn.Module) -> str:
    """Hash of the model's tensors (names, shapes, float32 values): identifies the source whatever its file format
    and whatever precision it is held in (a float16 source held in float16 or widened to float32 hashes alike)."""
    return chunks_sha256(_tensor_chunks(model))


HASH_CHUNK_ELEMENTS = 1 << 24  # 64 MB of float32 at a time: Voxtral's 131,072 x 3,072 token table is 1.6 GB so


def _tensor_chunks(model: torch.nn.Module) -> Iterator[bytes | memoryview]:
    """Each tensor's name, dtype and shape, then its float32 values in slices of the flattened tensor (the digest
    is that of the whole bytes), each slice's memory-mapped pages released once hashed: a mapped source is
    hashed without ever being resident whole."""
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        wide = torch.float32 if t.dtype in NARROW_DTYPES else t.dtype
        yield f"{name}:{wide}:{tuple(t.shape)}".encode()
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), HASH_CHUNK_ELEMENTS):
            part = flat[start:start + HASH_CHUNK_ELEMENTS]
            yield memoryview(part.to(wide).view(torch.uint8).numpy())  # hashed in place: a copy cost 15 % more
            release_mapped_pages([part])


def select_calibration(utterances: list[Utterance], options: QuantizeOptions) -> list[Utterance]:
    return options.calibration_utterances(utterances)


def decode_utterances(utterances: list[Utterance], segmenter: Callable | None = None,
                      log: Callable[[str], None] = print) -> list[TextAudio]:
    """The utterances' audio and text. An entry a manifest cuts from its file (offset/duration) is that stretch; an
    entry longer than one window is cut into pieces at the full-precision model's own timestamps aligned to its
    transcript (``segmenter``: the backbone's ``timestamped_segments``; data/segment.py), each said in the log, and
    refused by name when no segmenter is given or its transcript cannot be aligned."""
    audios = [load_audio(u) for u in tqdm(utterances, desc="decoding audio", unit="utt")]
    cut = sum(u.offset > 0 or u.duration is not None for u in utterances)
    if cut:
        log(f"calibration: {cut} entries cut from their files by the manifest's offset/duration")
    pieces: list[TextAudio] = []
    for utterance, audio in zip(utterances, audios):
        if len(audio) <= WINDOW_SECONDS * SAMPLE_RATE:
            pieces.append(TextAudio(utterance.id, audio, utterance.text))
            continue
        found = _aligned_pieces(utterance, audio, segmenter)
        if found is None:
            refuse_longer_than([utterance], [audio], WINDOW_SECONDS, "a calibration window (its transcript could not "
                                                                      "be aligned to the model's timestamps)"
                               if segmenter else "a calibration window")
        log(f"calibration: {utterance.id!r} ({len(audio) / SAMPLE_RATE:.1f} s) segmented into {len(found)} pieces "
            f"at the full-precision model's timestamps aligned to its transcript "
            f"({', '.join(f'{p.start_s:.1f}-{p.end_s:.1f} s' for p in found)})")
        pieces += [TextAudio(f"{utterance.id}#{i}", audio[round(p.start_s * SAMPLE_RATE):round(p.end_s * SAMPLE_RATE)],
                             p.text) for i, p in enumerate(found)]
    return pieces


def _aligned_pieces(utterance: Utterance, audio, segmenter: Callable | None) -> list | None:
    from ..data.segment import align_segments

    if segmenter is None:
        return None
    return align_segments(utterance.text, segmenter(audio), len(audio) / SAMPLE_RATE, WINDOW_SECONDS)


def quantize_backbone(backbone: Backbone, utterances: list[Utterance], options: QuantizeOptions,
                      source_id: str, work_path: Path | None = None,
                      log: Callable[[str], None] = print,
                      milestone: Callable[[str], None] | None = None,
                      importance: Importance | None = None,
                      importance_sink: dict[str, tuple[torch.Tensor, float]] | None = None,
                      ) -> tuple[LatticeCheckpoint, dict]:
    """Calibrate (or round, for rtn) every Linear of the backbone; returns the checkpoint and a timing log.

    ``milestone`` hears where the work is, for a caller that clocks its stages (bench.calibration): "windows" once
    the calibration windows are built, then "block i/N" after each calibrated block. The imatrix method either
    takes its ``importance`` ready-made (an imatrix file read by the caller: no calibration at all, as llama.cpp's
    quantize --imatrix) or fills ``importance_sink`` with what it gathered (for the caller to save; such a run does
    not resume from a work directory, whose finished blocks would be missing from it)."""
    # for the calibration's tensors only, once memory is scarce: whatever the process does next is left alone
    with freed_memory_returned(_scarce_from(backbone.model, options)) as check_memory:
        milestone = _checking_memory(check_memory, milestone, log)
        start = _Start.of(backbone, options)
        calibration: dict = {}
        fp_blocks_reused = 0  # blocks whose fp stream the windows brought along (Window.fp_stream): timing log only
        if options.method in DATA_FREE_METHODS or importance is not None:
            began = time.perf_counter()
            lattice = _round_to_nearest(backbone, options.recipe(), options.method, importance)
            result = CalibrationResult(lattice, [{"name": n.removesuffix(".weight"), "method": options.method}
                                                 for n in lattice], time.perf_counter() - began)
            if importance is not None:
                calibration = {"importance": importance.origin}
        else:
            prepared = _Windows.of(backbone, utterances, options, start)
            fp_blocks_reused = prepared.fp_blocks_reused
            milestone("windows")
            calibration = prepared.summary
            work_dir = _work_dir(work_path if importance_sink is None else None, prepared.key)
            result = _calibrate(backbone, backbone.stages(), prepared.windows, options, work_dir, log, milestone,
                                importance_sink=importance_sink)
        return _finished(backbone, result, options, source_id, start, calibration, fp_blocks_reused)


@dataclass
class _Start:
    """What a calibration records of its model before anything changes it."""

    source_sha: str
    rotation: dict | None
    peak_rss: dict  # the high-water mark as each stage ends, for the timing log
    windows_seconds: float = 0.0  # wall seconds spent building the calibration windows, for the timing log

    @classmethod
    def of(cls, backbone: Backbone, options: QuantizeOptions) -> "_Start":
        """Seed, hash the source weights, then rotate them when asked (the same rotation for the same seed)."""
        torch.manual_seed(options.seed)
        peak_rss = {"model": peak_rss_mb()}
        source_sha = state_sha256(backbone.model)
        return cls(source_sha, _rotated(backbone, options), peak_rss)


def _rotated(backbone: Backbone, options: QuantizeOptions) -> dict | None:
    """Rotate the weights in place when asked (the same rotation for the same seed); the rotation's record."""
    return backbone.rotate(options.rotate, options.seed) if options.rotate != "none" else None


@dataclass
class _Windows:
    """The calibration windows and what is recorded of them; ``key`` identifies the calibration's result (the work
    directory's fingerprint)."""

    windows: list
    summary: dict
    key: str
    fp_blocks_reused: int

    @classmethod
    def of(cls, backbone: Backbone, utterances: list[Utterance], options: QuantizeOptions,
           start: _Start) -> "_Windows":
        began = time.perf_counter()
        chosen = select_calibration(utterances, options)
        stats = corpus_statistics(chosen, options.tail_rule())
        with float32_compute(backbone.model):
            windows = backbone.build_windows(decode_utterances(chosen, getattr(backbone, "timestamped_segments",
                                                                               None)),
                                             options.tail_rule(), options.pack,
                                             options.frame_tagging(), keep_fp_bytes=reusable_bytes(options),
                                             compute_dtype=options.compute_dtype, **_whisper_only(options))
        start.peak_rss["windows"] = peak_rss_mb()
        start.windows_seconds = time.perf_counter() - began
        key = fingerprint(start.source_sha, [(u.id, u.text) for u in chosen], options.result_knobs(), __version__)
        return cls(windows, _calibration_summary(chosen, stats, windows, options), key,
                   len({name for window in windows for name in window.fp_stream}))


def _whisper_only(options: QuantizeOptions) -> dict:
    """Whisper's window options where they are not at their defaults (the other backbones take no such argument):
    the decoder shape, and the non-speech windows with the seed that draws them."""
    shape = {} if options.decoder_shape == "plain" else {"decoder_shape": options.decoder_shape}
    nonspeech = {} if options.nonspeech_share == 0.0 else {"nonspeech_share": options.nonspeech_share,
                                                           "seed": options.seed}
    return {**shape, **nonspeech}


def _calibrate(backbone: Backbone, stages: list, windows: list, options: QuantizeOptions, work_dir: WorkDir | None,
               log: Callable[[str], None], milestone: Callable[[str], None] | None = None,
               importance_sink: dict[str, tuple[torch.Tensor, float]] | None = None,
               streams: dict[str, list[dict]] | None = None,
               keep_streams_after: str | None = None) -> CalibrationResult:
    """The sequential calibration of ``stages`` (``streams``, ``keep_streams_after``: see SequentialCalibrator)."""
    config = CalibrationConfig(options.spec(), options.solver(), options.device, options.seed, options.recipe(),
                               compute_dtype=options.compute_dtype, importance_sink=importance_sink)
    with full_float32(), float32_compute(backbone.model):
        return SequentialCalibrator(stages, windows, config, work_dir, log, milestone, streams=streams,
                                    keep_streams_after=keep_streams_after).run()


def _finished(backbone: Backbone, result: CalibrationResult, options: QuantizeOptions, source_id: str,
              start: _Start, calibration: dict, fp_blocks_reused: int,
              extra_metadata: dict | None = None) -> tuple[LatticeCheckpoint, dict]:
    """The checkpoint of ``result`` and the timing log."""
    metadata = {
        "method": {"name": options.method, **options.result_knobs()},
        "layers": [_without_timing(r) for r in result.records],
        "calibration": calibration,
        "source_model": {"id": source_id, "architecture": backbone.architecture, "state_sha256": start.source_sha},
        **({"rotation": start.rotation} if start.rotation else {}),
        **(extra_metadata or {}),
        "tool": {"name": "tarq-deploy", "version": __version__},
        "machine": machine_record(),  # the scope of the same-bytes promise (machine.py)
    }
    checkpoint = backbone.checkpoint(result.lattice, options.spec(), metadata)
    start.peak_rss["calibration"] = peak_rss_mb()
    # "seconds": the calibration proper; "windows_seconds": building its windows (decoding, features and, for TARQ,
    # the alignment pass whose full-precision stream the calibration reuses): a peer's one-shot call does both
    timing = {"seconds": result.seconds, "windows_seconds": start.windows_seconds,
              "peak_rss_mb": start.peak_rss, "fp_blocks_reused": fp_blocks_reused,
              "compute_dtype": options.compute_dtype,
              "layers": [{"name": r["name"], "seconds": r.get("seconds")} for r in result.records]}
    return checkpoint, timing


def quantize_with_lookup_pass(load: Callable[[], Backbone], utterances: list[Utterance], options: QuantizeOptions,
                              source_id: str, work_path: Path | None = None,
                              log: Callable[[str], None] = print) -> tuple[LatticeCheckpoint, dict]:
    """The lookup pass, for a model whose output head is also its token lookup (Whisper: ``tied_head``).

    The first calibration, as quantize_backbone runs it, keeps the decoder's input lookup at full precision while it
    calibrates the decoder blocks: at 2 bits the lookup the runtime will do carries about 40 % of the quantized
    model's KLD (results/lookup-pass), and no block saw it. So the decoder blocks are calibrated a second time, on a
    fresh copy of the model, with the first head's lattice as the quantized stream's token lookup (the fp stream
    keeps the model's own), and the checkpoint keeps the *first* head: the file's lookup is then the one the blocks
    were calibrated against (the second pass's own head differs in every row, and the blocks' compensation missed
    it: rare KLD +0.18 on dev). The lookup reaches nothing before the decoder, so the second pass starts from what
    the first left at the encoder's end (its windows, the encoder's lattice, both streams' encoder output): the
    bytes of a whole second calibration, without its alignment pass and encoder. Each pass resumes from its own
    part of the work directory. ``load`` gives a fresh backbone each call."""
    first_dir, second_dir = (work_path / f"pass{n}" if work_path else None for n in (1, 2))
    backbone = load()
    with freed_memory_returned(_scarce_from(backbone.model, options)) as check_memory:  # both passes, as one
        start = _Start.of(backbone, options)
        prepared = _Windows.of(backbone, utterances, options, start)
        stages = backbone.stages()
        log("lookup pass: the first calibration")
        milestone = _checking_memory(check_memory, log=log)
        milestone("windows")
        first = _calibrate(backbone, stages, prepared.windows, options, _work_dir(first_dir, prepared.key), log,
                           milestone, keep_streams_after=stages[0].name)
        head = backbone.tied_head
        first_head = first.lattice[head]
        del backbone, stages  # its blocks hold lattice values now; the second pass takes a fresh copy
        second_backbone = load()
        _rotated(second_backbone, options)  # the same rotation as the first copy's
        second_backbone.quantized_lookup = first_head.dequantize()
        redone = [stage for stage in second_backbone.stages()[1:] if not _holds(stage, head)]
        log("lookup pass: the decoder again, looking its tokens up in the first head's lattice")
        second = _calibrate(second_backbone, redone, prepared.windows, options,
                            _work_dir(second_dir, fingerprint(prepared.key, "after the first pass's encoder")), log,
                            milestone, streams=first.streams)
        redone_records = {r["name"]: r for r in second.records}
        result = CalibrationResult({**first.lattice, **second.lattice},
                                   [redone_records.get(r["name"], r) for r in first.records],
                                   first.seconds + second.seconds)
        checkpoint, timing = _finished(second_backbone, result, options, source_id, start, prepared.summary,
                                       prepared.fp_blocks_reused,
                                       {"lookup_pass": {"head": "the first calibration's",
                                                        "recalibrated": [stage.name for stage in redone]}})
        timing["lookup_pass"] = {"first_pass": {"seconds": first.seconds}, "second_pass": {"seconds": second.seconds}}
        return checkpoint, timing


# Models this large take the threshold from the start: large-v3-turbo's first encoder block took it from 2.9 to 5.4 GB
# with it (bench/results/scale), and nothing between the windows and that block's end would check the mark.
THRESHOLD_FROM_THE_START_PARAMETERS = 500_000_000


def _scarce_from(model: torch.nn.Module, options: QuantizeOptions) -> int:
    """Resident memory past which the calibration has glibc return freed blocks (precision.freed_memory_returned;
    it costs 13-31 % of the calibration's time on base and tiny.en): half the memory budget, or from the start for
    a model of THRESHOLD_FROM_THE_START_PARAMETERS or more (Whisper medium and the large ones, Qwen3-ASR, Voxtral)."""
    if sum(p.numel() for p in model.parameters()) >= THRESHOLD_FROM_THE_START_PARAMETERS:
        return 0
    return max_memory_bytes(options) // 2


def _checking_memory(check_memory: Callable[[], bool], milestone: Callable[[str], None] | None = None,
                     log: Callable[[str], None] = print) -> Callable[[str], None]:
    """``milestone``, checking resident memory first at each (after the windows and after every block); says once
    where the threshold took over (the calibration runs slower from there)."""
    said = False

    def at(where: str) -> None:
        nonlocal said
        if check_memory() and not said:
            said = True
            log(f"resident memory past the mark ({(resident_bytes() or 0) / 1e9:.1f} GB) after {where}: "
                "freed tensors go back to the system from here on (glibc's 4 MB mmap threshold)")
        if milestone:
            milestone(where)
    return at


def _work_dir(path: Path | None, key: str) -> WorkDir | None:
    return WorkDir(path, key) if path else None


def _holds(stage, weight_name: str) -> bool:
    """Whether ``stage`` calibrates the Linear whose weight is ``weight_name``."""
    return any(weight_name in block.weight_names() for block in stage.blocks)


DEFAULT_MAX_MEMORY = 8 * 10**9
SOLVE_RESERVE_BYTES = 512 << 20  # the statistics and solver temporaries of the widest Linear, with room to spare


def max_memory_bytes(options: QuantizeOptions) -> int:
    """The memory budget: --max-memory, else 8 GB or half the machine's memory, whichever is less."""
    if options.max_memory is not None:
        return options.max_memory
    physical = physical_memory_bytes()
    return min(DEFAULT_MAX_MEMORY, physical // 2) if physical else DEFAULT_MAX_MEMORY


def reusable_bytes(options: QuantizeOptions) -> int:
    """What the budget leaves for work kept for reuse, beyond what the process holds now and the solver's reserve.
    The backbone keeps its reusable work only where all of it (and the blocks' working set) fits; kept or not, the
    same arithmetic gives the same bytes."""
    held = resident_bytes() or 0
    return max(0, max_memory_bytes(options) - held - SOLVE_RESERVE_BYTES)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """No TF32 while calibrating: cuDNN convolutions use it by default on Ampere and later, and its 10-bit mantissa
    moves the activations (Whisper's input convolutions) and so the Hessians, and with them near-tie codes, away
    from what the same calibration computes on a CPU."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _round_to_nearest(backbone: Backbone, recipe: TypeRecipe, method: str = "rtn",
                      importance: Importance | None = None) -> dict[str, QuantizedWeight]:
    """Data-free rounding of every Linear: our lattice's rounding (rtn), ggml's own quantizer (ggml), or ggml's
    quantizer under a ready-made importance matrix (imatrix)."""
    lattice = {}
    for stage in backbone.stages():
        for block in stage.blocks:
            for group in block.groups:
                for rel in group:
                    linear, name = block.linear(rel), f"{block.full_name(rel)}.weight"
                    require_finite(name, linear.weight, "; refusing to quantize it")
                    weight = linear.weight.detach().float().cpu()
                    spec = recipe.spec_for(name)
                    if method == "rtn":
                        q = quantize_rtn(weight, spec)
                    else:
                        q = ggml_quantize(weight, importance.of(name) if importance is not None else None, spec)
                    with torch.no_grad():
                        linear.weight.copy_(q.dequantize().to(linear.weight.device))
                    lattice[name] = q
    return lattice


def _calibration_summary(chosen: list[Utterance], stats, windows, options: QuantizeOptions) -> dict:
    nonspeech = [w for w in windows if "nonspeech" in w.info]
    windows = [w for w in windows if "nonspeech" not in w.info]  # the speech windows' figures, as before
    frames = sum(w.info["speech_frames"] for w in windows)
    rare_frames = sum(w.info["rare_frames"] for w in windows)
    tokens = sum(w.info["tokens"] for w in windows)
    rare_tokens = sum(w.info["rare_tokens"] for w in windows)
    total_frames = sum(int(w.masks["frames"].numel()) for w in windows)
    return {
        "utterances": stats.utterances, "words": stats.words, "rare_words": stats.rare_words,
        "rare_word_share": stats.rare_share, "pool": options.pool, "windows": len(windows),
        "ids": [u.id for u in chosen],
        "tail_share": {"decoder_tokens": rare_tokens / max(tokens, 1),
                       "encoder_frames": rare_frames / max(total_frames, 1)},
        "padding_frame_share": 1 - frames / max(total_frames, 1),
        **({"tail": {"mode": options.tail, "terms": options.terms.record()}} if options.terms else {}),
        **({"language": options.language} if options.language != DEFAULT_LANGUAGE else {}),
        **({"nonspeech_windows": [w.info["ids"][0] for w in nonspeech]} if nonspeech else {}),
    }


def _without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "seconds"}
